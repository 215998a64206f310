"""msgspec, or pyarrow's JSON reader where msgspec is not installed, on blocks of JSON lines (json_lines.py): taken
only where it reads what Python's json reads, line by line; every other block goes to the line-by-line reader, which
names each bad record's line. Every test runs with each parser."""

from __future__ import annotations

import io
import json
import sys
from decimal import Decimal

import numpy as np
import pyarrow as pa
import pytest
from test_data_inputs import write

from trnrecipes.data import arrow, json_lines
from trnrecipes.data.arrow import file_records, file_texts
from trnrecipes.data.bad_records import BadRecords
from trnrecipes.data.inputs import InputFile
from trnrecipes.data.json_lines import arrow_texts, non_blank

READ_AS_JSON_DOES = [
    b'{"text": "plain"}',
    b'{"text": "caf\\u00e9 \\ud83d\\ude00 \\u0000 \\/ \\b\\f\\n\\r\\t \\" \\\\ \\u2028"}',
    '{"text": "raw UTF-8: café 東京 🙂"}'.encode(),
    b'{"id": 1, "meta": {"a": [1, {"text": "nested, not it"}], "b": null}, "text": "after nesting", "n": -0.5e3}',
    b'{"text": "crlf"}\r',
    b'{ "text" : "spaces inside" , "x" : [ ] }',
    b'{"t\\u0065xt": "an escaped key"}',
    b'{"text": "other numbers", "d": 123456789012345678901234567890, "e": -0, "f": 1E+5, "g": 1.5e-300}',
    b'{"text": "Information and Informed: words, not numbers", "inf": "Inf"}',
    b'{"text": "' + b"long " * 200_000 + b'"}',
    b'{"text": "   "}',
    b'{"text": ""}',
    b'{"text": "no newline at the end"}',
]  # fmt: skip

# What json reads, and pyarrow's reader too, where msgspec refuses: line by line with msgspec
MSGSPEC_REFUSES = {
    "NaN, Infinity, -Infinity": b'{"text": "a", "a": NaN, "b": Infinity, "c": -Infinity}',
}

LINE_BY_LINE = {
    "a line null (crashes the reader)": b'{"text": "a"}\nnull',
    "two objects on a line": b'{"text": "a"} {"text": "b"}',
    "a leading space (msgspec decodes the block at once: a line must start with {)": b' {"text": "a"}',
    "a trailing space": b'{"text": "a"} ',
    "an object over two lines, two on another": b'{"text": "x", "o":\n{"a": 1}}\n{"text": "a"} {"text": "b"}',
    "one over lines of {...}, two on another": b'{"text": "x", "o": {"a": 1}\n{"b": 2}}\n{"text": "a"} {"text": "b"}',
    "Inf": b'{"text": "a", "n": Inf}',
    "-Inf": b'{"text": "a", "n": [1, -Inf]}',
    "-NaN": b'{"text": "a", "n": -NaN}',
    "an integer json refuses": b'{"text": "a", "n": ' + b"9" * 5000 + b"}",
    "invalid UTF-8 outside the text": b'{"text": "a", "m": "\xff"}',
    "a BOM": b'\xef\xbb\xbf{"text": "a"}',
    "a blank line": b'{"text": "a"}\n\n{"text": "b"}',
    "a lone surrogate": b'{"text": "\\ud800"}',
    "a lone surrogate outside the text": b'{"text": "a", "s": "\\udc00"}',
    "a number as text": b'{"text": 5}',
    "no text": b'{"body": "a"}',
    "a null text": b'{"text": null}',
    "a CR between objects": b'{"text": "a"}\r{"text": "b"}',
    "a whitespace-only line": b'{"text": "a"}\n \t\r\n{"text": "b"}',
    "a vertical tab after the object (not JSON's whitespace)": b'{"text": "a"}\x0b',
    "a tab inside the text": b'{"text": "a\tb"}',
    "a trailing comma": b'{"text": "a", "n": [1,]}',
    "a leading zero elsewhere": b'{"text": "a", "n": 01}',
    "a long digit run in a text (the check is cheap, so it errs on the safe side)": b'{"text": "' + b"7" * 5000 + b'"}',
    "a lone surrogate cutting a text": b'{"text": "a\\ud83d"}',
    "nesting json reads with its room (1100 levels)": b'{"text": "a", "n": ' + b"[" * 1100 + b"]" * 1100 + b"}",
    "nesting json refuses (5000 levels)": b'{"text": "a", "n": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
}

# Read as json does by msgspec, but line by line with pyarrow's reader: its checks are cheap, so they err on the safe
# side (json would read these alike)
PYARROW_REFUSES = {
    "Inf after a comma in a text": b'{"text": "Information, Informed"}',
    "a duplicate key (json takes the last)": b'{"text": "a", "text": "b"}',
}


