"""Rewards for the fault suite, configured by import path (`tests.faults.rewards:hang_when_armed`)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from relax.data.sample import Sample
from relax.rewards.text import first_number

sys.path.insert(0, str(Path(__file__).parent / "hook"))
from sitecustomize import claim  # noqa: E402 - the phase hook's own claim, so `hit` is written the same way


def hang_when_armed(sample: Sample) -> float:
    """`first_number` until the harness arms the phase `reward`; from then on every call hangs forever
    (a blocking sleep, as a stuck verifier or a lost remote call does), the first one marking the hit."""
    if os.environ.get("RELAX_FAULT_DIR") and _armed():
        claim("reward")
        while True:
            time.sleep(3600)
    return first_number(sample)


def _armed() -> bool:
    arm = Path(os.environ["RELAX_FAULT_DIR"]) / "arm"
    return arm.exists() and '"reward"' in arm.read_text()
