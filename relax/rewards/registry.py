"""The reward registry: names of the built-in rewards, and how a name or import path becomes a function.

The contract of a reward function
---------------------------------
A reward is a plain Python callable, sync (``def``) or async (``async def``), of one of two kinds:

* **per-sample** (``kind="sample"``, the default)::

      def my_reward(sample: Sample, **kwargs) -> float | dict[str, float]

* **per-group** (``kind="group"``): called once with all samples of one prompt (same ``group_id``) and
  returns one result per sample, in order::

      @reward_fn(kind="group")
      def my_group_reward(samples: list[Sample], **kwargs) -> list[float | dict[str, float]]

``kwargs`` are the ``RewardConfig.kwargs`` (or ``type_kwargs[name]``) of the configuration. A function
reads ``sample.response_text``, ``sample.label``, ``sample.metadata`` (and anything else on ``Sample``)
and must not modify the sample: the scorer writes ``sample.reward`` and ``sample.reward_info``.

A result is either a number (the reward) or a dict: its ``reward_key`` entry is the reward and its other
numeric entries go to ``sample.reward_info`` and are logged, averaged over the step's samples, as
``reward/info/<key>`` (a key with a ``/``, like ``genrm/latency_s``, is logged under its own name).
The key is the spec's own ``reward_key`` when it declares one (all built-ins use ``"reward"``), else
``RewardConfig.reward_key``.
A function that raises or runs past ``RewardConfig.timeout_s`` gives its samples the configured fallback
reward; a sync function runs in a worker thread, so it must be thread-safe. Once a sync per-sample
function is seen to take under 2 ms a call, a batch's calls run one after another in one worker thread,
each still held to its own timeout (``relax.rewards.sync_batch``).

The kind is declared with the ``@reward_fn(kind=...)`` decorator or by wrapping the function in a
``RewardSpec(fn, kind=...)``; an undecorated function is per-sample.

A reasoning model's response holds its ``<think>`` block; the built-in rewards that score an answer
take ``strip_reasoning`` (``RewardConfig.strip_reasoning``, default true) and score what follows the
block. A user function sees ``sample.response_text`` whole; ``relax.rewards.extract.after_reasoning``
gives it the answer part.

To add a reward, write it (a small module in this package) and register it here in ``REWARDS``.
A user's reward outside this package needs no registration: configure it by import path,
``name: "my_package.my_module:my_reward"``.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, Literal

from relax.rewards.choice import multiple_choice
from relax.rewards.dapo import dapo
from relax.rewards.format import format_think_answer
from relax.rewards.genrm import genrm
from relax.rewards.math import math_reward
from relax.rewards.remote import remote
from relax.rewards.synthetic import token_rate
from relax.rewards.text import exact_match, f1, first_number

RewardKind = Literal["sample", "group"]
_KINDS = ("sample", "group")
_MARK = "__relax_reward__"  # attribute set by @reward_fn on a function


@dataclass(frozen=True)
class RewardSpec:
    """A reward function with how to call it and how to read its result."""

    fn: Callable[..., Any]  # the function, per-sample or per-group, sync or async
    kind: RewardKind = "sample"  # "sample": fn(sample, **kw) ; "group": fn(samples, **kw) -> list
    reward_key: str | None = None  # key of the reward in a dict result; None = RewardConfig.reward_key
    name: str = ""  # registered name or import path (for logs and metrics)
    needs_label: bool = False  # compares the response with the row's label (a row without one is an error)
    # takes `strip_reasoning=`: scores the answer after a `<think>` block (RewardConfig.strip_reasoning)
    strips_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"reward kind must be one of {_KINDS}, got {self.kind!r}")
        if not callable(self.fn):
            raise TypeError(f"a reward function must be callable, got {self.fn!r}")

    @functools.cached_property
    def is_async(self) -> bool:
        """Whether calling ``fn`` returns a coroutine (an ``async def`` function or callable object)."""
        fn = self.fn
        while isinstance(fn, functools.partial):
            fn = fn.func
        if inspect.isroutine(fn):
            return inspect.iscoroutinefunction(fn)
        return inspect.iscoroutinefunction(type(fn).__call__)  # a callable object


def reward_fn(
    fn: Callable[..., Any] | None = None, *, kind: RewardKind = "sample", reward_key: str | None = None
) -> Any:
    """Declare a function's reward kind (and optionally its result key): ``@reward_fn(kind="group")``.

    Usable bare (``@reward_fn``) or with arguments; the function itself is returned unchanged, only
    marked, so it stays an ordinary importable (and picklable) function.
    """
    if kind not in _KINDS:
        raise ValueError(f"reward kind must be one of {_KINDS}, got {kind!r}")

    def mark(f: Callable[..., Any]) -> Callable[..., Any]:
        setattr(f, _MARK, {"kind": kind, "reward_key": reward_key})
        return f

    return mark(fn) if fn is not None else mark


def as_spec(obj: Any, name: str = "") -> RewardSpec:
    """A ``RewardSpec`` from a spec (named if unnamed) or from a plain or ``@reward_fn``-marked function."""
    if isinstance(obj, RewardSpec):
        return obj if obj.name else replace(obj, name=name)
    mark = getattr(obj, _MARK, {})
    return RewardSpec(obj, kind=mark.get("kind", "sample"), reward_key=mark.get("reward_key"), name=name)


def _builtin(
    fn: Callable[..., Any], kind: RewardKind = "sample", needs_label: bool = False, answer: bool = True
) -> RewardSpec:
    """A built-in reward; `answer`: it scores the response's answer, so it takes `strip_reasoning`."""
    return RewardSpec(fn, kind=kind, reward_key="reward", needs_label=needs_label, strips_reasoning=answer)


