"""The Pythons a login node may have besides ours (Ubuntu 22.04's 3.10, 24.04's 3.12), as tests/test_login_python.py
finds them: the newest of pyenv's versions, else python3.X on PATH. Run as a script (.ci/run does, before make test),
it exits 1 naming any that is missing, so CI never skips that test. Standard library only, for any python3."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

LOGIN_MINORS = ("3.10", "3.12")


def _version(python: str) -> str | None:
    try:
        done = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    except OSError:
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _release(python: Path) -> tuple[int, ...]:
    """pyenv's versions/3.10.13/bin/python -> (3, 10, 13): the newest first."""
    return tuple(int(x) if x.isdigit() else -1 for x in python.parent.parent.name.split("."))


def find(minor: str) -> str | None:
    """A runnable interpreter of Python `minor` (e.g. "3.10"), or None."""
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    pyenv = sorted(root.glob(f"versions/{minor}.*/bin/python"), key=_release, reverse=True)
    for candidate in [*map(str, pyenv), shutil.which(f"python{minor}")]:
        if candidate and _version(candidate) == minor:
            return candidate
    return None


if __name__ == "__main__":
    missing = [m for m in LOGIN_MINORS if find(m) is None]
    if missing:
        print(f"error: no Python {' or '.join(missing)} here (pyenv's versions/{missing[0]}.*, python{missing[0]} on"
              " PATH): tests/test_login_python.py installs the login-node tier on each and would be skipped; install"
              f" them (pyenv install {' '.join(missing)})", file=sys.stderr)  # fmt: skip
        sys.exit(1)
    print(" ".join(f"{m}: {find(m)}" for m in LOGIN_MINORS))
