from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/golden.py

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path = REPO, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m trnrecipes ...` in a fresh interpreter, as users run it."""
    return subprocess.run(
        [sys.executable, "-m", "trnrecipes", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=120,
    )


@pytest.fixture
def cli():
    return run_cli
