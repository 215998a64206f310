"""The text field of a block of JSON lines read by msgspec, the block in one call, or where it is not installed (a
Neuron SDK venv) by pyarrow's C++ JSON reader, where the block is one they read as Python's json module reads each
line: else None, and the caller reads the block line by line (arrow.py), which names each bad record's line. msgspec
is two to three times as fast as json, pyarrow's reader 1.5 times; the texts come out as Arrow either way.
"""

from __future__ import annotations

import decimal
import functools
import json
import re
import struct
import sys
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.json as pa_json

try:
    import msgspec
except ImportError:  # not installed (a Neuron SDK venv): pyarrow's reader instead
    msgspec = None

# A character that str.isspace() does not count (every other is one of these, which str.strip() removes): a text
# with none is blank, as `not text.strip()` says. tests/test_json_lines.py checks the set against Python's.
NOT_SPACE = r"[^\t-\r\x1c- \x{85}\x{a0}\x{1680}\x{2000}-\x{200a}\x{2028}\x{2029}\x{202f}\x{205f}\x{3000}]"
MAX_BLOCK = (1 << 31) - 2  # the reader's block size is an int32; a larger block goes line by line
# Calls of room json_loads gives json on a RecursionError: it then reads about 1190 levels of nesting, whatever the
# caller's stack, deeper than msgspec reads under the default recursion limit (998 less the stack), which the CLI
# runs under (a process that raised the limit, as inductor does to 2000, lets both read deeper)
RECURSION_ROOM = 1200
MAX_OPENERS = 1024  # a line with more `[` and `{` than this goes line by line with pyarrow's reader (any depth)
NEWLINE, OPEN, CLOSE, CR = b"\n{}\r"


def arrow_texts(block: bytes, lines: np.ndarray, text_field: str) -> pa.Array | None:
    """The texts (large_string) at `text_field` of the JSON lines in `block`, one per line (`lines`: the positions
    of its newlines; the last line may lack one), or None where a line is bad or could be read otherwise than
    Python's json module reads it: then every line must be read by json. Both parsers take what json refuses
    (invalid UTF-8 outside the text, an integer of more digits than int() takes), so that is checked first."""
    if not block or len(block) > MAX_BLOCK or not _utf8(block):
        return None
    data = np.frombuffer(block, np.uint8)
    if _long_digit_run(block, data):
        return None
    decode = _text_decoder(text_field) if msgspec is not None else None
    if decode is not None:
        return _decoded_texts(block, lines, decode)
    return _read_texts(block, data, lines, text_field)


def json_loads(line: str | bytes) -> object:
    """json.loads, where nesting too deep for the stack left (a RecursionError) is tried again with RECURSION_ROOM
    frames of room: how deep a line may nest is then the same from any caller, so the line-by-line reader takes a
    line or refuses it wherever it is met (Python 3.11 and before: 3.12's json counts C recursion, not this limit)."""
    try:
        return json.loads(line)
    except ValueError as err:  # json.JSONDecodeError, or an integer longer than int() takes (sys.int_info): valid JSON
        if "int_max_str_digits" not in str(err):
            raise
        return json.loads(line, parse_int=_long_int)  # the record's other fields are read
    except RecursionError:
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(limit - _recursion_left() + RECURSION_ROOM)
        try:
            return json.loads(line)
        finally:
            sys.setrecursionlimit(limit)


def _long_int(digits: str) -> int:
    """An integer of any length: Decimal reads the digits and int() takes a Decimal without the str limit."""
    return int(decimal.Decimal(digits))


def _recursion_left(calls: int = 0) -> int:
    """How many calls deeper than this one the recursion limit allows: the stack's depth as the limit counts it
    (generators resumed from C count more than their frames), found by recursing to it (rare: a line nested deep)."""
    try:
        return _recursion_left(calls + 1)
    except RecursionError:
        return calls


@functools.lru_cache(maxsize=8)
def _text_decoder(text_field: str) -> Callable[[bytes], list] | None:
    """msgspec's decoder of JSON lines to records of their text at `text_field` (a string: else an error), other
    fields skipped (still checked as JSON); None for a name it cannot match (a quote, backslash or control
    character in it)."""
    try:
        record = msgspec.defstruct("Record", [("text", str)], rename={"text": text_field}, gc=False)
    except ValueError:
        return None
    return msgspec.json.Decoder(record).decode_lines


def _decoded_texts(block: bytes, lines: np.ndarray, decode_lines: Callable[[bytes], list]) -> pa.Array | None:
    """The block decoded at once (a call per line cost 40% more on short documents). decode_lines takes values
    apart by whitespace, newlines or not, and skips blank lines; so each line must start with `{` and end with `}`,
    which keeps an object on its line (after a `}` inside an open object or array only `,` `}` `]` may follow, and
    a string cannot hold a raw newline), and the records must be as many as the lines, which leaves no line two
    objects. msgspec refuses what json refuses (and NaN, Infinity, a lone surrogate: line by line then) and takes
    the last of duplicate keys as json does."""
    if not _one_object_a_line(block, lines):
        return None
    try:
        records = decode_lines(block)
    except (ValueError, RecursionError):  # DecodeError, ValidationError; nesting less deep than json_loads reads
        return None
    if len(records) != len(lines) + (block[-1] != NEWLINE):
        return None
    return pa.array([record.text for record in records], pa.large_string())


