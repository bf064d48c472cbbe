"""Constrained decoding: a request's `regex`, `json_schema` or `ebnf` (GBNF or Lark) becomes an
llguidance grammar; each sample of the request holds a matcher that gives the tokens allowed next (a
bitmask over the vocabulary) and consumes the token sampled.

Why llguidance (compared with xgrammar, the other maintained library with a token-mask API; see
docs/engines.md): one abi3 wheel with no dependencies, the same on CPU and GPU hosts and on every Python
from 3.9 (xgrammar needs triton and apache-tvm-ffi, and a wheel per Python version); no per-grammar
compilation step (the mask is computed lazily from the tokenizer's token trie), so a new JSON schema
costs nothing up front; regex, JSON schema, Lark and GBNF from one API. The masks are computed on the
host, one row at a time, only for the rows of requests that ask for a grammar: free generation does not
reach this module.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import Tensor

_BITS = torch.arange(8, dtype=torch.uint8)
# JSON is written with fixed separators and no free whitespace: with whitespace free a model (a weak one
# most of all) can pad the output until it runs out of tokens, and the text never ends as valid JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammar:
    """One request's compiled constraint; `matcher()` gives each sample its own state."""

    def __init__(self, tokenizer: Any, text: str) -> None:
        self._tokenizer, self._text = tokenizer, text

    def matcher(self) -> Any:
        import llguidance

        return llguidance.LLMatcher(self._tokenizer, self._text, log_level=0)


class GrammarCompiler:
    """Turns grammar fields into `Grammar`s for one model's tokenizer and vocabulary (built once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._ll: Any = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._ll is None:
                import llguidance

                backend = getattr(self.tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise ValueError(
                        "constrained decoding needs a fast (tokenizers) tokenizer in the model folder"
                    )
                self._ll = llguidance.LLTokenizer(
                    backend.to_str(), n_vocab=self.vocab_size, eos_token=self.eos_ids or None
                )
            return self._ll

    def compile(self, kind: str, text: str) -> Grammar:
        """`kind`: regex, json_schema or ebnf. Raises ValueError naming the field for a bad grammar."""
        if self.tokenizer is None:
            raise ValueError(f"{kind} needs a tokenizer and this model folder has none")
        import llguidance
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            if kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(ascii_classes(text))
            elif kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(text))
        except Exception as e:  # noqa: BLE001 - the library's own parse errors, handed to the caller
            raise ValueError(f"invalid {kind}: {e}") from e
        tokenizer = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise ValueError(f"invalid {kind}: {error.strip()}")
        return Grammar(tokenizer, grammar)


# Perl classes as SGLang's default grammar backend (xgrammar) reads them: ASCII, where llguidance's regex
# syntax (Rust's `regex`) makes them Unicode (`\d{6}` could give Arabic-Indic or Cham digits)
_ASCII_CLASSES = {"d": "0-9", "w": "0-9A-Za-z_"}


def ascii_classes(regex: str) -> str:
    """`regex` with `\\d`, `\\w`, `\\D`, `\\W` as ASCII classes: `[0-9]`, `[0-9A-Za-z_]` and their
    complements; inside a bracket class `\\d` and `\\w` become the ranges (`[\\d.]` -> `[0-9.]`), while `\\D`
    and `\\W` there stay as they are (Unicode). Escaped backslashes are left alone (`\\\\d` is a backslash
    and a d)."""
    out: list[str] = []
    in_class, i = False, 0
    while i < len(regex):
        c = regex[i]
        if c == "\\" and i + 1 < len(regex):
            e = regex[i + 1]
            if e.lower() in _ASCII_CLASSES and not (in_class and e.isupper()):
                ranges = _ASCII_CLASSES[e.lower()]
                out.append(ranges if in_class else f"[{'^' if e.isupper() else ''}{ranges}]")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            # a `]` first in the class (after an optional `^`) is a literal
            if i < len(regex) and regex[i] == "^":
                out.append("^")
                i += 1
            if i < len(regex) and regex[i] == "]":
                out.append("]")
                i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def allowed_tokens(matchers: list[Any], vocab_size: int) -> Tensor:
    """[R, V] bool (CPU): the tokens each matcher allows next. A matcher that allows nothing (it is in an
    error state) allows everything, so its row still samples and the error ends the request."""
    raw = b"".join(m.compute_bitmask() for m in matchers)
    bytes_RW = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(len(matchers), -1)
    allowed_RV = ((bytes_RW.unsqueeze(-1) >> _BITS) & 1).view(len(matchers), -1)[:, :vocab_size].bool()
    none_R = ~allowed_RV.any(dim=1)
    if bool(none_R.any()):
        allowed_RV[none_R] = True
    return allowed_RV
