"""An agent program that runs every check of tests/openai_checks.py against the endpoint Relax gave it
(RELAX_BASE_URL): the agent endpoint must serve the same OpenAI API as an engine's `/v1`, n > 1 aside.
It prints the names of the checks that passed as JSON (and writes them to `--out FILE`); a failing check
fails the program."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, for `tests.openai_checks`

from openai import OpenAI  # noqa: E402

from tests import openai_checks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    client = OpenAI(
        base_url=os.environ["RELAX_BASE_URL"],
        api_key=os.environ["OPENAI_API_KEY"],
        max_retries=0,
        timeout=300,
    )
    model = client.models.list().data[0].id
    passed = openai_checks.run_all(client, model, max_n=1)
    if args.out:
        Path(args.out).write_text(json.dumps(passed))
    print(json.dumps(passed))


if __name__ == "__main__":
    main()
