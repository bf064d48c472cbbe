"""Notifications through Apprise (`ops.notify_urls`): run start, failures with the traceback, restarts,
and the run's end with a summary. Any Apprise URL works (Slack, e-mail, ntfy, `json://host/path` for a
plain HTTP POST of `{"title", "message", "type"}`).

Notifications run in the driver (the Controller's process), not in a Ray service, so that a failure is
still reported when the cluster is going down. Delivery problems are logged and never fail the run.
"""

from __future__ import annotations

import logging
import traceback

from relax.utils.redact import redact_text

logger = logging.getLogger(__name__)

KINDS = {"info": "info", "success": "success", "warning": "warning", "failure": "failure"}


class Notifier:
    def __init__(self, urls: list[str], run_name: str) -> None:
        self.run_name = run_name
        self._apprise = None
        if not urls:
            return
        try:
            import apprise
        except ImportError as e:
            raise ImportError(
                "ops.notify_urls needs the apprise package: pip install 'relax[metrics]' (or apprise)"
            ) from e
        self._apprise = apprise.Apprise()
        bad = [u for u in urls if not self._apprise.add(u)]
        if bad:
            raise ValueError(
                f"ops.notify_urls: Apprise does not understand {bad}; see "
                "https://github.com/caronc/apprise/wiki for URL formats (e.g. json://host:port/path)"
            )

    @property
    def enabled(self) -> bool:
        return self._apprise is not None

    def send(self, title: str, body: str, kind: str = "info") -> bool:
        """Deliver one notification; returns whether every URL accepted it."""
        if self._apprise is None:
            return False
        import apprise

        notify_type = {
            "info": apprise.NotifyType.INFO,
            "success": apprise.NotifyType.SUCCESS,
            "warning": apprise.NotifyType.WARNING,
            "failure": apprise.NotifyType.FAILURE,
        }[KINDS[kind]]
        try:
            ok = bool(
                self._apprise.notify(  # no credential leaves in a notification (relax/utils/redact.py)
                    title=redact_text(f"[relax {self.run_name}] {title}"),
                    body=redact_text(body),
                    notify_type=notify_type,
                )
            )
        except Exception:  # noqa: BLE001 - a notification must never end a training run
            logger.exception("notification %r could not be sent", title)
            return False
        if not ok:
            logger.warning("notification %r was not accepted by every ops.notify_urls target", title)
        return ok

    # -- the events of a run -----------------------------------------------------------------
    def run_started(self, start_step: int, num_steps: int, mode: str) -> None:
        where = f"from step {start_step}" if start_step else "from the start"
        self.send("run started", f"training {where} to step {num_steps} ({mode} mode)")

    def failure(self, what: str, exc: BaseException) -> None:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        self.send(f"failure: {what}", f"{exc}\n\n{tb}", kind="failure")

    def restart(self, what: str, detail: str) -> None:
        self.send(f"restart: {what}", detail, kind="warning")

    def run_ended(self, step: int, summary: dict[str, float], ok: bool = True) -> None:
        lines = [f"last step: {step}"] + [f"{k}: {v:.4g}" for k, v in sorted(summary.items())]
        self.send(
            "run finished" if ok else "run stopped", "\n".join(lines), kind="success" if ok else "failure"
        )
