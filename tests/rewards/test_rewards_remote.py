"""The remote reward against a real HTTP server on 127.0.0.1, alone and through the scorer."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from relax.data.sample import Sample
from relax.rewards import RewardConfig, RewardScorer
from relax.rewards.remote import remote


class _Handler(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        _Handler.received.append(body)
        if self.path == "/slow":
            time.sleep(1.0)
        if self.path == "/error":
            self._answer(500, b"internal error")
        elif self.path == "/not-json":
            self._answer(200, b"<html>")
        elif self.path == "/number":
            self._answer(200, b"0.25")
        elif self.path == "/auth" and self.headers.get("authorization") != "Bearer t0k":
            self._answer(401, b"{}")
        else:
            correct = float(body["response"].strip() == str(body["label"]))
            answer = {"reward": correct, "length": len(body["response"]), "note": "ok"}
            self._answer(200, json.dumps(answer).encode())

    def _answer(self, status: int, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:  # keep the test output clean
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the client of /slow hangs up before the answer: expected, not worth a traceback


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _sample(response: str, label: object = "7", index: int = 0) -> Sample:
    return Sample(index=index, prompt="3+4=", label=label, response_text=response, metadata={"source": "toy"})


def test_remote_posts_the_sample_and_reads_the_answer(server: str) -> None:
    _Handler.received.clear()
    out = asyncio.run(remote(_sample("7", index=5), url=f"{server}/score"))
    assert out == {"reward": 1.0, "length": 1, "note": "ok"}
    body = _Handler.received[-1]
    assert body == {
        "index": 5,
        "group_id": 0,
        "prompt": "3+4=",
        "response": "7",
        "label": "7",
        "metadata": {"source": "toy"},
    }
    assert asyncio.run(remote(_sample("x"), url=f"{server}/number")) == 0.25
    auth = {"authorization": "Bearer t0k"}
    assert asyncio.run(remote(_sample("7"), url=f"{server}/auth", headers=auth))["reward"] == 1.0


def test_remote_sends_unserializable_labels_as_text(server: str) -> None:
    _Handler.received.clear()
    asyncio.run(remote(_sample("7", label={1, 2}), url=f"{server}/score"))
    assert _Handler.received[-1]["label"] in ("{1, 2}", "{2, 1}")


@pytest.mark.parametrize(
    "path, error",
    [
        ("/error", httpx.HTTPStatusError),
        ("/not-json", json.JSONDecodeError),
        ("/auth", httpx.HTTPStatusError),
    ],
)
def test_remote_errors_raise(server: str, path: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        asyncio.run(remote(_sample("7"), url=f"{server}{path}"))


def test_remote_own_timeout_raises(server: str) -> None:
    with pytest.raises(httpx.TimeoutException):
        asyncio.run(remote(_sample("7"), url=f"{server}/slow", timeout_s=0.1))


def test_remote_through_the_scorer_with_fallbacks(server: str) -> None:
    batch = [_sample("7", index=0), _sample("8", index=1), _sample("7", index=2), _sample("7", index=3)]
    batch[3].metadata["rm_type"] = "first_number"
    cfg = RewardConfig(name="remote", kwargs={"url": f"{server}/score"}, timeout_s=5.0, fallback_reward=-1.0)
    stats = RewardScorer(cfg).score_sync(batch)
    assert [s.reward for s in batch] == [1.0, 0.0, 1.0, 1.0]
    assert batch[0].reward_info == {"length": 1.0}  # "note" is not numeric: not a metric
    assert stats.counts == {"remote": 3, "first_number": 1} and stats.failures == 0

    down = RewardConfig(name="remote", kwargs={"url": f"{server}/error"}, fallback_reward=-1.0)
    batch = [_sample("7")]
    stats = RewardScorer(down).score_sync(batch)
    assert batch[0].reward == -1.0 and stats.failures == 1

    slow = RewardConfig(name="remote", kwargs={"url": f"{server}/slow"}, timeout_s=0.1)
    stats = RewardScorer(slow).score_sync(batch)
    assert batch[0].reward == 0.0 and stats.timeouts == 1


def test_remote_connection_refused_falls_back() -> None:
    with socket.socket() as sock:  # a port that was free a moment ago: nothing listens there
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = RewardConfig(name="remote", kwargs={"url": f"http://127.0.0.1:{port}/score"}, fallback_reward=-1.0)
    batch = [_sample("7")]
    stats = RewardScorer(cfg).score_sync(batch)
    assert batch[0].reward == -1.0 and stats.failures == 1
