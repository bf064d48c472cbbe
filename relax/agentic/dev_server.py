"""`relax agent serve`: the agent endpoint without a training run, to write and debug an agent program
against the exact API, sessions and token bookkeeping it will be trained through.

It serves a model folder (an embedded engine started in this process) or running engines given by URL
(embedded or SGLang, through the same router a training run uses) behind the agent endpoint
(`OpenAIServer`). Any session id in `/s/<id>/v1` opens a session; plain `/v1` is the session `default`.
Every call is appended to `<out>/calls.jsonl` as it finishes (messages, reply, prompt and output tokens,
log-probs); `GET /s/<id>/trajectories` shows a session's trajectories as training would rebuild them,
and at exit every session's trajectories go to `<out>/trajectories.jsonl`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse

from relax.agentic.openai_server import OpenAIServer
from relax.agentic.session import ChatSession
from relax.agentic.trajectory import CallRecord
from relax.agentic.turns import TurnFormatter
from relax.rollout.partial_rollout import InflightRequests
from relax.rollout.router import Router

logger = logging.getLogger(__name__)


class AgentDevServer:
    def __init__(
        self,
        model_path: str,
        engine_urls: list[str],
        out_dir: str | Path,
        *,
        host: str = "127.0.0.1",
        port: int = 8000,
        model_name: str | None = None,
        defaults: dict[str, Any] | None = None,
        max_tokens: int = 1024,
        api_key: str | None = None,
        engine_api_key: str | None = None,
    ) -> None:
        """`api_key`: the token the endpoint asks its clients for (None: none); `engine_api_key`: the
        token the engines ask for."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.formatter = TurnFormatter(self.tokenizer, model_path)
        self.engine_urls = list(engine_urls)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.defaults = dict(defaults or {})
        self.max_tokens = max_tokens
        eos = {self.formatter.eos_id, self.tokenizer.eos_token_id} - {None}
        self.stop_token_ids = sorted(int(t) for t in eos)
        self.router = Router(self.engine_urls, timeout_s=600, api_key=engine_api_key)
        self.inflight = InflightRequests(self.router)
        self.server = OpenAIServer(
            model_name or Path(model_path).name, host=host, port=port, new_session=self._new_session,
            default_session="default", api_key=api_key,
        )  # fmt: skip
        self.server.app.add_api_route("/s/{session_id}/trajectories", self._trajectories, methods=["GET"])
        self.server.app.add_api_route("/sessions", self._sessions, methods=["GET"])
        self._calls = (self.out_dir / "calls.jsonl").open("a")

    async def _generate(self, prompt_ids: list[int], params: dict[str, Any], **client_kwargs: Any) -> Any:
        (out,) = await self.inflight.generate(prompt_ids, params, **client_kwargs)
        return out

    def _new_session(self, session_id: str) -> ChatSession:
        logger.info("session %s opened", session_id)
        return ChatSession(
            session_id, self.formatter, self._generate, defaults=self.defaults, max_tokens_cap=self.max_tokens,
            stop_token_ids=self.stop_token_ids, model_name=self.server.model_name, on_record=self._write_call,
        )  # fmt: skip

    def _write_call(self, session: ChatSession, rec: CallRecord) -> None:
        row = {
            "time": time.time(), "session": session.session_id, "call": rec.index, "parent": rec.parent,
            "reply": rec.reply_message, "finish_reason": rec.finish_reason, "weight_version": rec.weight_version,
            "prompt_text": self.tokenizer.decode(rec.prompt_ids, skip_special_tokens=False),
            "prompt_ids": rec.prompt_ids, "output_ids": rec.output_ids, "log_probs": rec.log_probs,
        }  # fmt: skip
        self._calls.write(json.dumps(row) + "\n")
        self._calls.flush()

    def trajectories(self, session: ChatSession) -> list[dict[str, Any]]:
        out = []
        for t in session.recorder.build_trajectories():
            row = {"session": session.session_id, **asdict(t)}
            row["prompt_text"] = self.tokenizer.decode(t.prompt_ids, skip_special_tokens=False)
            row["response_text"] = self.tokenizer.decode(t.response_ids, skip_special_tokens=False)
            out.append(row)
        return out

    async def _trajectories(self, session_id: str) -> Any:
        session = self.server.sessions.get(session_id)
        if session is None:
            return JSONResponse({"error": {"message": f"no session {session_id!r}"}}, status_code=404)
        return self.trajectories(session)

    async def _sessions(self) -> Any:
        return [{"session": sid, "calls": len(s.recorder.calls)} for sid, s in self.server.sessions.items()]

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then write every session's trajectories."""
        await self.router.probe()
        url = await self.server.start()
        logger.info("agent endpoint at %s/v1 (session <id>: %s/s/<id>/v1); calls go to %s", url, url,
                    self.out_dir / "calls.jsonl")  # fmt: skip
        try:
            await stop.wait()
        finally:
            await self.server.stop()
            await self.router.close()
            with (self.out_dir / "trajectories.jsonl").open("w") as f:
                for session in self.server.sessions.values():
                    for row in self.trajectories(session):
                        f.write(json.dumps(row) + "\n")
            self._calls.close()
