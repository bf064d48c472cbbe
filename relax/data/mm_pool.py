"""Media processing off the rollout loop: a pool of worker processes, each holding one
`MultimodalProcessor`, turns multimodal rows into prompt ids and tensors while the event loop keeps
serving requests.

    pool = MediaPool(model_path, cfg.data.media, system_prompt=cfg.data.system_prompt)
    processed = await pool.process(row)   # ProcessedPrompt, cached per row index (LRU)
    pool.close()

`workers=0` runs the processor in a thread of this process instead (tests, tiny runs). Workers return
numpy arrays (plain pickles, no shared-memory file descriptors); the pool turns them back into tensors.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
from collections import OrderedDict
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from relax.data.config import MediaConfig
from relax.data.dataset import PromptRow
from relax.data.multimodal import MultimodalProcessor, ProcessedPrompt

logger = logging.getLogger(__name__)

_WORKER: MultimodalProcessor | None = None  # the processor of this worker process


def _init_worker(model_path: str, cfg: MediaConfig) -> None:
    global _WORKER
    import torch as _torch

    _torch.set_num_threads(1)
    _WORKER = MultimodalProcessor(model_path, cfg)


def _run(
    processor: MultimodalProcessor,
    prompt: Any,
    media: dict,
    where: str,
    system_prompt: str | None,
    template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], dict[str, np.ndarray] | None]:
    out = processor.process(
        prompt, media, where=where, system_prompt=system_prompt, template_kwargs=template_kwargs
    )
    arrays = {k: v.numpy() for k, v in out.multimodal_inputs.items()} if out.multimodal_inputs else None
    return out.prompt_ids, arrays


def _work(
    prompt: Any, media: dict, where: str, system_prompt: str | None, template_kwargs: dict[str, Any] | None
) -> tuple[list[int], Any]:
    assert _WORKER is not None, "media worker used before its initializer ran"
    return _run(_WORKER, prompt, media, where, system_prompt, template_kwargs)


class MediaPool:
    def __init__(
        self,
        model_path: str,
        cfg: MediaConfig,
        *,
        system_prompt: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.cfg = cfg
        self.system_prompt = system_prompt
        self.template_kwargs = dict(template_kwargs or {})  # data.chat_template_kwargs
        self._local: MultimodalProcessor | None = None
        self._executor: Executor
        if cfg.workers > 0:
            self._executor = ProcessPoolExecutor(
                cfg.workers,
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=(str(model_path), cfg),
            )
        else:
            self._local = MultimodalProcessor(str(model_path), cfg)
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="relax-media")
        self._cache: OrderedDict[int, ProcessedPrompt] = OrderedDict()
        logger.info(
            "media processing: %s", f"{cfg.workers} worker processes" if cfg.workers else "one thread"
        )

    def _submit(self, row: PromptRow):
        where = row.where or f"row {row.index + 1}"
        args = (row.prompt, row.media, where, self.system_prompt, self.template_kwargs)
        if self._local is not None:
            return self._executor.submit(_run, self._local, *args)
        return self._executor.submit(_work, *args)

    async def process(self, row: PromptRow) -> ProcessedPrompt:
        """The row's prompt ids and media tensors (errors name the row and the media item)."""
        if row.index in self._cache:
            self._cache.move_to_end(row.index)
            return self._cache[row.index]
        ids, arrays = await asyncio.wrap_future(self._submit(row))
        tensors = {k: torch.from_numpy(v) for k, v in arrays.items()} if arrays else None
        out = ProcessedPrompt(ids, tensors)
        if self.cfg.cache_rows:
            self._cache[row.index] = out
            while len(self._cache) > self.cfg.cache_rows:
                self._cache.popitem(last=False)
        return out

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
