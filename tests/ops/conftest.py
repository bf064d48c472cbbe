"""The fault-injection folder (relax/utils/faults.py) is set when this file is collected, before the
session's Ray cluster starts, so every process of the cluster inherits it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from relax.utils import faults

os.environ.setdefault(faults.ENV, tempfile.mkdtemp(prefix="relax-faults-"))


@pytest.fixture
def fault_dir() -> Path:
    return Path(os.environ[faults.ENV])