@pytest.fixture(autouse=True)
def default_recursion_limit():
    """Python's default recursion limit, which `trnrecipes data to-arrow` runs under: how deep json and msgspec read
    depends on it, and inductor raises it to 2000 when a test in the same process compiles."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(1000)
    yield
    sys.setrecursionlimit(limit)


@pytest.fixture(params=["msgspec", "pyarrow"])
def parser(request, monkeypatch) -> str:
    """Which parser arrow_texts uses: msgspec where it is installed, else pyarrow's reader (forced here)."""
    if request.param == "pyarrow":
        monkeypatch.setattr(json_lines, "msgspec", None)
    elif json_lines.msgspec is None:
        pytest.skip("msgspec is not installed")
    return request.param


def newlines(block: bytes) -> np.ndarray:
    return np.flatnonzero(np.frombuffer(block, np.uint8) == ord("\n"))


def python_texts(block: bytes) -> list:
    return [json.loads(line)["text"] for line in block.split(b"\n")]


def test_blocks_read_as_json_does_come_as_arrow_with_the_same_texts(parser):
    block = b"\n".join(READ_AS_JSON_DOES)
    texts = arrow_texts(block, newlines(block), "text")
    assert texts is not None and texts.type == pa.large_string()
    assert texts.to_pylist() == python_texts(block)
    for line in READ_AS_JSON_DOES:  # each alone too, with its newline and without
        for alone in (line, line + b"\n"):
            assert arrow_texts(alone, newlines(alone), "text").to_pylist() == [json.loads(line)["text"]], line[:60]


@pytest.mark.parametrize("what", [*LINE_BY_LINE, *MSGSPEC_REFUSES, *PYARROW_REFUSES])
def test_blocks_a_parser_could_read_otherwise_go_line_by_line_the_others_as_json_does(what, parser):
    line = {**LINE_BY_LINE, **MSGSPEC_REFUSES, **PYARROW_REFUSES}[what]
    block = b'{"text": "good"}\n' + line + b'\n{"text": "good"}\n'
    texts = arrow_texts(block, newlines(block), "text")
    refused = {"msgspec": MSGSPEC_REFUSES, "pyarrow": PYARROW_REFUSES}[parser]
    if what in LINE_BY_LINE or what in refused:
        assert texts is None
    else:
        assert texts.to_pylist() == python_texts(block.rstrip(b"\n"))


@pytest.mark.parametrize("what", [*LINE_BY_LINE, *MSGSPEC_REFUSES, *PYARROW_REFUSES])
def test_a_file_with_each_gives_the_texts_and_bad_records_of_the_line_by_line_reader(what, parser, tmp_path):
    """As json reads it: an integer of too many digits or invalid UTF-8 outside the text (both parsers take them) is
    a bad record named by its line; NaN is read."""
    lines = [b'{"text": "before"}', {**LINE_BY_LINE, **MSGSPEC_REFUSES, **PYARROW_REFUSES}[what], b'{"text": "after"}']
    src = InputFile(write(tmp_path / "one.jsonl", b"\n".join(lines) + b"\n"), "jsonl")
    readers_agree(src)


def readers_agree(src: InputFile) -> tuple[list, int]:
    """Reads `src` both ways, block by block (file_texts) and line by line (file_records), skipping bad records, and
    checks they give the same texts and the same rejects; returns the blocks (Arrow arrays or lists of texts) and
    the count of bad records."""
    quick, one_by_one = BadRecords("skip"), BadRecords("skip")
    quick.sink, one_by_one.sink = io.StringIO(), io.StringIO()
    blocks = [texts for texts, _ in file_texts(src, "text", quick, None)]
    texts = [t for b in blocks for t in (b.to_pylist() if isinstance(b, pa.Array) else b)]
    assert texts == [text for text, _ in file_records(src, "text", one_by_one, None)]
    assert quick.sink.getvalue() == one_by_one.sink.getvalue() and quick.count == one_by_one.count
    return blocks, quick.count


def nested(depth: int) -> bytes:
    return b'{"text": "a", "y": 0, "n": ' + b"[" * (depth - 1) + b"]" * (depth - 1) + b"}"


def test_nesting_at_the_limit_is_taken_and_one_level_more_refused_whatever_the_block(parser, tmp_path):
    """How deep json_loads reads does not depend on the caller's stack; msgspec reads less deep, pyarrow's reader
    any depth, so a line at the limit goes line by line with both, and the verdict is json's in either loop."""
    deepest = next(d for d in range(1000, 2000) if not _reads(nested(d + 1)))
    assert _reads(nested(deepest)) and deepest > json_lines.MAX_OPENERS
    for depth, taken in ((deepest, True), (deepest + 1, False)):
        line = nested(depth)
        assert arrow_texts(line, newlines(line), "text") is None
        src = InputFile(write(tmp_path / f"{depth}.jsonl", b'{"text": "before", "y": 1}\n' + line + b"\n"), "jsonl")
        quick, labelled = BadRecords("skip"), BadRecords("skip")
        texts = [t for b, _ in file_texts(src, "text", quick, None) for t in _listed(b)]
        assert texts == [text for text, _ in file_records(src, "text", labelled, "y")]  # the labelled loop
        assert texts == (["before", "a"] if taken else ["before"]) and quick.first == labelled.first
        if not taken:
            assert quick.first.startswith(f"{src.name}:2: JSON nested too deep for Python's json module to read (")


