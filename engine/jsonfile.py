"""Reading the small JSON files of a model folder (configs, indexes) with one set of rules.

Guarantees: a size cap before reading, UTF-8 + JSON errors and non-object documents become one
clear error naming the file (of the caller's error type), and so does nesting deep
enough to exhaust Python's recursion limit. Refuses: nothing else; whether a
missing file is an error is the caller's call.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

JSON_MAX_BYTES = 16 * 1024 * 1024


def read_json_object(
    path: Path, what: str = "JSON file", max_bytes: int = JSON_MAX_BYTES,
    error: type[ValueError] = ValueError,
) -> dict[str, Any]:
    """The JSON object in path; raises `error` if it is too large, invalid or not an object."""
    raw = read_regular_file(path, what, max_bytes, error)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # json's parser recurses once per nesting level
        raise error(f"{path}: not a {what} (JSON nested too deeply)") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data


def read_regular_file(path: Path, what: str = "file", max_bytes: int = JSON_MAX_BYTES,
                      error: type[ValueError] = ValueError) -> bytes:
    """The bytes of path, which must be a regular file of at most max_bytes.

    Opened with O_NONBLOCK and checked with fstat before reading, so a FIFO or device in its
    place is refused at once instead of blocking the loader (and no stat/open race applies).
    A missing file raises FileNotFoundError as usual.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                 | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{path}: not a regular file")
        if st.st_size > max_bytes:
            raise error(f"{path}: too large for a {what}")
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise error(f"{path}: too large for a {what}")
    return data
