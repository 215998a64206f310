"""The OSErrors that say the storage refuses writes: read-only, no permission, a full disk or quota, a file size
limit. Running the same again fails the same way (unlike EIO or ESTALE, which may pass with time), so they are the
user's to fix, and each is told with what would fix it."""

from __future__ import annotations

import errno
import os
import re

FIXES = {
    errno.EROFS: "remount it writable",
    errno.EACCES: "fix its permissions",
    errno.EPERM: "fix its permissions",
    errno.ENOSPC: "free space there",
    errno.EDQUOT: "free space there (or raise the quota)",
    errno.EFBIG: "raise the file size limit (ulimit -f)",
}


def errno_of(err: OSError) -> int | None:
    """An OSError's errno, also where it is only in its text: shutil.copytree's Error ("[Errno 28] ..."), pyarrow's
    errors ("[errno 13] Permission denied")."""
    found = None if err.errno is not None else re.search(r"\[errno (\d+)\]", str(err), re.IGNORECASE)
    return int(found.group(1)) if found else err.errno


def storage_errno(err: BaseException) -> int | None:
    """The errno of an OSError saying the storage refuses writes (FIXES), else None."""
    code = errno_of(err) if isinstance(err, OSError) else None
    return code if code in FIXES else None


def storage_problem(err: BaseException) -> str | None:
    """'[Errno 28] No space left on device; free space there' for a storage error, else None."""
    code = storage_errno(err)
    return None if code is None else f"[Errno {code}] {os.strerror(code)}; {FIXES[code]}"
