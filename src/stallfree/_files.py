"""Bounded reading of the files a user names on the command line: traces, run folders, vLLM result and
model or GPU spec JSON, calibration CSVs; and the check, before a command runs, of a file it will write
(writable_file_problem).

Imports allowed: the standard library and stallfree.core.errors (every subpackage's readers share it,
like _argtypes).

Every such file is read line by line (or, for a JSON document, up to a size), never whole, so that a
huge or hostile file ends in one line naming the file and the limit instead of a MemoryError after
gigabytes of allocation. The limits, and why each number:

- MAX_FILE_CHARS, 1 GiB of text (decompressed for a .gz): the largest public traces we know of
  (BurstGPT's full 1.4 M rows, the Azure 2023/2024 code and conversation traces) are 10-150 MB of
  text; a file 10 times larger still fits, while the rows read from 1 GiB (about 4 GB of Python
  objects at 40 characters a row) are about what a 16 GB machine can hold.
- MAX_LINE_CHARS, 1 MiB: the longest legitimate line is a Mooncake row, one hash id per 512 prompt
  tokens: about 2 KB at 128 K tokens, 20 KB at a million; a run folder's request line is under 1 KB.
- MAX_JSON_CHARS, 256 MiB: a `vllm bench serve --save-detailed` result holds every inter-token
  latency (about 20 characters each): 10,000 requests of 1,000 tokens are 200 MB. Spec files and a
  run folder's meta.json are a few KB.
- JSON nesting: Python's json module recurses once per level and stops at the interpreter's recursion
  limit (about 1,000 levels); the deepest legitimate document here nests under 10 levels, so a deeper
  one is refused as malformed rather than ending in a RecursionError.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import stat
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

from stallfree.core.errors import StallfreeError

__all__ = [
    "MAX_FILE_CHARS",
    "MAX_JSON_CHARS",
    "MAX_LINE_CHARS",
    "READ_ERRORS",
    "FileLimitError",
    "bounded_lines",
    "loads_line",
    "open_text",
    "read_json",
    "writable_file_problem",
]

#: Most characters read from one line-oriented file (decompressed), 1 GiB.
MAX_FILE_CHARS = 1 << 30
#: Most characters in one line of such a file, 1 MiB.
MAX_LINE_CHARS = 1 << 20
#: Most characters in one JSON document read whole, 256 MiB.
MAX_JSON_CHARS = 256 << 20

#: What reading a (possibly gzip) text file may raise besides FileLimitError: a missing or unreadable
#: file or a bad gzip header (OSError, gzip.BadGzipFile among them), a truncated gzip stream
#: (EOFError), corrupt compressed data (zlib.error), bytes that are not UTF-8 (UnicodeDecodeError).
READ_ERRORS: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error, UnicodeDecodeError)


class FileLimitError(StallfreeError, ValueError):
    """A file, a line or a JSON document is past its limit (or nested too deeply); the message names
    the file (and line) and the limit. Readers turn it into their own input error (exit 2)."""


def _mib(n: int) -> str:
    return f"{n / (1 << 30):g} GiB" if n >= 1 << 30 else f"{n / (1 << 20):g} MiB"


def open_text(path: str | Path, encoding: str = "utf-8-sig") -> IO[str]:
    """Open a text file for reading, decompressing it as it is read when its name ends in `.gz`.

    Nothing is read yet; pair it with bounded_lines(). Universal newlines are off (newline=""), as the
    csv module wants.

    Args:
        path: the file.
        encoding: its text encoding (default UTF-8, a leading byte-order mark dropped).

    Raises:
        OSError: the file cannot be opened.
        FileLimitError: a regular (uncompressed) file larger than MAX_FILE_CHARS bytes, told from its
            size alone without reading it.
    """
    p = Path(path)
    if p.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(p, "rb"), encoding=encoding, newline="")
    fh = open(p, encoding=encoding, newline="")  # noqa: SIM115 - the caller closes it
    try:
        st = os.fstat(fh.fileno())
    except OSError:
        fh.close()
        raise
    if stat.S_ISREG(st.st_mode) and st.st_size > MAX_FILE_CHARS:
        fh.close()
        raise FileLimitError(f"{path}: {st.st_size:,} bytes, over the limit of {_mib(MAX_FILE_CHARS)} for a file")
    return fh


def duplicated_column(header: Sequence[str] | None) -> str | None:
    """Return the first column name that a CSV header gives twice (names compared after stripping
    spaces), or None. A reader that looked a column up by name would silently take one of the two."""
    seen: set[str] = set()
    for name in header or ():
        name = (name or "").strip()
        if name in seen:
            return name
        seen.add(name)
    return None


def bounded_lines(fh: IO[str], path: str | Path, max_line: int | None = None,
                  max_total: int | None = None) -> Iterator[str]:
    """Yield the lines of an open text file (newlines kept), holding at most one line in memory.

    Args:
        fh: the open file (see open_text()).
        path: its name, for messages.
        max_line: most characters in one line (None: MAX_LINE_CHARS).
        max_total: most characters in the whole file, after decompression (None: MAX_FILE_CHARS).

    Raises:
        FileLimitError: a line over max_line characters ("path:line: ...") or a file over max_total;
            raised on reaching the limit, so at most max_line + 1 characters are held.
        (and whatever reading fh raises: see READ_ERRORS)
    """
    max_line = MAX_LINE_CHARS if max_line is None else max_line
    max_total = MAX_FILE_CHARS if max_total is None else max_total
    total = 0
    line_no = 0
    while True:
        text = fh.readline(max_line + 1)
        if not text:
            return
        line_no += 1
        if len(text) > max_line:
            raise FileLimitError(
                f"{path}:{line_no}: a line longer than {max_line:,} characters ({_mib(max_line)}), the limit "
                "for one line"
            )
        total += len(text)
        if total > max_total:
            raise FileLimitError(
                f"{path}: more than {max_total:,} characters ({_mib(max_total)}, decompressed), the limit for "
                "a file"
            )
        yield text


def read_json(path: str | Path, max_chars: int | None = None) -> Any:
    """Read and parse a whole JSON file (UTF-8), at most max_chars characters.

    Args:
        path: the file (a device such as /dev/zero is read only up to the limit).
        max_chars: most characters read (None: MAX_JSON_CHARS).

    Returns:
        The parsed value (any JSON type; the caller checks it).

    Raises:
        OSError: the file cannot be opened or read.
        UnicodeDecodeError: it is not UTF-8.
        json.JSONDecodeError: it is not JSON.
        FileLimitError: it is longer than max_chars characters, or nested too deeply for Python's json
            module (about 1,000 levels).
    """
    max_chars = MAX_JSON_CHARS if max_chars is None else max_chars
    with open(path, encoding="utf-8") as fh:
        text = fh.read(max_chars + 1)
    if len(text) > max_chars:
        raise FileLimitError(f"{path}: more than {max_chars:,} characters ({_mib(max_chars)}), the limit for a "
                             "JSON file")
    try:
        return json.loads(text)
    except RecursionError:
        raise FileLimitError(f"{path}: JSON nested too deeply (over about 1,000 levels)") from None


def loads_line(text: str) -> Any:
    """json.loads of one line of a JSON-lines file, too deep nesting turned into a ValueError (the
    caller prefixes path:line, and may skip the row as malformed).

    Raises:
        json.JSONDecodeError: not JSON.
        ValueError: nested too deeply (about 1,000 levels) for Python's json module.
    """
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply (over about 1,000 levels)") from None


def writable_file_problem(path: Path, flag: str, suffixes: tuple[str, ...], *,
                          creates_dirs: bool = False) -> str | None:
    """Why `path` cannot be written as one of `suffixes`, in one line naming `flag`, or None when it can: a
    name ending in one of them, not a directory, in a directory that exists, and a file the process can open
    for writing (it is opened for appending, which changes nothing, and removed again if it did not exist:
    permission bits do not tell, e.g. for root under /proc, or for a name too long). Meant to run before a
    command starts its work, so that a bad output name costs nothing.

    creates_dirs: the writer creates a missing directory, so a directory that does not exist yet is no
    problem (nor, then, is the file checked for writing).
    """
    if not str(path) or path.name in ("", ".", ".."):
        return f"{flag} {str(path)!r}: give a file name ({' or '.join(suffixes)})"
    parent = path.parent if str(path.parent) else Path(".")
    try:
        if path.is_dir():
            return f"{flag} {path}: is a directory; give a file name ({' or '.join(suffixes)})"
        if path.suffix not in suffixes:
            return (f"{flag} {path}: the file name must end in {' or '.join(suffixes)} (the format it is written "
                    f"in), got {path.suffix or 'no suffix'!r}")
        if not parent.is_dir():
            if creates_dirs and not parent.exists():
                return None
            return f"{flag} {path}: the directory {parent} does not exist"
        existed = path.exists()
        with open(path, "a", encoding="utf-8"):
            pass
        if not existed:
            path.unlink(missing_ok=True)
    except OSError as exc:
        return f"{flag} {path}: cannot be written ({exc.strerror or exc})"
    return None
