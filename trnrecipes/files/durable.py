"""Durable writes by path, torch-free: the checkpoint writer (checkpoint/format.py) and the data conversions' outputs
(data/) are on disk before their names say they are whole. A conversion's parts are not synced as they are written;
their records carry the boot they were written in instead (data/parts.py), since only a crash of the machine can
lose what a killed process wrote.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

BOOT_ID = "/proc/sys/kernel/random/boot_id"  # Linux: a random id drawn at each boot
# A directory some file systems cannot sync (some FUSE mounts: EINVAL), or cannot open to sync (one writable and
# searchable but not readable: EACCES): its entries are then as durable as the file system makes them.
DIRECTORY_UNSYNCABLE = (errno.EINVAL, errno.ENOTSUP, errno.EACCES, errno.EPERM)


def make_readable(path: str | Path) -> None:
    """mkstemp and mkdtemp create 0600 and 0700, and safetensors' writer 0600: give the file (or directory) the mode
    a plain open() or mkdir() would have, so a team's shared storage lets the others read it."""
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)
    except OSError as err:  # a FUSE object-store or CIFS mount that sets no modes: what it gives stands
        if err.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES):
            raise


def fsync_path(path: str | Path) -> None:
    """Make a file's data, or a directory's entries (files created or renamed in it), durable. A read-only
    descriptor suffices for both on Linux."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(path: str | Path) -> None:
    """A file's data on disk, or a directory's files (one level) and entries."""
    if not os.path.isdir(path):
        fsync_path(path)
        return
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False):
            fsync_path(entry.path)
    _sync_directory(path)


def rename_synced(tmp: str | Path, out: str | Path) -> None:
    """os.replace(tmp, out) of a tmp already on disk (sync_tree), then the rename itself made durable where the file
    system allows: `out` is in place either way, so a directory that cannot be synced is no error."""
    os.replace(tmp, out)
    _sync_directory(Path(out).parent)


def durable_replace(tmp: str | Path, out: str | Path) -> None:
    """os.replace(tmp, out), with tmp's data on disk first: a crash of the machine never leaves `out` naming a file
    whose data was lost (a new name's data is not flushed at the rename on ext4 or XFS)."""
    sync_tree(tmp)
    rename_synced(tmp, out)


def boot_id() -> str | None:
    """This machine's current boot (None where the kernel does not say): page-cache data written in it survives a
    killed process, not a crash or a reboot, after which the id differs; another machine's differs too."""
    try:
        with open(BOOT_ID, encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _sync_directory(path: str | Path) -> None:
    try:
        fsync_path(path)
    except OSError as err:
        if err.errno not in DIRECTORY_UNSYNCABLE:
            raise
