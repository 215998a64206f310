"""The bytes that mark an Arrow IPC file or stream (the Arrow columnar format's IPC spec: "Encapsulated message
format", "IPC Streaming Format", "IPC File Format"), standard library only: sbatch's data checks read them on the
rendering path, which imports no pyarrow."""

from __future__ import annotations

from pathlib import Path

ARROW_FILE_MAGIC = b"ARROW1"  # Arrow IPC file format: "ARROW1" + padding, at the start and the end
ARROW_STREAM_MARKER = b"\xff\xff\xff\xff"  # Arrow IPC stream: each message starts with the continuation marker
END_OF_STREAM = ARROW_STREAM_MARKER + b"\x00\x00\x00\x00"  # a stream's writer puts it last when it is closed


# What a stream without its end marker is told (the IPC spec lets a writer end a stream by closing it unmarked, but
# pyarrow's, datasets', arrow-rs' and Java's writers all mark it when closed: one unmarked was most likely cut short).
CUT_SHORT = (
    "an Arrow stream without its end-of-stream marker: cut short (a copy or a write interrupted?), or written by a"
    " writer never closed; copy or write it again"
)


def stream_cut_short(path: str | Path) -> bool:
    """Whether `path`, an Arrow IPC stream, lacks the end-of-stream marker: a copy or a write cut short at the end
    of a record batch reads as whole, with the batches after the cut missing. (A stream in the format before
    Arrow 0.15, without continuation markers, is not judged: its end marker is four zero bytes, which a batch's
    padding may end with.)"""
    with open(path, "rb") as f:
        if f.read(len(ARROW_STREAM_MARKER)) != ARROW_STREAM_MARKER:
            return False
        size = f.seek(0, 2)
        if size < len(ARROW_STREAM_MARKER) + len(END_OF_STREAM):
            return True
        f.seek(size - len(END_OF_STREAM))
        return f.read(len(END_OF_STREAM)) != END_OF_STREAM
