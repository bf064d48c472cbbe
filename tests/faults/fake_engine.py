"""An external engine that refuses the weight-sync group: a tiny real HTTP server on 127.0.0.1 that
answers `/health` and `/health_generate` with 200 and `/init_weights_update_group` with 400 (SGLang's
`{"success": false, "message": ...}`), and 404 to anything else. It records every request it got (path
and whether it carried a bearer token), so a test can also see what an external engine learns."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REFUSAL = "fake engine: this engine refuses the weight-sync group"


class FakeEngine:
    def __init__(self) -> None:
        self.requests: list[dict] = []  # {"method", "path", "authorization"}: every request, in order
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                path = self.path.split("?", 1)[0]
                engine.requests.append(
                    {"method": self.command, "path": path, "authorization": self.headers.get("Authorization")}
                )
                if path in ("/health", "/health_generate"):
                    code, body = 200, {}
                elif path == "/init_weights_update_group":
                    code, body = 400, {"success": False, "message": REFUSAL}
                else:
                    code, body = 404, {"detail": f"{path} is not served by the fake engine"}
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

            def log_message(self, *args: object) -> None:  # quiet: the harness reports what matters
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeEngine:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def paths(self) -> list[str]:
        return [r["path"] for r in self.requests]
