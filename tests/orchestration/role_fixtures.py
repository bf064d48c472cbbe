"""Role classes for the start-up tests, in a module Ray's workers import by name (a test module is
imported by pytest under another name)."""

from __future__ import annotations

import time


class Broken:
    def __init__(self, path: str) -> None:
        raise FileNotFoundError(f"no model folder at {path}")


class Slow:
    def __init__(self) -> None:
        time.sleep(60)


class Echo:
    def ping(self) -> str:
        return "pong"