# The built-in rewards, by name. To add one: write it in a small module of this package, add it here.
REWARDS: dict[str, RewardSpec] = {
    "math": _builtin(math_reward, needs_label=True),
    "multiple_choice": _builtin(multiple_choice, needs_label=True),
    "exact_match": _builtin(exact_match, needs_label=True),
    "first_number": _builtin(first_number, needs_label=True),
    "f1": _builtin(f1, needs_label=True),
    "format_think_answer": _builtin(format_think_answer, answer=False),  # the whole response's shape
    "dapo": _builtin(dapo, needs_label=True),
    "remote": _builtin(remote, answer=False),  # the service gets the whole response
    "token_rate": _builtin(
        token_rate, answer=False
    ),  # synthetic: share of token ids divisible by `modulus` (benchmarks)
    "genrm": _builtin(genrm, kind="group"),  # LLM judge; needs RewardConfig.genrm (the GenRM service)
}


def _import_path(path: str) -> Any:
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"reward import path {path!r} must look like 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {path!r}: cannot import module {module_name!r}: {e}") from e
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"reward {path!r}: {getattr(obj, '__name__', obj)!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj


def resolve_reward(name_or_path: str) -> RewardSpec:
    """The reward registered as ``name_or_path``, or the function at an import path ``pkg.module:fn``.

    Raises ``ValueError`` naming the built-in rewards for an unknown name, or naming the module or
    attribute that failed to import for an import path.
    """
    if name_or_path in REWARDS:
        return as_spec(REWARDS[name_or_path], name=name_or_path)
    if ":" not in name_or_path:
        raise ValueError(
            f"unknown reward {name_or_path!r}; built-in rewards: {sorted(REWARDS)}; "
            "or give an import path 'package.module:function'"
        )
    obj = _import_path(name_or_path)
    if not isinstance(obj, RewardSpec) and not callable(obj):
        raise ValueError(f"reward {name_or_path!r} is not callable: {obj!r}")
    return as_spec(obj, name=name_or_path)


def allowed_rewards(default: str, named: Iterable[str]) -> set[str]:
    """What a data row may select for itself (`metadata.rm_type`): the built-in rewards and the rewards the
    config names (its default and the keys of `type_kwargs`). A row never chooses an import path the
    config does not name: data must not choose code to run."""
    return {*REWARDS, default, *named}


def check_row_reward(rm_type: str, allowed: set[str], where: str) -> None:
    """Raise `ValueError` naming the row (`where`) when it selects a reward outside `allowed`."""
    if rm_type not in allowed:
        configured = sorted(allowed - set(REWARDS))
        raise ValueError(
            f"{where}: metadata selects reward {rm_type!r}, which is neither built in ({', '.join(sorted(REWARDS))}) "
            f"nor named in the config ({', '.join(configured)}); a row may only select those. Name it in "
            f"reward.type_kwargs (e.g. reward.type_kwargs={{{rm_type!r}: {{}}}}) if the run should use it"
        )


def check_kwargs(spec: RewardSpec, kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``kwargs`` do not fit the function's signature (unknown or missing names)."""
    try:
        sig = inspect.signature(spec.fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return
    try:
        sig.bind(None, **kwargs)
    except TypeError as e:
        raise ValueError(f"kwargs {sorted(kwargs)} do not fit reward {spec.name!r}{sig}: {e}") from e
