"""Flat weight buckets and CUDA IPC handles: the two fast paths of weight sync.

* **Flattened buckets**: a bucket of tensors travels as one contiguous byte buffer (each tensor starting
  at a 256-byte aligned offset, in bucket order), so a broadcast is one collective per bucket instead of
  one per tensor. Both sides derive the offsets from the (name, dtype, shape) list alone (`layout`); the
  wire carries no offsets.
* **CUDA IPC**: a receiver on the same physical GPU as a trainer rank (an engine colocated with it, the
  ActorFwd beside the trainer in fully_async) needs no collective at all: the rank packs the bucket on its
  GPU and sends the buffer's CUDA IPC handle (JSON, base64 fields); the receiver maps the same memory,
  copies into its parameters and answers; only then does the rank free the buffer. NCCL cannot serve
  such receivers (it refuses two ranks of one communicator on one GPU), and gloo goes through host
  memory, so this is what makes colocated sync cheap.

GPUs are matched by UUID, not by index: Ray gives every actor its own `CUDA_VISIBLE_DEVICES`, so the
same GPU can be `cuda:0` in one process and `cuda:1` in another.
"""

from __future__ import annotations

import base64
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

ALIGN = 256
FLAT = "flattened_bucket"  # the `load_format` value of a flat-buffer update
# CUDA cannot open an IPC handle in the process that made it: a receiver in the sender's own process
# (an in-process engine) finds the buffer here instead.
_OWN: weakref.WeakValueDictionary[str, Tensor] = weakref.WeakValueDictionary()


def _nbytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def layout(specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> tuple[list[int], int]:
    """Byte offsets of each tensor in the flat buffer, and the buffer's size."""
    offsets, end = [], 0
    for _, dtype, shape in specs:
        start = -(-end // ALIGN) * ALIGN
        offsets.append(start)
        end = start + _nbytes(dtype, shape)
    return offsets, max(end, 1)


def pack(bucket: Sequence[tuple[str, Tensor]], device: torch.device) -> Tensor:
    """One uint8 buffer on `device` holding every tensor of `bucket` at its `layout` offset."""
    offsets, total = layout([(n, t.dtype, t.shape) for n, t in bucket])
    buf = torch.empty(total, dtype=torch.uint8, device=device)
    for (_, t), off in zip(bucket, offsets, strict=True):
        nbytes = t.numel() * t.element_size()
        buf[off : off + nbytes].view(t.dtype).view(t.shape).copy_(t.detach(), non_blocking=True)
    return buf


def unpack(buf: Tensor, specs: Sequence[tuple[str, torch.dtype, Sequence[int]]]) -> dict[str, Tensor]:
    """Views into `buf` by name (no copy); the inverse of `pack`."""
    offsets, total = layout(specs)
    if buf.numel() < total:
        raise ValueError(f"flat weight buffer holds {buf.numel()} bytes; the tensors listed need {total}")
    out = {}
    for (name, dtype, shape), off in zip(specs, offsets, strict=True):
        out[name] = buf[off : off + _nbytes(dtype, shape)].view(dtype).view(tuple(shape))
    return out


def device_uuid(device: torch.device | str | None) -> str | None:
    """The physical GPU's UUID (None for CPU devices or without CUDA)."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def local_index(uuid: str) -> int:
    """The index under which this process sees the GPU with `uuid`."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    raise ValueError(
        f"GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES); a CUDA IPC receiver must "
        "sit on the sender's GPU"
    )


def _b64(value: bytes | None) -> str | None:
    return None if value is None else base64.b64encode(value).decode()


def _unb64(value: str | None) -> bytes | None:
    return None if value is None else base64.b64decode(value)


def share(buf: Tensor) -> dict[str, Any]:
    """A JSON-able CUDA IPC handle of `buf` (a contiguous uint8 CUDA tensor that must outlive its use)."""
    if buf.device.type != "cuda" or buf.dtype != torch.uint8 or buf.storage_offset() != 0:
        raise ValueError("share() takes a fresh uint8 CUDA buffer from pack()")
    (_, handle, size, offset, ref_handle, ref_offset, event, event_sync) = (
        buf.untyped_storage()._share_cuda_()
    )
    _OWN[f"{_b64(handle)}:{offset}"] = buf
    return {
        "pid": os.getpid(),
        "uuid": device_uuid(buf.device),
        "handle": _b64(handle),
        "size": int(size),
        "offset": int(offset),
        "ref_handle": _b64(ref_handle),
        "ref_offset": int(ref_offset),
        "event": _b64(event),
        "event_sync": bool(event_sync),
        "nbytes": buf.numel(),
    }


def open_shared(h: dict[str, Any]) -> Tensor:
    """Map the buffer behind a `share` handle in this process (same GPU); drop it when done."""
    if h.get("pid") == os.getpid():
        own = _OWN.get(f"{h.get('handle')}:{h.get('offset')}")
        if own is None:
            raise ValueError("CUDA IPC handle of this process whose buffer is gone; share it again")
        return own
    try:
        device = local_index(h["uuid"])
        storage = torch.UntypedStorage._new_shared_cuda(
            device,
            _unb64(h["handle"]),
            int(h["size"]),
            int(h["offset"]),
            _unb64(h["ref_handle"]),
            int(h["ref_offset"]),
            _unb64(h["event"]),
            bool(h["event_sync"]),
        )
    except KeyError as e:
        raise ValueError(f"CUDA IPC handle lacks field {e.args[0]!r}; send what share() returns") from e
    buf = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    return buf.set_(storage, 0, (int(h["nbytes"]),))
