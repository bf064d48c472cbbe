"""Makes the first Ray dashboard agent started with this folder on PYTHONPATH late, as a busy machine
does (tests/orchestration/test_local_ray.py): the agent whose marker file (`RELAX_TEST_SLOW_AGENT`) does
not exist yet creates it and sleeps past the raylet's fixed 15 s wait. Every other process is untouched."""

import os
import sys
import time

_marker = os.environ.get("RELAX_TEST_SLOW_AGENT")
if _marker and sys.argv and sys.argv[0].endswith(os.path.join("dashboard", "agent.py")):
    try:
        os.close(os.open(_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass
    else:
        time.sleep(20)