def _read_texts(block: bytes, data: np.ndarray, lines: np.ndarray, text_field: str) -> pa.Array | None:
    """The texts by pyarrow's reader, where it reads what json does. Checked first, since the reader takes liberties
    (two objects on a line, NaN's cousins Inf and -NaN) and crashes on a line `null` (Apache Arrow, "NULL Pointer
    Dereference bug"), and reads any depth of nesting; its errors and nulls are the rest."""
    if not _one_object_a_line(block, lines) or _nonstandard_number(block, data) or _many_openers(data, lines):
        return None
    schema = pa.schema([pa.field(text_field, pa.large_string())])
    options = pa_json.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    read = pa_json.ReadOptions(use_threads=False, block_size=len(block) + 1)
    try:
        table = pa_json.read_json(pa.BufferReader(block), read_options=read, parse_options=options)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # not JSON, a text that is no string, a duplicate key
        return None
    count = len(lines) + (block[-1] != NEWLINE)
    column = table.column(0)
    if table.num_rows != count or column.null_count:  # a missing or null text
        return None
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def non_blank(texts: pa.Array) -> pa.Array:
    """True for each text with a character that is not whitespace (`text.strip()` is not empty)."""
    return pc.match_substring_regex(texts, NOT_SPACE)


def _one_object_a_line(block: bytes, lines: np.ndarray) -> bool:
    """Every line starts with `{` and ends with `}` (then CR), so no object spans two lines; with a row per line
    from the reader, each line holds one object and nothing else (a blank line, leading spaces: line by line)."""
    data = np.frombuffer(block, np.uint8)
    ended = block[-1] == NEWLINE
    starts = (lines[:-1] if ended else lines) + 1  # of every line but the first
    if data[0] != OPEN or not np.all(data[starts] == OPEN):
        return False
    ends = lines if ended else np.append(lines, len(block))  # a newline, or where the last line's would be
    last = data[ends - 1]  # no line is empty: each starts with {
    crlf = last == CR
    last[crlf] = data[ends[crlf] - 2]
    return bool(np.all(last == CLOSE))


def _many_openers(data: np.ndarray, lines: np.ndarray) -> bool:
    """A line with more than MAX_OPENERS `[` and `{` (in its text too): it could nest deeper than json_loads reads."""
    openers = np.flatnonzero((data | 0x20) == OPEN)  # `[` is `{` less 0x20
    if len(openers) <= MAX_OPENERS:
        return False
    return int(np.bincount(np.searchsorted(lines, openers)).max()) > MAX_OPENERS


def _utf8(block: bytes) -> bool:
    """Valid UTF-8 throughout (both parsers skip invalid bytes outside the text; pyarrow's passes them in it)."""
    offsets = pa.py_buffer(struct.pack("<qq", 0, len(block)))
    try:
        pa.Array.from_buffers(pa.large_string(), 1, [None, offsets, pa.py_buffer(block)]).validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


def _long_digit_run(block: bytes, data: np.ndarray) -> bool:
    """A run of more digits than Python converts to an int (sys.get_int_max_str_digits: json refuses such a number,
    the reader takes it): such a run covers a multiple of the limit, so only the digits there are looked around."""
    limit = sys.get_int_max_str_digits()
    if limit == 0 or len(block) <= limit:
        return False
    for at in (np.flatnonzero((data[::limit] - 48) < 10) * limit).tolist():
        after = _DIGITS.match(block, at).end() - at
        before = _DIGITS.match(block[max(0, at - limit) : at][::-1]).end()
        if before + after > limit:
            return True
    return False


_DIGITS = re.compile(rb"[0-9]*")


def _nonstandard_number(block: bytes, data: np.ndarray) -> bool:
    """`Inf` or `-NaN` where a value starts: the reader takes them (with NaN, Infinity and -Infinity, which json takes
    too); json does not."""
    infs = _found(data, b"Inf", 0)
    return any(block[at : at + 8] != b"Infinity" and _value_starts_at(block, at) for at in infs) or bool(
        _found(data, b"-NaN", 1)
    )


def _found(data: np.ndarray, word: bytes, rare: int) -> list[int]:
    """Where `word` starts in `data`, found by its byte `rare` (a capital: few in text), then the others."""
    at = np.flatnonzero(data[rare : len(data) - len(word) + 1 + rare] == word[rare])
    for k, byte in enumerate(word):
        if k != rare and len(at):
            at = at[data[at + k] == byte]
    return at.tolist()


def _value_starts_at(block: bytes, at: int) -> bool:
    """Whether what precedes `at`, past JSON whitespace and a minus, is `:`, `[` or `,`: a value starts there."""
    before = block[max(0, at - 64) : at].rstrip(b" \t\r\n")
    before = before[:-1].rstrip(b" \t\r\n") if before.endswith(b"-") else before
    return not before or before[-1:] in (b":", b"[", b",")  # none: 64 bytes of whitespace, taken as a start
