"""Stop regexes (`sampling_params.stop_regex`, SGLang's field) compiled with RE2, a regex engine without
backtracking: a search takes time linear in the text whatever the pattern. Python's `re` backtracks, so
one pattern such as `(.*a){20}$` searched after every generated token can hold the engine thread for
minutes, stalling every request in the batch.

RE2's syntax is Python's without backreferences and lookaround (it cannot match those in linear time);
a pattern it cannot compile, or whose program would need more than `MAX_PROGRAM_BYTES`, is a ValueError
naming the field, which the servers answer 400.
"""

from __future__ import annotations

from typing import Any

# RE2's memory budget for one pattern's compiled program and its DFA cache: a pattern too large for it is
# refused at compile time; a search that fills the DFA cache falls back to RE2's NFA (still linear)
MAX_PROGRAM_BYTES = 8 << 20
MAX_PATTERN_CHARS = 4096  # far above a real stop pattern; bounds what compiling one costs


def compile_stop_regex(pattern: str) -> Any:
    """The compiled RE2 pattern (its `search(text)` gives a match or None); ValueError if RE2 cannot
    compile it."""
    import re2

    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(
            f"stop_regex has {len(pattern)} characters; the limit is {MAX_PATTERN_CHARS} per pattern"
        )
    options = re2.Options()
    options.max_mem = MAX_PROGRAM_BYTES
    options.log_errors = False  # the error goes back to the caller, not to the server's stderr
    if not pattern.isascii() and any("\ud800" <= ch <= "\udfff" for ch in pattern):
        raise ValueError("stop_regex holds a lone UTF-16 surrogate; send valid Unicode text")
    try:
        return re2.compile(pattern, options)
    except (re2.error, TypeError) as e:
        reason = e.args[0] if e.args else e
        if isinstance(reason, bytes):
            reason = reason.decode(errors="replace")
        raise ValueError(
            f"stop_regex {pattern!r} cannot be compiled by RE2, the linear-time regex engine the "
            f"stop regexes use (no backreferences or lookaround): {reason}"
        ) from None
