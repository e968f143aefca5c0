"""Records of a JSON list (LLaVA's format) or JSON Lines file, indexed once by byte offsets.

The file is read once, in chunks, and each top-level record's byte range is kept (two int64 per
record, `index_bytes`); a record is parsed again when it is asked for (`records[i]`: one seek
and one `json.loads`). Memory is the index plus one chunk, whatever the file's size, instead of
the parsed list (about six times the file). Every record must be a JSON object; a malformed file
is refused in one line naming the file, the line and column (and byte offset) of the error.

A byte that is not UTF-8 (a record written in Latin-1, a corrupt sector) spoils only its record:
the file is decoded with `surrogateescape`, so the structure around it still parses, and the
record is listed in `JsonRecords.not_utf8` (record -> file offset of its first such byte);
reading it raises `NotUtf8Error` naming the record, its line and the byte. The reader decides
(an error naming the file and record, or a counted skip: `llava.LlavaDataset`).
"""

from __future__ import annotations

import codecs
import json
import os
import re
from array import array
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_BYTES = 1 << 20
_SPACE = re.compile(r"\s*")
_ESCAPED = re.compile("[\udc80-\udcff]")  # a byte that is not UTF-8, after surrogateescape
_DECODER = json.JSONDecoder()


class JsonSyntaxError(ValueError):
    """Malformed JSON at byte offset `byte` of the file (`index_records` names the line)."""

    def __init__(self, message: str, *, byte: int) -> None:
        super().__init__(message)
        self.msg, self.byte = message, byte


class NotUtf8Error(ValueError):
    """A record holding a byte that is not UTF-8 (module docstring)."""


def line_and_column(path: str | Path, byte: int) -> tuple[int, int]:
    """1-based (line, column) of byte offset `byte` of a UTF-8 file (column in characters)."""
    with open(path, "rb") as handle:
        head = handle.read(byte)
    line = head.count(b"\n") + 1
    column = len(head[head.rfind(b"\n") + 1 :].decode("utf-8", errors="replace")) + 1
    return line, column


class _Scanner:
    """A window of the file as text, with the byte offset of every character position."""

    def __init__(self, handle, chunk: int) -> None:
        self.handle, self.chunk = handle, chunk
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="surrogateescape")
        self.text, self.eof = "", False
        self.escaped: deque[int] = deque()  # character positions of bytes that are not UTF-8
        self.base_char = 0  # characters dropped from the front of `text`
        self.cursor_char = self.cursor_byte = 0  # a known (character, byte) position pair

    def more(self, factor: int = 1) -> bool:
        """Read the next chunk into the window; False at the end of the file."""
        if self.eof:
            return False
        data = self.handle.read(self.chunk * factor)
        self.eof = not data
        new = self.utf8.decode(data, final=self.eof)
        start = self.base_char + len(self.text)
        self.escaped += [start + m.start() for m in _ESCAPED.finditer(new)]
        self.text += new
        return bool(data)

    def first_escaped(self, start: int, end: int) -> int | None:
        """The first character position in [start, end) that is a non-UTF-8 byte, or None
        (forgets the positions before `start`: records are indexed in order)."""
        while self.escaped and self.escaped[0] < start:
            self.escaped.popleft()
        return self.escaped[0] if self.escaped and self.escaped[0] < end else None

    def byte_at(self, char: int) -> int:
        """Byte offset of absolute character position `char` (moving forward only)."""
        local = self.cursor_char - self.base_char
        piece = self.text[local : char - self.base_char]
        self.cursor_byte += len(piece.encode("utf-8", "surrogateescape"))
        self.cursor_char = char
        return self.cursor_byte

    def skip_space(self, char: int) -> int:
        """First non-space position at or after `char` (reading on as needed)."""
        while True:
            local = _SPACE.match(self.text, char - self.base_char).end()
            if local < len(self.text) or not self.more():
                return self.base_char + local

    def peek(self, char: int) -> str:
        """The character at `char` ("" at the end of the file)."""
        while char - self.base_char >= len(self.text):
            if not self.more():
                return ""
        return self.text[char - self.base_char]

    def decode(self, char: int) -> tuple[Any, int]:
        """The JSON value starting at `char` and its end position (reading on as needed)."""
        factor = 1
        while True:
            try:
                value, end = _DECODER.raw_decode(self.text, char - self.base_char)
                return value, self.base_char + end
            except json.JSONDecodeError as err:
                if not self.more(factor):
                    at = self.byte_at(self.base_char + err.pos)
                    raise JsonSyntaxError(err.msg.removesuffix(" at"), byte=at) from None
                factor *= 2  # a record longer than the window: read on faster

    def drop_before(self, char: int) -> None:
        """Forget the text before `char` (already indexed)."""
        cut = min(char, self.cursor_char) - self.base_char
        if cut > self.chunk:
            self.text = self.text[cut:]
            self.base_char += cut


