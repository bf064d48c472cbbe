"""The fast part of the fault-injection matrix (scripts/fault_matrix.py runs all of it, and so does
`bash scripts/test.sh --full`; docs/faults.md has its table): the harness's own pieces without Ray, then a
few representative cells, each a real `relax train` on this host with one fault injected at one phase."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from tests.faults.cells import Cell, span
from tests.faults.fake_engine import REFUSAL, FakeEngine
from tests.faults.harness import run_cell
from tests.faults.places import HOOK_DIR, Assets


def test_the_phase_hook_lets_one_call_claim_the_armed_phase(tmp_path):
    """Imported with RELAX_FAULT_DIR set, the hook wraps the phase methods; only the armed phase is hit,
    once, by the first call; the others go on untouched."""
    code = (
        "from relax.roles.actor import ActorRole\n"
        "import sitecustomize as hook\n"
        "assert ActorRole.train_sync.__wrapped__ is not None\n"
        "print(hook.claim('push'), hook.claim('update'), hook.claim('update'))\n"
    )
    (tmp_path / "arm").write_text(json.dumps({"phase": "update", "hold_s": 0.25}))
    env = {**os.environ, "RELAX_FAULT_DIR": str(tmp_path), "PYTHONPATH": f"{HOOK_DIR}:."}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["0.0", "0.25", "0.0"]
    hit = json.loads((tmp_path / "hit").read_text())
    assert hit["phase"] == "update" and hit["pid"] > 0


def test_the_fake_engine_is_healthy_and_refuses_the_group():
    with FakeEngine() as fake:
        assert httpx.get(f"{fake.url}/health").status_code == 200
        assert httpx.get(f"{fake.url}/health_generate").status_code == 200
        refused = httpx.post(
            f"{fake.url}/init_weights_update_group", json={}, headers={"Authorization": "Bearer x"}
        )
        assert refused.status_code == 400 and refused.json() == {"success": False, "message": REFUSAL}
        assert httpx.post(f"{fake.url}/generate", json={}).status_code == 404
        assert fake.paths() == ["/health", "/health_generate", "/init_weights_update_group", "/generate"]
        assert fake.requests[2]["authorization"] == "Bearer x"


def test_span_names_the_steps():
    assert span([1, 2, 3]) == "1-3"
    assert span([1, 2, 4]) == "1,2,4"
    assert span([]) == "none"


# Representative cells (about a minute each on two cores), all in the full tier: CI kills the only engine
# just before a weight push in process (tests/ops/test_faults_e2e.py, the recovery race of issue 43),
# refuses an elastic engine's weight-sync group there too, stops runs by SIGTERM in an update
# (tests/e2e/test_interrupt.py) and by two SIGTERMs at start-up (tests/cluster); the harness's phase hook
# is checked in this file.
CELLS = [
    pytest.param(Cell("kill:engine", "push", "colocate"), marks=pytest.mark.full),
    pytest.param(Cell("sigterm2", "update", "colocate"), marks=pytest.mark.full),
    # the same refusal as tests/ops/test_faults_e2e.py's elastic scale-out, through the harness
    pytest.param(Cell("refused_group", "push", "fully_async"), marks=pytest.mark.full),
]


@pytest.mark.slow
@pytest.mark.parametrize("cell", CELLS, ids=lambda c: c.name)
def test_fault_cell(cell, tiny_model_dir, arith_file, tmp_path):
    result = run_cell(cell, tmp_path, Assets(tiny_model_dir, arith_file, arith_file), keep=True)
    log = open(result.log, errors="replace").read()[-4000:] if os.path.exists(result.log) else ""
    assert result.ok, f"{result.outcome}\nnotes: {result.notes}\n--- run log (end) ---\n{log}"
    want = "stopped, named cause" if cell.fault == "sigterm2" else "finished, exact steps"
    assert result.outcome == want, result
