"""Which file system holds a path, from /proc/self/mountinfo (Linux; standard library only), and whether it is one
that every node of a cluster mounts: a multi-node job's checkout, logs and run dir must be.

proc(5), /proc/pid/mountinfo: field 5 is the mount point (space, tab, newline and backslash written as \\ooo), the
field after the lone "-" is the file system type (FUSE file systems: fuse.<name>).
"""

from __future__ import annotations

import re
from pathlib import Path

MOUNTINFO = Path("/proc/self/mountinfo")
# Network, parallel and shared-disk file systems. FSx for Lustre mounts as lustre; EFS and FSx for OpenZFS or NetApp
# ONTAP as nfs4 / nfs; Weka as wekafs; ceph-fuse and the GlusterFS client as fuse.<name>.
SHARED_TYPES = frozenset(
    {
        "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "ceph", "fuse.ceph-fuse", "glusterfs",
        "fuse.glusterfs", "wekafs", "panfs", "pvfs2", "orangefs", "afs", "ocfs2", "gfs2", "fuse.juicefs",
    }
)  # fmt: skip


def parse_mountinfo(text: str) -> list[tuple[str, str]]:
    """(mount point, file system type) of each mount, in mountinfo's order: a later mount at the same point hides
    the earlier one (an autofs trigger, then the NFS mount it made)."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        try:
            dash = fields.index("-", 6)  # after the optional fields (shared:N, master:N, ...)
            mounts.append((_unescape(fields[4]), fields[dash + 1]))
        except (ValueError, IndexError):
            continue  # not a mount line
    return mounts


def mount_of(path: str, mountinfo: str) -> tuple[str, str] | None:
    """(mount point, type) of the file system holding `path` (absolute, links resolved): the longest mount point
    that is `path` or one of its parents; None where mountinfo names none."""
    best = None
    for point, kind in parse_mountinfo(mountinfo):
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            best = (point, kind)
    return best


def read_mountinfo() -> str | None:
    """This process's mount table, or None where there is none to read (not Linux)."""
    try:
        return MOUNTINFO.read_text(encoding="utf-8", errors="surrogateescape")
    except OSError:
        return None


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)
