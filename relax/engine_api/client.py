"""`EngineClient`: the async HTTP client of an inference engine, for the embedded engine and for SGLang
servers alike (it sends only SGLang's native field names; see `protocol.py`).

Errors: an engine that does not answer (refused connection, timeout, dropped connection) raises
`EngineUnavailableError` naming the URL and what to check; an answer with status >= 400 raises
`EngineRequestError` carrying the server's message.

Transport: aiohttp (a dependency of Ray Serve already), which spends far less client CPU per request than
httpx at the concurrency a rollout runs (docs/measurements.md; `python benchmarks/engine_client.py`): the
Rollout replica shares its cores with engines and trainer.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from relax.engine_api import packed
from relax.engine_api.protocol import version_to_engine
from relax.utils.auth import engine_headers
from relax.utils.gc_freeze import collector_paused

logger = logging.getLogger(__name__)
_DECODER = msgspec.json.Decoder()


class EngineError(RuntimeError):
    """Base of the client's errors."""


class EngineUnavailableError(EngineError):
    """The engine did not answer."""


class EngineRequestError(EngineError):
    """The engine answered with an error status; `status` and `message` are the server's."""

    def __init__(self, url: str, status: int, message: str) -> None:
        super().__init__(f"{url} answered {status}: {message}")
        self.url, self.status, self.message = url, status, message

    def __reduce__(self) -> tuple:  # Ray sends it between processes: rebuilt from its fields, not its text
        return type(self), (self.url, self.status, self.message)


@dataclass
class GenerateOutput:
    """One generated sample."""

    output_ids: list[int]  # generated token ids (a matched stop token included)
    output_log_probs: list[float]  # log-prob of each output token under the sampler ([] if not asked)
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None  # version of the weights when the sample finished
    text: str = ""  # decoded output ("" when the engine has no tokenizer)
    matched: int | str | None = None  # stop token id or stop string that ended it
    prompt_tokens: int = 0
    rid: str | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)  # the raw meta_info
    # when the weights changed while it ran (an embedded engine paused `in_place` for an update): the
    # versions its tokens came from, oldest first, and the output index where each began
    weight_versions: list[str] = field(default_factory=list)
    weight_version_starts: list[int] = field(default_factory=list)
    # with `top_logprobs_num`: the k most likely tokens at each output position, [(log-prob, token id)]
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)

    @classmethod
    def from_json(cls, item: dict[str, Any]) -> GenerateOutput:
        """A sample of SGLang's JSON reply, or of the packed one (`relax.engine_api.packed`: the output
        ids and log-probs as raw arrays)."""
        meta = item.get("meta_info", {})
        finish = meta.get("finish_reason") or {}
        logprobs = meta.get("output_token_logprobs") or []
        version = meta.get("weight_version")
        ids = item.get("output_ids")
        if isinstance(ids, bytes):
            ids = packed.unpack_ids(ids)
        if packed.LOGPROB_VALUES in meta:
            meta = dict(meta)  # meta_info keeps JSON's shape: the packed bytes are read, not kept
            values = packed.unpack_logprobs(meta.pop(packed.LOGPROB_VALUES))
        else:
            values = [float(lp[0]) for lp in logprobs]
        return cls(
            output_ids=list(ids or [lp[1] for lp in logprobs]),
            output_log_probs=values,
            finish_reason=finish.get("type", "stop") if isinstance(finish, dict) else str(finish),
            weight_version=version_to_engine(version),
            text=item.get("text") or "",
            matched=finish.get("matched") if isinstance(finish, dict) else None,
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            rid=meta.get("id"),
            meta_info=meta,
            weight_versions=[version_to_engine(v) for v in meta.get("weight_versions") or []],
            weight_version_starts=[int(i) for i in meta.get("weight_version_starts") or []],
            output_top_logprobs=[
                [(float(a[0]), int(a[1])) for a in pos or []] for pos in meta.get("output_top_logprobs") or []
            ],
        )


@dataclass
class Reply:
    """An engine's answer, read in full."""

    status: int
    body: bytes
    reason: str
    content_type: str = "application/json"

    def json(self) -> Any:
        """The body as JSON, read by msgspec's decoder, which is faster than the standard library's on
        the long lists of a reply (`benchmarks/engine_reply.py`). It refuses the `NaN` and `Infinity`
        tokens that the standard library accepts (and some servers write): those bodies go to
        `json.loads`."""
        try:
            return _DECODER.decode(self.body)
        except msgspec.DecodeError:
            return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def read_outputs(reply: Reply) -> GenerateOutput | list[GenerateOutput]:
    """The samples of a `/generate` reply, read with Python's cyclic collector paused: a reply is a burst
    of small lists that all live until it is read (a `[logprob, id, null]` triple per token), so
    collections triggered inside it each walk again the triples read so far and the process's other
    objects. Afterwards the triples are freed by their reference counts (no cycles). When a step's rows
    end together, every reply is read after the engine's last step, on the RL step's critical path.
    A Relax engine's packed reply (`relax.engine_api.packed`, by its content type) has no triples.
    Figures: `benchmarks/engine_reply.py`, docs/measurements.md."""
    with collector_paused():
        data = packed.decode(reply.body) if reply.content_type == packed.MEDIA_TYPE else reply.json()
        if isinstance(data, list):
            return [GenerateOutput.from_json(d) for d in data]
        return GenerateOutput.from_json(data)


