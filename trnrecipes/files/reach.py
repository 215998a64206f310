"""Whether this user can look a path up at all: a directory on the way that they cannot search, a symbolic link that
leads nowhere or into a loop. Said in words naming the directory or link, never as a PermissionError traceback
(sbatch, plan and the pre-flight run these on paths that other people's directories may hold).

Torch-free: `sbatch`, `plan` and the pre-flight (standard library only) use it.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return f"uid {os.geteuid()}"


def _unsearchable(path: Path) -> str:
    """The first directory on the way to `path` (from /) that this user cannot search, in words."""
    for directory in reversed([path, *path.parents][1:]):
        try:
            info = os.stat(directory)
        except OSError:
            break
        if not os.access(directory, os.X_OK):
            return (
                f"{directory} is not searchable by user {_user()} (mode {stat.S_IMODE(info.st_mode):o}, owner uid"
                f" {info.st_uid}): ask for access, or use a path that user can read"
            )
    return f"permission denied on the way to {path} for user {_user()}"


def blocked(path: str | Path) -> str | None:
    """Why `path` cannot be looked up by this user, or None (it exists, or plainly does not: the caller says which).
    Named: a directory on the way they cannot search, a link loop, a dangling symbolic link (the path itself)."""
    path = Path(os.path.abspath(path))
    try:
        os.stat(path)
        return None
    except PermissionError:
        return _unsearchable(path)
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{path}: a symbolic link loop (too many levels of links)"
        if err.errno == errno.ENAMETOOLONG:
            return f"{path}: the name is too long for the file system"
        if err.errno not in (errno.ENOENT, errno.ENOTDIR):
            return f"{path}: cannot be looked up ({err.strerror or err})"
    if os.path.islink(path):
        return f"{path} is a symbolic link to {os.readlink(path)}, which does not exist"
    return None