def index_records(
    path: str | Path, *, chunk: int = CHUNK_BYTES
) -> tuple[np.ndarray, np.ndarray, dict[int, int]]:
    """(byte offsets, byte lengths) int64 of every record of a JSON list or JSON Lines file,
    and the records holding a byte that is not UTF-8 (record -> file offset of that byte)."""
    offsets, lengths, not_utf8 = array("q"), array("q"), {}
    with open(path, "rb") as handle:
        scan = _Scanner(handle, chunk)
        pos = scan.skip_space(0)
        listed = scan.peek(pos) == "["
        pos = scan.skip_space(pos + 1) if listed else pos
        while True:
            head = scan.peek(pos)
            if head == "" or (listed and head == "]" and not offsets):
                break
            try:
                value, end = scan.decode(pos)
            except JsonSyntaxError as err:
                line, column = line_and_column(path, err.byte)
                raise ValueError(
                    f"{path}:{line}:{column}: invalid JSON in record {len(offsets)} "
                    f"(byte {err.byte}): {err.msg}"
                ) from None
            if not isinstance(value, dict):
                raise ValueError(
                    f"{path}: record {len(offsets)} at byte {scan.byte_at(pos)} is not an object"
                )
            bad = scan.first_escaped(pos, end)
            start = scan.byte_at(pos)
            if bad is not None:
                not_utf8[len(offsets)] = scan.byte_at(bad)
            offsets.append(start)
            lengths.append(scan.byte_at(end) - start)
            pos = scan.skip_space(end)
            sep = scan.peek(pos)
            if listed and sep == ",":
                pos = scan.skip_space(pos + 1)
            elif listed and sep == "]":
                break
            elif listed or sep not in ("{", ""):
                raise ValueError(f"{path}: expected ',' or ']' at byte {scan.byte_at(pos)}")
            scan.drop_before(pos)
        if listed and scan.peek(pos) != "]":
            raise ValueError(f"{path}: the JSON list is not closed")
        if listed and scan.peek(scan.skip_space(pos + 1)) != "":
            raise ValueError(f"{path}: text after the JSON list")
    arrays = np.frombuffer(offsets, dtype=np.int64), np.frombuffer(lengths, dtype=np.int64)
    return *arrays, not_utf8


class JsonRecords(Sequence[dict]):
    """The records of one file (module docstring); `records[i]` parses record i."""

    def __init__(self, path: str | Path, *, chunk: int = CHUNK_BYTES) -> None:
        self.path = Path(path)
        self._offsets, self._lengths, self.not_utf8 = index_records(self.path, chunk=chunk)
        self._handle = None
        self._pid = -1

    @property
    def index_bytes(self) -> int:
        """Memory of the index."""
        return int(self._offsets.nbytes + self._lengths.nbytes)

    def __len__(self) -> int:
        return len(self._offsets)

    def _file(self):
        if self._handle is None or self._pid != os.getpid():  # a forked child opens its own
            self._handle, self._pid = open(self.path, "rb"), os.getpid()  # noqa: SIM115
        return self._handle

    def __getitem__(self, index: int) -> dict[str, Any]:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} outside [0, {len(self)})")
        if index in self.not_utf8:
            raise NotUtf8Error(self.why_not_utf8(index))
        handle = self._file()
        handle.seek(int(self._offsets[index]))
        return json.loads(handle.read(int(self._lengths[index])))

    def why_not_utf8(self, index: int) -> str:
        """What is wrong with record `index` of `not_utf8`: the byte, its line and offset."""
        at = self.not_utf8[index]
        with open(self.path, "rb") as handle:
            handle.seek(at)
            byte = handle.read(1)
        line, column = line_and_column(self.path, at)
        return (
            f"{self.path}:{line}:{column}: record {index} is not UTF-8 text (byte "
            f"0x{byte.hex()} at offset {at})"
        )

    def refuse_not_utf8(self) -> None:
        """ValueError naming the first record that is not UTF-8 (for "error" mode), if any."""
        if self.not_utf8:
            first, more = min(self.not_utf8), len(self.not_utf8) - 1
            raise ValueError(
                f"{self.why_not_utf8(first)}{f' (and {more} more records)' if more else ''}; "
                "skip such records with --dip-bad-samples skip"
            )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(len(self)))

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handle"], state["_pid"] = None, -1  # file handles do not travel
        return state