class EngineClient:
    def __init__(
        self,
        base_url: str,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 10.0,
        max_connections: int = 1024,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the engine's bearer token; None = the engine's key derived from this process's run
        token (`engine_key` in relax/utils/auth.py: an engine never gets the run's token itself)."""
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _timeout(self, total: float | None) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=total, sock_connect=self.connect_timeout_s)

    def _http(self) -> aiohttp.ClientSession:
        # A session is bound to the event loop it was made on; make one per loop.
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            if self._session is not None:
                _abandon(self._session, self._loop)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=self._timeout(self.timeout_s),
                headers=engine_headers(self.base_url, self.api_key),
            )
            self._loop = loop
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        if self._loop is asyncio.get_running_loop():
            await session.close()
        else:
            _abandon(session, self._loop)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        timeout: float | None = None,
        accept: str | None = None,
    ) -> Reply:
        url = f"{self.base_url}{path}"
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        if timeout is not None:
            kwargs["timeout"] = self._timeout(timeout)
        if accept is not None:
            kwargs["headers"] = {"Accept": accept}
        try:
            async with self._http().request(method, url, **kwargs) as resp:
                reply = Reply(resp.status, await resp.read(), resp.reason or "", resp.content_type)
        except TimeoutError as e:  # aiohttp's timeouts derive from it
            raise EngineUnavailableError(
                f"inference engine at {url} did not answer in time ({type(e).__name__}); check that it is running "
                "and not overloaded, or raise the client's timeout_s"
            ) from e
        except aiohttp.ClientError as e:
            raise EngineUnavailableError(
                f"inference engine at {url} is unreachable ({type(e).__name__}: {e}); check that the engine "
                "process is running and listening on that host and port"
            ) from e
        if reply.status >= 400:
            raise EngineRequestError(url, reply.status, _error_message(reply))
        return reply

    # -- generation -----------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int] | list[list[int]],
        sampling_params: dict[str, Any] | None = None,
        rid: str | list[str] | None = None,
        return_logprob: bool = True,
        multimodal_inputs: dict[str, Any] | None = None,
        *,
        top_logprobs_num: int = 0,
        on_chunk: Callable[[int, GenerateOutput], None] | None = None,
    ) -> GenerateOutput | list[GenerateOutput]:
        """Generate for one prompt (a `GenerateOutput`) or, with a batch of prompts or `n > 1`, a list
        grouped by prompt (prompt 0's samples first). `multimodal_inputs`: one prompt's media tensors,
        sent as safetensors + base64 (a Relax engine extension of `/generate`). `top_logprobs_num`: the k
        most likely tokens at each output position too. `on_chunk(index, output so far)`: stream
        (`stream: true`; the outputs so far carry `finish_reason` ""), the return value is the same."""
        body: dict[str, Any] = {
            "input_ids": input_ids,
            "sampling_params": sampling_params or {},
            "return_logprob": return_logprob,
        }
        if top_logprobs_num:
            body["top_logprobs_num"] = top_logprobs_num
        if multimodal_inputs:
            from relax.data.mm_codec import encode_inputs

            body["multimodal_inputs"] = encode_inputs(multimodal_inputs)
        if rid is not None:
            body["rid"] = rid
        if on_chunk is not None:
            return await self._generate_stream(body, on_chunk)
        # a Relax engine answers packed (its output ids and log-probs as raw arrays), any other JSON
        reply = await self._request("POST", "/generate", body, accept=packed.ACCEPT)
        try:
            return read_outputs(reply)
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:  # msgspec's errors too
            # the engine's fault, not the request's: the router takes it out and retries elsewhere
            raise EngineUnavailableError(
                f"inference engine at {self.base_url}/generate sent a reply that is not a generate reply "
                f"({reply.content_type}, {len(reply.body)} bytes: {type(e).__name__}: {e}); check the "
                "engine's log and that the URL is an SGLang or Relax engine"
            ) from e

    async def _generate_stream(
        self, body: dict[str, Any], on_chunk: Callable[[int, GenerateOutput], None]
    ) -> GenerateOutput | list[GenerateOutput]:
        """`/generate` with `stream: true`: server-sent events, each a sample's output so far (SGLang's
        cumulative shape, `index` telling samples apart); the last event of each sample is final."""
        url = f"{self.base_url}/generate"
        finals: dict[int, GenerateOutput] = {}
        try:
            async with self._http().post(url, json={**body, "stream": True}) as resp:
                if resp.status >= 400:
                    raise EngineRequestError(
                        url,
                        resp.status,
                        _error_message(Reply(resp.status, await resp.read(), resp.reason or "")),
                    )
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    item = json.loads(line[5:])
                    if "error" in item:
                        raise EngineRequestError(
                            url, 500, _error_message(Reply(500, json.dumps(item).encode(), ""))
                        )
                    index = int(item.get("index", 0))
                    out = GenerateOutput.from_json(item)
                    if item.get("meta_info", {}).get("finish_reason") is None:
                        out.finish_reason = ""
                        on_chunk(index, out)
                    else:
                        finals[index] = out
        except TimeoutError as e:
            raise EngineUnavailableError(
                f"inference engine at {url} did not answer in time while streaming"
            ) from e
        except aiohttp.ClientError as e:
            raise EngineUnavailableError(
                f"inference engine at {url} is unreachable ({type(e).__name__}: {e})"
            ) from e
        outs = [finals[i] for i in sorted(finals)]
        ids, params = body["input_ids"], body.get("sampling_params") or {}
        batched = (bool(ids) and isinstance(ids[0], list)) or int(params.get("n", 1)) > 1
        return outs if batched else outs[0]

    # -- state ----------------------------------------------------------------------------------
    async def health(self, timeout_s: float | None = 10.0) -> bool:
        """True when the engine answers `/health` (raises `EngineUnavailableError` when it does not)."""
        await self._request("GET", "/health", timeout=timeout_s)
        return True

    async def health_generate(self, timeout_s: float | None = 60.0) -> bool:
        """True when the engine generates one token (`/health_generate`); raises like `health`."""
        await self._request("GET", "/health_generate", timeout=timeout_s)
        return True

    async def weight_version(self) -> str | None:
        """The version of the weights the engine holds now (`/get_weight_version`)."""
        version = (await self._request("GET", "/get_weight_version")).json().get("weight_version")
        return version_to_engine(version)

    async def model_info(self) -> dict[str, Any]:
        return (await self._request("GET", "/get_model_info")).json()

    async def metrics_text(self) -> str:
        return (await self._request("GET", "/metrics")).text

    async def pause(self, mode: str = "retract") -> None:
        """Stop generating; returns once paused. `retract` (default) keeps requests and recomputes their
        KV cache on resume; `in_place` keeps the cache; `abort` ends every request."""
        await self._request("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", {})

    async def flush_cache(self) -> None:
        await self._request("POST", "/flush_cache")

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        await self._request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def slow_down(self, forward_sleep_time: float | None) -> None:
        """Make the engine sleep this long after every step (None = full speed); for tests."""
        await self._request("POST", "/slow_down", {"forward_sleep_time": forward_sleep_time})

    # -- weights --------------------------------------------------------------------------------
    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> dict[str, Any]:
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return _checked(
            self.base_url, (await self._request("POST", "/init_weights_update_group", body)).json()
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        weight_version: str | None = None,
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> dict[str, Any]:
        """`load_format="flattened_bucket"` (Relax receivers): the bucket comes as one packed buffer."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "group_name": group_name,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        if load_format is not None:
            body["load_format"] = load_format
        return _checked(
            self.base_url, (await self._request("POST", "/update_weights_from_distributed", body)).json()
        )

    async def update_weights_from_ipc(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        handle: dict[str, Any],
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        """Load a bucket packed in a CUDA buffer of the caller's (`relax.weights.ipc.share`);
        only for receivers on the same GPU, and only Relax's own (SGLang has no such endpoint)."""
        body = {
            "names": names,
            "dtypes": dtypes,
            "shapes": shapes,
            "handle": handle,
            "flush_cache": flush_cache,
            "weight_version": weight_version,
        }
        return _checked(self.base_url, (await self._request("POST", "/update_weights_from_ipc", body)).json())

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> dict[str, Any]:
        body = {"group_name": group_name}
        return _checked(
            self.base_url, (await self._request("POST", "/destroy_weights_update_group", body)).json()
        )

    async def update_weights_from_disk(self, path: str, weight_version: str | None = None) -> dict[str, Any]:
        body = {"model_path": str(path), "weight_version": weight_version}
        return _checked(
            self.base_url, (await self._request("POST", "/update_weights_from_disk", body)).json()
        )


def _error_message(resp: Reply) -> str:
    try:
        data = resp.json()
    except ValueError:
        return resp.text.strip() or resp.reason
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return str(data)


def _abandon(session: aiohttp.ClientSession, loop: asyncio.AbstractEventLoop | None) -> None:
    """Close a session made on another event loop: on that loop if it still runs; otherwise mark it
    closed in place (nothing can run on a closed loop, and its sockets went with it) so that aiohttp
    does not report it unclosed when it is collected."""
    if loop is not None and loop.is_running() and not loop.is_closed():
        asyncio.run_coroutine_threadsafe(session.close(), loop)
        return
    connector = session.connector
    session.detach()
    if connector is not None and (loop is None or loop.is_closed()):
        # aiohttp's public close() is a coroutine, and nothing can await it on a closed loop; its
        # synchronous part marks the connector closed and, with the loop closed, does nothing else.
        connector._close()  # noqa: SLF001


def _checked(url: str, data: dict[str, Any]) -> dict[str, Any]:
    if isinstance(data, dict) and data.get("success") is False:
        raise EngineRequestError(url, 200, str(data.get("message")))
    return data
