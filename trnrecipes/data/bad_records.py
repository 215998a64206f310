"""What a conversion does with a record it cannot use (malformed JSON, a missing or null text, a null row in Parquet or
Arrow, invalid UTF-8): stop there, naming its file and line or row (error, the default), or skip it and list its
place and reason in OUTPUT.rejects.jsonl (skip), stopping once more than --max-bad-records are met.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from trnrecipes.data import CannotWrite, DataError
from trnrecipes.data.inputs import REJECTS_SUFFIX
from trnrecipes.files.storage_errors import storage_problem

POLICIES = ("error", "skip")
UTF8_ALIASES = {"fail": "error", "skip": "skip"}  # the deprecated --on-bad-utf8's values


def rejects_of(out: str | Path) -> Path:
    """Where `--on-bad-record skip` lists the records it skipped: beside the output (a file, or preprocess's prefix)."""
    return Path(f"{out}{REJECTS_SUFFIX}")


def bad_record_policy(
    on_bad_record: str | None, on_bad_utf8: str | None, max_bad_records: int | None
) -> tuple[str, str | None]:
    """(policy, a deprecation note to print or None) from the command's flags; --on-bad-utf8 is the old name."""
    note = None
    policy = on_bad_record or "error"
    if on_bad_utf8 is not None:
        alias = UTF8_ALIASES[on_bad_utf8]
        if on_bad_record is not None and on_bad_record != alias:
            raise DataError(
                f"--on-bad-utf8 {on_bad_utf8} and --on-bad-record {on_bad_record} disagree; give --on-bad-record only"
            )
        policy = alias
        note = (
            f"note: --on-bad-utf8 is deprecated: it is now --on-bad-record {alias}, which covers every bad record"
            " (malformed JSON, a missing or null text, a null row, invalid UTF-8)"
        )
    if max_bad_records is not None and policy != "skip":
        raise DataError(
            f"--max-bad-records {max_bad_records} applies to --on-bad-record skip (error, the default, stops at the"
            " first bad record)"
        )
    return policy, note


class BadRecords:
    """The policy for bad records, and the count of those skipped; `sink`, where set, receives one JSON line per
    skipped record: {"file", "line" or "row" (where the file has them), "reason"}."""

    def __init__(self, policy: str = "error", limit: int | None = None, rejects: Path | None = None):
        if policy not in POLICIES:
            raise DataError(f"--on-bad-record must be one of: {', '.join(POLICIES)}; got {policy!r}")
        if limit is not None and limit < 0:
            raise DataError(f"--max-bad-records must be 0 or more, got {limit}")
        self.policy, self.limit, self.rejects = policy, limit, rejects
        self.count = 0
        self.first: str | None = None  # the first skipped record's place and reason, for messages
        self.sink: TextIO | None = None

    def reject(self, file: str, reason: str, line: int | None = None, row: int | None = None) -> None:
        """A record of `file` (at `line`, from 1, or `row`, from 0) that cannot be used: a DataError, or counted."""
        place = file + (f":{line}" if line is not None else f": row {row}" if row is not None else "")
        if self.policy == "error":
            listed = f" and lists them in {self.rejects}" if self.rejects else ""
            raise DataError(f"{place}: {reason}; --on-bad-record skip skips such records{listed}")
        self.count += 1
        self.first = self.first or f"{place}: {reason}"
        if self.sink is not None:
            at = {"line": line} if line is not None else {"row": row} if row is not None else {}
            try:
                self.sink.write(json.dumps({"file": file, **at, "reason": reason}, ensure_ascii=False) + "\n")
            except OSError as err:  # not the input's: what reads it must not take it for its own error
                if (problem := storage_problem(err)) is None:
                    raise
                where = Path(getattr(self.sink, "name", "?")).parent
                raise CannotWrite(f"cannot write the list of bad records in {where}: {problem}") from err
        if self.limit is not None and self.count > self.limit:
            raise DataError(
                f"{place}: {reason}: bad record {self.count}, more than --max-bad-records {self.limit} allows (the"
                f" first: {self.first}); nothing written"
            )
