"""The embedded engine: a `ModelRunner` and a `Scheduler` driven by one background thread.

Every change to the engine's state (new requests, abort, pause, weight loads) is a command that the
engine thread runs between two steps, so the model and the batch need no locks and a command that
returns has taken effect: `pause()` returns once no step is running and none will start.

    engine = EmbeddedEngine("path/to/model").start()
    results = engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8, n=2))
    engine.shutdown()

Receiving weights over a process group happens in the caller's thread (generation goes on meanwhile);
only the copy into the model is a command. A push of several buckets that arrives while the engine
generates is held until its last bucket and loaded in one command, so no step runs on a mix of two
versions and a push needs no pause (`live_weight_updates` in `/get_model_info`).
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from relax.backends.inference.embedded.model.prompt_logprobs import PromptLogprobs, prompt_logprobs
from relax.backends.inference.embedded.model.runner import ModelRunner
from relax.backends.inference.embedded.sampling.grammar import Grammar, GrammarCompiler
from relax.backends.inference.embedded.scheduling.chunked_prefill import default_chunk_size
from relax.backends.inference.embedded.scheduling.kv_budget import (
    KV_MEMORY_FRACTION,
    default_max_total_tokens,
    kv_bytes_per_token,
)
from relax.backends.inference.embedded.scheduling.scheduler import Scheduler
from relax.backends.inference.embedded.scheduling.sequence import GenerationResult, OnToken, RequestGroup
from relax.engine_api.protocol import (
    InitWeightsUpdateGroupRequest,
    SamplingParams,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightsFromIpcRequest,
)
from relax.weights.inbox import WeightInbox

logger = logging.getLogger(__name__)


def _id_array(input_ids: list[int]) -> np.ndarray | None:
    """The prompt's ids as int64 in one C pass, or None where some id is none numpy converts (the
    per-id check then names it). An agent's turn submits thousands of ids a request: `list(map(int))`
    beside `min` and `max` held the GIL ~0.4 ms of each (6.5k ids), twice what the one conversion takes.
    Ids convert as `int()` converts them (True is 1), as `list(map(int))` did."""
    try:
        return np.fromiter(input_ids, dtype=np.int64, count=len(input_ids))
    except (TypeError, ValueError, OverflowError):
        return None


@dataclass
class EngineMetrics:
    num_running: int  # sequences in the running batch
    num_waiting: int  # sequences queued for admission
    gen_throughput: float  # generated tokens per second over the last few seconds
    kv_tokens: int  # tokens held in the KV cache
    kv_capacity: int  # max_total_tokens
    generated_tokens_total: int
    prompt_tokens_total: int
    requests_total: int
    weight_version: str
    paused: bool
    cache_hit_rate: float = 0.0  # prompt tokens served by the prefix cache / prompt tokens looked up
    prefill_tokens_computed: int = 0  # prompt tokens prefilled (once per prompt, not per sample)
    prefill_tokens_submitted: int = 0  # prompt tokens admitted (likewise)
    prefix_cache_tokens: int = 0  # tokens held by the prefix cache
    preempted_total: int = 0  # running sequences preempted for want of KV blocks (recomputed later)
    prefix_hit_tokens: int = 0  # prompt tokens served by the prefix cache
    prefix_lookup_tokens: int = 0  # prompt tokens looked up in it
    busy_seconds_total: float = 0.0  # wall seconds the engine thread spent inside scheduler steps
    steps_total: int = 0  # scheduler steps run (each a prefill, a decode or both)

    @property
    def kv_usage(self) -> float:
        return self.kv_tokens / max(self.kv_capacity, 1)


class EmbeddedEngine:
    def __init__(
        self,
        model_path: str,
        *,
        device: str | None = None,
        dtype: str = "auto",
        max_running: int = 64,
        max_total_tokens: int | None = None,
        kv_memory_fraction: float = KV_MEMORY_FRACTION,
        workload_tokens: int | None = None,
        kv_preallocate: bool = False,
        max_prefill_tokens: int = 16384,
        max_context_len: int | None = None,
        seed: int | None = None,
        threads: int | None = None,
        weight_version: str = "0",
        attn_implementation: str | None = "sdpa",
        cuda_graphs: bool = True,
        use_lean: bool = True,
        overlap: bool | None = None,
        max_n: int | None = None,
        weight_join_timeout_s: float = 120.0,
        enable_prefix_cache: bool = True,
        chunked_prefill_size: int | None = None,
    ) -> None:
        """`overlap`: launch each decode step before the host reads the last one back (`scheduler.py`;
        None: on CUDA, where it hides the host's per-step work behind the GPU's). `max_n`: the most
        samples one request may ask for (None: `max_running`; never above it).
        `weight_join_timeout_s`: a weight-sync group whose rendezvous does not complete this long after
        `/init_weights_update_group` fails the join (an unreachable trainer never holds the engine).
        `enable_prefix_cache`: reuse the KV of prompt prefixes across requests (`prefix_cache.py`; emptied
        by every weight update and by `flush_cache`). `chunked_prefill_size`: prefill tokens per step, a
        longer prompt prefilled in chunks with decode steps of the running batch between them
        (`chunked_prefill.py`; None: 8192 on CUDA, 512 on the CPU; 0 or less: off). `use_lean`: run the
        model's decoder through `LeanDecoder` where it supports the model (False: the `transformers`
        forward, for comparisons). `max_total_tokens`: the ceiling the KV pool may grow to, in tokens (None:
        `kv_memory_fraction` of the GPU's memory, 262,144 tokens on the CPU, and no more than
        `workload_tokens`, the most the caller's workload can hold at once; `kv_budget.py`).
        `kv_preallocate`: allocate the whole pool at start (an engine beside a trainer on one GPU)."""
        self.weight_join_timeout_s = weight_join_timeout_s
        if threads:
            torch.set_num_threads(threads)
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.runner = ModelRunner(
            model_path,
            device=device,
            dtype=dtype,
            attn_implementation=attn_implementation,
            weight_version=weight_version,
            cuda_graphs=cuda_graphs,  # decode steps replay CUDA graphs (CUDA only)
            use_lean=use_lean,
        )
        self.max_context_len = min(
            max_context_len or self.runner.max_context_len, self.runner.max_context_len
        )
        if max_total_tokens is None:
            cache = self.runner.cache
            per_token = kv_bytes_per_token(cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype)
            max_total_tokens = default_max_total_tokens(self.runner.device, per_token, kv_memory_fraction)
            if workload_tokens:
                max_total_tokens = min(max_total_tokens, workload_tokens)
        self.scheduler = Scheduler(
            self.runner,
            max_running=max_running,
            max_total_tokens=max_total_tokens,
            max_prefill_tokens=max_prefill_tokens,
            seed=seed if seed is not None else secrets.randbits(62),  # the stream of unseeded requests
            overlap=overlap,
            prefix_cache=enable_prefix_cache,
            chunk_size=default_chunk_size(self.runner.device.type)
            if chunked_prefill_size is None
            else chunked_prefill_size,
        )
        if kv_preallocate:
            self.runner.cache.preallocate()
        # A lone request is always admitted, whatever its size, so `n` above the batch would allocate
        # KV rows past `max_running`: refused up front instead.
        self.max_n = max(1, min(max_n or max_running, max_running))
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], Future, bool]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.paused = False
        self.step_sleep_s = 0.0  # extra sleep after every step (`/slow_down`, for tests and debugging)
        self.burst_gap_s, self.burst_max_s = 0.001, 0.02  # see `_gather_burst`; 0 turns it off
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps
        self._totals = {"generated": 0, "prompt": 0, "requests": 0, "steps": 0}
        self._busy_s = 0.0  # wall seconds inside scheduler steps
        self.inbox = WeightInbox(self.runner.device, weight_join_timeout_s)  # weight-sync groups
        self._held: list[tuple[str, Tensor]] = []  # buckets of a push in progress, received while generating
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.runner.eos_token_ids)

    @property
    def tokenizer(self) -> Any:
        return self.runner.tokenizer

    @property
    def weight_version(self) -> str:
        return self.runner.weight_version

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> EmbeddedEngine:
        """Start the engine thread. Freezing the process's start-up objects out of the cyclic garbage
        collector is the process's call, not the engine's (`relax/utils/gc_freeze.py`; `relax engine
        serve` and the engine's Ray actor do): without it a full collection stalls every running request
        (docs/measurements.md has the size of that stall)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="relax-engine", daemon=True)
            self._thread.start()
        return self

    def shutdown(self) -> None:
        if self._thread is None:
            return
        if self.is_alive():
            self._call(lambda: self.scheduler.abort(None, "engine shut down"))
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._thread = None
        self.inbox.close()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run_commands(self) -> None:
        while not self._commands.empty():
            fn, fut, drain = self._commands.get()
            try:
                if drain:  # the command sees no step in flight (see `Scheduler.drain`)
                    self.scheduler.drain()
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

    def _gather_burst(self) -> None:
        """An idle engine that was just sent requests waits until they stop coming (`burst_gap_s` without
        one, `burst_max_s` at most) before its first step. A rollout sends a whole batch at once; taken as
        it trickles in, the first requests would be prefilled alone and decoded in small batches while
        the rest queue behind them, and the batch sizes would differ from one rollout to the next (new
        CUDA graphs to capture). Costs an idle engine at most `burst_max_s` of first-token latency, and
        nothing once the queue holds more than one step admits (64 agent turns sent one by one took the
        whole window, the GPU idle, while their first 24 already filled the prefill budget)."""
        deadline = time.monotonic() + self.burst_max_s
        while time.monotonic() < deadline:
            time.sleep(self.burst_gap_s)
            if self._commands.empty():
                return
            self._run_commands()
            if self.scheduler.step_is_full():
                return

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException:
            # Not an Exception (those fail the step's requests in `_serve`): SystemExit, a
            # KeyboardInterrupt, ... The thread ends; `is_alive()` turns False, so `/health` answers 503
            # and a supervisor replaces the engine; the requests in flight fail below instead of hanging.
            logger.critical("the engine thread died; failing every request", exc_info=True)
            raise
        finally:
            gone = RuntimeError("the engine was shut down" if self._stopping else "the engine thread died")
            self.scheduler.fail_all(gone)
            while not self._commands.empty():
                self._commands.get()[1].set_exception(gone)

    def _serve(self) -> None:
        while not self._stopping:
            self._wake.clear()
            self._run_commands()
            if self.paused or not self.scheduler.has_work():
                self._wake.wait(timeout=1.0)
                continue
            if self.burst_gap_s > 0 and self.scheduler.idle():
                self._gather_burst()
            t0 = time.perf_counter()
            try:
                with self.scheduler.holding_results():  # the replies go out once the step is counted
                    n = self.scheduler.step()
                    # busy time: what the steps took, the GPU's wait included; the loop's idle waits and
                    # commands (weight updates, flushes) are outside it, so busy / rollout seconds is how
                    # much of a rollout the engine spent generating (`rollout/engine_busy_s`)
                    self._busy_s += time.perf_counter() - t0
                    self._totals["steps"] += 1
                    now = time.monotonic()
                    self._recent.append((now, n))
                    self._totals["generated"] += n
                    while self._recent and self._recent[0][0] < now - 5.0:
                        self._recent.popleft()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep serving
                logger.exception("engine step failed; failing every request in flight")
                self.scheduler.fail_all(RuntimeError(f"engine step failed: {e!r}"))
                continue
            if self.step_sleep_s > 0:
                time.sleep(self.step_sleep_s)

    def _post(self, fn: Callable[[], Any], drain: bool = True) -> Future:
        """Queue `fn` to run on the engine thread between two steps, once no decode step is in flight
        (`drain=False`: also while one is); the future holds its result."""
        if not self.is_alive():
            raise RuntimeError("the engine is not running (start() it, or it was shut down)")
        fut: Future = Future()
        self._commands.put((fn, fut, drain))
        self._wake.set()
        return fut

    def _call(self, fn: Callable[[], Any], timeout: float | None = None) -> Any:
        """Run `fn` on the engine thread between two steps and return its result."""
        if threading.current_thread() is self._thread:
            return fn()
        return self._post(fn).result(timeout=timeout)

    # -- generation -----------------------------------------------------------------------------
    def submit(
        self,
        input_ids: list[int],
        params: SamplingParams | dict | None = None,
        rid: str | None = None,
        return_logprob: bool = True,
        multimodal_inputs: dict[str, Tensor] | None = None,
        *,
        top_logprobs_num: int = 0,
        on_token: OnToken | None = None,
        grammar: Grammar | None = None,
    ) -> Future:
        """Queue one prompt; the future resolves with its n `GenerationResult`s. Raises `ValueError` on a
        request the engine cannot serve. `multimodal_inputs` are the prompt's media tensors (forward
        kwargs of a multimodal model, as `relax.data.multimodal` makes them). `top_logprobs_num`: report
        the k most likely tokens at each position; `on_token`: streaming (`sequence.py`); `grammar`: the
        request's constraint compiled beforehand (`compile_grammar`; else compiled here)."""
        params = params if isinstance(params, SamplingParams) else SamplingParams(**(params or {}))
        ids = _id_array(input_ids)
        self.validate(input_ids, params, multimodal_inputs, ids=ids)
        if grammar is None and params.grammar is not None:
            grammar = self.compile_grammar(params)
        group = RequestGroup(
            rid=rid or uuid.uuid4().hex,
            prompt=ids.tolist() if ids is not None else list(map(int, input_ids)),
            params=params.model_copy(
                update={"max_new_tokens": min(params.max_new_tokens, self.max_context_len - len(input_ids))}
            ),
            return_logprob=return_logprob,
            tokenizer=self.tokenizer,
            stop_ids=self._stop_ids(params),
            max_context_len=self.max_context_len,
            multimodal_inputs=multimodal_inputs or None,
            top_logprobs_num=top_logprobs_num,
            grammar=grammar,
            logit_bias={int(k): float(v) for k, v in (params.logit_bias or {}).items()},
            on_token=on_token,
        )
        group.make_sequences(self.runner.device)
        self._totals["requests"] += 1
        self._totals["prompt"] += len(input_ids) * params.n
        if group.params.max_new_tokens == 0:
            for s in group.seqs:
                s.finish = {"type": "length", "length": 0}
            group.resolve(self.weight_version)
            return group.future
        self._post(lambda: self.scheduler.add(group), drain=False)  # does not wait for the current step
        return group.future

    def generate(
        self, input_ids: list[int], params: SamplingParams | dict | None = None, **kw: Any
    ) -> list[GenerationResult]:
        """Blocking `submit`."""
        return self.submit(input_ids, params, **kw).result()

    def _ids_out_of_range(self, input_ids: list[int], ids: np.ndarray | None) -> bool:
        """Whether some id may lie outside the vocabulary: `min` and `max` of the ids in C first (an agent's
        turn sends thousands of ids, and a Python loop over them held the GIL ~0.2 ms a request); ids
        they cannot compare take the per-id check."""
        if ids is not None and ids.size:
            return not (0 <= int(ids.min()) and int(ids.max()) < self.runner.vocab_size)
        try:
            return not (0 <= min(input_ids) and max(input_ids) < self.runner.vocab_size)
        except TypeError:
            return True

    def validate(
        self,
        input_ids: list[int],
        params: SamplingParams,
        multimodal_inputs: dict[str, Tensor] | None = None,
        *,
        ids: np.ndarray | None = None,
    ) -> None:
        """Raise `ValueError` naming what the engine cannot serve in this request. `ids`: the prompt as
        `_id_array` gave it, where the caller has it (`submit`), so its range check reads the array."""
        if not input_ids:
            raise ValueError("empty input: input_ids has no tokens")
        if len(input_ids) >= self.max_context_len:
            raise ValueError(
                f"prompt has {len(input_ids)} tokens; the engine's context is {self.max_context_len} tokens "
                "(it must leave room for at least one new token)"
            )
        if params.n > self.max_n:
            raise ValueError(f"n={params.n} is above this engine's limit of {self.max_n} samples per request")
        budget = self.scheduler.max_total_tokens
        if params.n * (len(input_ids) + 1) > budget:  # the least it reserves: the prompt and one token
            raise ValueError(
                f"prompt of {len(input_ids)} tokens with n={params.n} needs more than the engine's KV "
                f"budget of {budget} tokens (max_total_tokens)"
            )
        bad = (
            [t for t in input_ids if not 0 <= int(t) < self.runner.vocab_size]
            if self._ids_out_of_range(input_ids, ids)
            else []
        )
        if bad:
            raise ValueError(
                f"input_ids holds token ids outside the vocabulary [0, {self.runner.vocab_size}): {bad[:5]}"
            )
        if (params.stop_strings or params.stop_regexes) and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer and this model folder has none; use stop_token_ids"
            )
        bad = [k for k in params.logit_bias or {} if not 0 <= int(k) < self.runner.vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias names token ids outside the vocabulary [0, {self.runner.vocab_size}): {bad[:5]}"
            )
        bad = [t for t in params.stop_token_ids or [] if not 0 <= t < self.runner.vocab_size]
        if bad:  # such a token can never be sampled: the request would silently never stop on it
            raise ValueError(
                f"stop_token_ids holds token ids outside the vocabulary of {self.runner.vocab_size} tokens "
                f"[0, {self.runner.vocab_size}): {bad[:5]}"
            )
        if multimodal_inputs:
            self.runner.check_multimodal(input_ids, multimodal_inputs)

    def compile_grammar(self, params: SamplingParams) -> Grammar | None:
        """The request's output constraint (None when it has none); ValueError for a bad one."""
        if params.grammar is None:
            return None
        return self.grammars.compile(*params.grammar)

    def prompt_logprobs(self, input_ids: list[int], start: int, top_k: int = 0) -> PromptLogprobs:
        """Log-probs of the prompt's tokens from position `start` on (one forward pass over the prompt, on
        the engine thread between two steps); see `prompt_logprobs.py`."""
        if self.runner.multimodal and start < len(input_ids) - 1:
            raise ValueError("logprob_start_len (prompt log-probs) is served for text-only models only")
        return self._call(lambda: prompt_logprobs(self.runner, input_ids, start, top_k))

    def _stop_ids(self, params: SamplingParams) -> set[int]:
        ids = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            ids |= self.runner.eos_token_ids
        return ids

    # -- control --------------------------------------------------------------------------------
    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """End one request (all its samples) or every request; returns how many were ended."""
        if rid is None and not abort_all:
            return 0
        return self._call(lambda: self.scheduler.abort(None if abort_all else rid))

    def abort_soon(self, rid: str) -> Future:
        """Queue the end of one request without waiting for it: for callers that may not wait, such as a
        stream whose client left (its task is cancelled, and an awaited abort would be cancelled before it
        ran). The future holds how many requests were ended."""
        return self._post(lambda: self.scheduler.abort(rid))

    def pause(self, mode: str = "in_place") -> None:
        """Stop generating; returns once no step runs. `abort` ends every request, `retract` drops the KV
        cache (recomputed on resume), `in_place` keeps it."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}; use abort, retract or in_place")

        def do() -> None:
            self.paused = True
            if mode == "abort":
                self.scheduler.abort(None, "aborted by pause_generation")
            elif mode == "retract":
                self.scheduler.retract()

        self._call(do)
        logger.debug("generation paused (%s)", mode)

    def resume(self) -> None:
        self._call(lambda: setattr(self, "paused", False))
        logger.debug("generation continued")

    def flush_cache(self) -> bool:
        """Empty the prefix cache (between two steps). Unlike SGLang it need not wait for an idle engine:
        no running request reads the cache's memory (`prefix_cache.py`)."""
        self._call(self.scheduler.flush_prefix)
        return True

    # -- weights --------------------------------------------------------------------------------
    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, Tensor]],
        weight_version: str | None = None,
        refresh: bool = True,
    ) -> int:
        """Copy tensors into the model between two steps; running requests continue on the new weights.
        `refresh=False` marks a bucket before the last of a push: while paused it is loaded at once (the
        fused decode weights wait for the last bucket); while generating it is held and loaded with the
        last bucket in one command."""
        items = list(named_tensors)
        if not refresh and not self.paused:
            self.runner.check_weights(items)  # a bad bucket fails now, not at the last one
            self._held += items
            return len(items)
        items, self._held = self._held + items, []

        def load() -> int:
            old = self.runner.weight_version
            n = self.runner.load_weights(items, weight_version, refresh=refresh)
            self.scheduler.weights_changed()  # any change of weights, even under the same version name
            if self.runner.weight_version != old:  # requests kept through the update record it
                self.scheduler.note_version(old, self.runner.weight_version)
            return n

        n = self._call(load)
        logger.debug("loaded %d weights, version %s", n, self.weight_version)
        return n

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> int:
        from safetensors.torch import load_file

        files = sorted(Path(model_path).glob("*.safetensors"))
        if not files:
            raise ValueError(f"no *.safetensors file in {model_path}")
        tensors: dict[str, Tensor] = {}
        for f in files:
            try:
                tensors.update(load_file(str(f)))
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError: the caller's bad file
                raise ValueError(f"cannot read {f}: {e}") from e
        return self.update_weights(tensors.items(), weight_version)

    def init_weights_update_group(self, req: InitWeightsUpdateGroupRequest) -> None:
        """Join the trainer's weight-sync group as rank `req.rank_offset`; blocks until every rank has
        joined."""
        self._held = []  # a push the old group left unfinished
        self.inbox.join(req)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.inbox.leave(group_name)

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributedRequest) -> int:
        """Receive the tensors from rank 0 of `req.group_name` (in this thread), then load them.
        `load_format="flattened_bucket"`: one broadcast of the packed bucket instead of one per tensor."""
        tensors = self.inbox.receive(req)
        return self.update_weights(tensors.items(), req.weight_version, refresh=req.flush_cache)

    def update_weights_from_ipc(self, req: UpdateWeightsFromIpcRequest) -> int:
        """Load a bucket from a CUDA buffer of a process on this GPU; the copy is complete on return, so
        the sender may free the buffer."""

        def load(tensors: dict[str, Tensor]) -> int:
            if not req.flush_cache and not self.paused:  # held past this call: off the sender's buffer
                tensors = {k: v.clone() for k, v in tensors.items()}
            return self.update_weights(tensors.items(), req.weight_version, refresh=req.flush_cache)

        return self.inbox.receive_ipc(req, load)

    # -- introspection --------------------------------------------------------------------------
    def metrics(self) -> EngineMetrics:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self._recent) if t >= now - 5.0]
        span = max(now - recent[0][0], 1e-3) if recent else 1.0
        prefix, cache = self.scheduler.prefix, self.scheduler.cache
        return EngineMetrics(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting(),
            gen_throughput=sum(n for _, n in recent) / span if recent else 0.0,
            kv_tokens=self.scheduler.kv_tokens(),
            # the budget, or less where the device could not grow the pool that far (`PagedKVCache`)
            kv_capacity=min(self.scheduler.max_total_tokens, (cache.max_blocks - 1) * cache.block),
            generated_tokens_total=self._totals["generated"],
            prompt_tokens_total=self._totals["prompt"],
            requests_total=self._totals["requests"],
            weight_version=self.weight_version,
            paused=self.paused,
            cache_hit_rate=prefix.hit_rate() if prefix is not None else 0.0,
            prefill_tokens_computed=self.scheduler.prefill_computed,
            prefill_tokens_submitted=self.scheduler.prefill_submitted,
            prefix_cache_tokens=prefix.tokens if prefix is not None else 0,
            preempted_total=self.scheduler.preempted,
            prefix_hit_tokens=prefix.hit_tokens if prefix is not None else 0,
            prefix_lookup_tokens=prefix.lookup_tokens if prefix is not None else 0,
            busy_seconds_total=self._busy_s,
            steps_total=self._totals["steps"],
        )
