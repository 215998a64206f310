"""fsync by path, torch-free: the checkpoint writer (checkpoint/format.py) and the data conversions' parts
(data/parts.py) make what they wrote durable before it is renamed or recorded."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Make a file's data, or a directory's entries (files created or renamed in it), durable. A read-only
    descriptor suffices for both on Linux."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
