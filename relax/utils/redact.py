"""Secrets out of logs, files, metrics and notifications.

Two means, both applied wherever text leaves a process (the logging filter `setup_logging` installs, the
run folder's config.yaml, W&B's run config, notifications):

* values registered as secrets (`register_secret`: the run's token, credentials a config holds) are
  replaced wherever they appear;
* shapes that carry credentials are masked whatever their value: the password of a URL
  (`scheme://user:***@host`), query parameters named like a credential (`?token=***`), `Bearer ***`.

`redact_tree` masks the values of mapping keys named like a credential (token, secret, password,
authorization, api key, ...) in a config dump.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

MASK = "***"
# A key is secret-named when one of its words (split at `_`, `-`, `.` and camelCase) is a credential word:
# `token`, `hf_token`, `apiKey` and `Authorization` are; `max_new_tokens` and `tokenizer_path` are not.
SECRET_KEY = re.compile(
    r"(?:^|[_.-])(?:token|secret|secrets|passw\w*|passphrase|authorization|api[_-]?key|apikey|"
    r"credentials?|cookies?|private[_-]?key|access[_-]?key)(?:$|[_.-])",
    re.I,
)
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def secret_key(key: Any) -> bool:
    """Whether a mapping key names a credential (its value is masked in dumps)."""
    return bool(SECRET_KEY.search(_CAMEL.sub("_", str(key))))


_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)(?P<user>[^:/@\s]*):(?P<pw>[^@/\s]+)@")
_QUERY = re.compile(
    r"(?P<key>[?&;](?:[a-z_]*(?:token|secret|passw|key|auth|sig|signature|credential)[a-z_]*))=(?P<value>[^&\s#'\"]+)",
    re.I,
)
_BEARER = re.compile(r"(?P<kind>\b(?:Bearer|Basic|Token)\s+)(?P<value>[A-Za-z0-9._~+/=-]{6,})")
_secrets: set[str] = set()
_lock = threading.Lock()


def register_secret(value: Any) -> None:
    """Mask `value` (a string of at least 4 characters) wherever text is redacted in this process."""
    if isinstance(value, str) and len(value) >= 4:
        with _lock:
            _secrets.add(value)


def redact_text(text: str) -> str:
    """`text` with registered secrets and credential-shaped substrings masked."""
    if not text:
        return text
    for secret in sorted(_secrets, key=len, reverse=True):
        if secret in text:
            text = text.replace(secret, MASK)
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{m['user']}:{MASK}@", text)
    text = _QUERY.sub(lambda m: f"{m['key']}={MASK}", text)
    return _BEARER.sub(lambda m: f"{m['kind']}{MASK}", text)


def secret_values(obj: Any, secret: bool = False) -> list[str]:
    """The strings under secret-named keys of a config dump (to `register_secret` them)."""
    if isinstance(obj, dict):
        return [v for k, x in obj.items() for v in secret_values(x, secret or secret_key(k))]
    if isinstance(obj, (list, tuple)):
        return [v for x in obj for v in secret_values(x, secret)]
    return [obj] if secret and isinstance(obj, str) else []


def redact_tree(obj: Any, secret: bool = False) -> Any:
    """A copy of a config dump with secret-named keys' values masked and strings redacted."""
    if isinstance(obj, dict):
        return {k: redact_tree(v, secret or secret_key(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact_tree(v, secret) for v in obj]
    if secret and isinstance(obj, str) and obj:  # credentials are strings; a count or a flag is not one
        return MASK
    return redact_text(obj) if isinstance(obj, str) else obj


class RedactingFilter(logging.Filter):
    """Masks secrets in every record's message and arguments (installed on the root logger's handlers)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _secrets or record.msg:
            try:
                message = record.getMessage()
            except Exception:  # noqa: BLE001 - a malformed record: leave it to the formatter
                return True
            redacted = redact_text(message)
            if redacted != message:
                record.msg, record.args = redacted, None
        if (
            record.exc_info
            and record.exc_info[1] is not None
            and not getattr(record, "_relax_redacted", False)
        ):
            record.exc_text = redact_text(logging.Formatter().formatException(record.exc_info))
            record.exc_info, record._relax_redacted = None, True
        return True


def write_secret_file(path: Any, text: str) -> None:
    """Write `text` to `path` readable by its owner only (folder 0700, file 0600), atomically."""
    import os
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)