def _reads(line: bytes) -> bool:
    try:
        json_lines.json_loads(line)
    except RecursionError:
        return False
    return True


def _listed(texts) -> list:
    return texts.to_pylist() if isinstance(texts, pa.Array) else texts


def test_a_lone_surrogate_is_a_bad_record_named_in_the_labelled_loop_too(tmp_path):
    """json reads `\\ud83d` alone as a surrogate, which no UTF-8 (and so no Arrow string) can hold: a bad record."""
    src = InputFile(write(tmp_path / "l.jsonl", b'{"text": "ok", "y": 1}\n{"text": "x\\ud83d", "y": 0}\n'), "jsonl")
    bad = BadRecords("skip")
    assert list(file_records(src, "text", bad, "y")) == [("ok", 1)]
    reason = "field 'text' holds an unpaired surrogate escape (\\ud83d): not encodable as UTF-8"
    assert bad.first == f"{src.name}:2: {reason}"


@pytest.mark.parametrize("name", ["body text", "t\u00e9xt", "1st", "", 'say "hi"', "back\\slash", "tab\tbed"])
def test_a_text_field_of_any_name_is_read(name, parser):
    """msgspec matches a name with a space or a non-ASCII letter, escaped or not; one with a quote, a backslash or
    a control character it cannot: pyarrow's reader reads that one."""
    records = [{name: "first", "other": 1}, {"other": 2, name: "second"}]
    block = b"\n".join(json.dumps(r, ensure_ascii=k == 0).encode() for k, r in enumerate(records))
    assert arrow_texts(block, newlines(block), name).to_pylist() == ["first", "second"]


def test_both_parsers_give_the_same_arrow_bytes(monkeypatch):
    """The texts as the same bytes in an Arrow IPC stream (a conversion's output is compared file to file)."""
    block = b"\n".join(READ_AS_JSON_DOES) + b"\n"
    streams = []
    for parser in ("msgspec", "pyarrow"):
        if parser == "pyarrow":
            monkeypatch.setattr(json_lines, "msgspec", None)
        elif json_lines.msgspec is None:
            pytest.skip("msgspec is not installed")
        batch = pa.record_batch([arrow_texts(block, newlines(block), "text")], names=["text"])
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, batch.schema) as writer:
            writer.write_batch(batch)
        streams.append(sink.getvalue().to_pybytes())
    assert streams[0] == streams[1]


def test_blank_is_what_str_strip_leaves_empty_for_every_character():
    codes = np.array([c for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000])
    data = "".join(map(chr, codes.tolist())).encode()
    widths = 1 + (codes >= 0x80) + (codes >= 0x800) + (codes >= 0x10000)
    offsets = pa.py_buffer(np.concatenate([[0], np.cumsum(widths)]).astype(np.int64))
    chars = pa.Array.from_buffers(pa.large_string(), len(codes), [None, offsets, pa.py_buffer(data)])
    kept = non_blank(chars).to_numpy(zero_copy_only=False)
    spaces = [c for c in codes.tolist() if chr(c).isspace()]
    assert codes[~kept].tolist() == spaces and len(spaces) == 29
    assert non_blank(pa.array(["", " \u3000\t", " a "], pa.large_string())).to_pylist() == [False, False, True]


def test_a_file_of_good_and_bad_blocks_reads_as_line_by_line_with_the_same_lines(tmp_path, monkeypatch, parser):
    """Small blocks: the Arrow ones and the line-by-line ones alternate, and a bad record's line number counts the
    lines of the Arrow blocks before it."""
    monkeypatch.setattr(arrow, "JSON_BLOCK_BYTES", 64)
    lines = []
    odd = [*LINE_BY_LINE.values(), *MSGSPEC_REFUSES.values(), *PYARROW_REFUSES.values()]
    for k in range(60):
        lines += [json.dumps({"text": f"doc {k} caf\u00e9", "k": k}).encode(), b'{"text": "  "}']
        if k % 7 == 3:
            lines += [odd[k % len(odd)], b"{broken", b""]
    src = InputFile(write(tmp_path / "mixed.jsonl", b"\n".join(lines) + b"\n"), "jsonl")
    blocks, rejected = readers_agree(src)
    assert rejected > 8
    assert sum(isinstance(b, pa.Array) for b in blocks) > 10 and sum(isinstance(b, list) for b in blocks) > 3


def test_an_integer_longer_than_python_reads_is_valid_json_not_text():
    """Python's int() refuses over 4,300 digits (sys.set_int_max_str_digits), which json.loads raised as a ValueError:
    a record with such a number in another field was rejected as 'not valid JSON', and its text lost."""
    from trnrecipes.data.arrow import _parsed

    digits = "9" * 5000
    assert _parsed('{"text": "ok", "n": ' + digits + "}", "text") == ({"text": "ok", "n": int(Decimal(digits))}, None)
    assert _parsed('{"text": ' + digits + "}", "text")[1] == "field 'text' is int, not text"
