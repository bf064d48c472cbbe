"""The packed `/generate` reply: the answer of Relax's embedded engine to Relax's own client.

SGLang's reply spends a JSON triple per generated token (`[log-prob, token id, null]`) plus the token
id again in `output_ids`. At the response lengths of reasoning RL (thousands of tokens, a GRPO group of
8 samples a request) writing those lists on the engine and reading them on the Rollout is most of a
reply's cost, and when a step's rows all end on the engine's last step, every reply is written and read
after it, on the RL step's critical path (docs/engines.md, "The replies of that step").

The packed reply is the same items, sent as MessagePack, with the two per-token lists as raw arrays:

* `output_ids`: little-endian int32 bytes;
* `meta_info["output_token_logprob_values"]`: little-endian float64 bytes, one per output token, in
  place of `output_token_logprobs` (float64, so that every value is the one the JSON reply would carry,
  bit for bit).

Everything else (the prompt's log-probs, top log-probs, finish reason, versions) keeps its JSON shape.
A client asks for it with an `Accept` header (`ACCEPT`) and reads whichever the server sent, by the
reply's content type: SGLang and any other server ignore the header and answer JSON, so the client
needs no knowledge of which engine it talks to. The engine packs only replies whose log-probs carry no
token text (`return_text_in_logprobs` off); streaming stays server-sent JSON events.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

MEDIA_TYPE = "application/vnd.relax.generate+msgpack"
ACCEPT = f"{MEDIA_TYPE}, application/json;q=0.5"
LOGPROB_VALUES = "output_token_logprob_values"  # meta_info key of the packed output log-probs

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()
_IDS, _LOGPROBS = np.dtype("<i4"), np.dtype("<f8")


def accepts_packed(accept: str | None) -> bool:
    """Whether an `Accept` header names the packed reply's media type."""
    if not accept:
        return False
    return any(part.split(";", 1)[0].strip() == MEDIA_TYPE for part in accept.split(","))


def pack_ids(ids: list[int]) -> bytes:
    return np.asarray(ids, dtype=_IDS).tobytes()


def pack_logprobs(logprobs: list[float]) -> bytes:
    return np.asarray(logprobs, dtype=_LOGPROBS).tobytes()


def unpack_ids(data: bytes) -> list[int]:
    return np.frombuffer(data, dtype=_IDS).tolist()


def unpack_logprobs(data: bytes) -> list[float]:
    return np.frombuffer(data, dtype=_LOGPROBS).tolist()


def encode(items: Any) -> bytes:
    return _ENCODER.encode(items)


def decode(body: bytes) -> Any:
    """A packed body's items; a body that is not MessagePack raises `msgspec.DecodeError`."""
    return _DECODER.decode(body)
