"""Reading the small JSON files of a model folder (configs, indexes) with one set of rules.

Guarantees: a size cap before reading, UTF-8 + JSON errors and non-object documents become one
clear error naming the file (of the caller's error type), and so does nesting deep
enough to exhaust Python's recursion limit. Refuses: nothing else; whether a
missing file is an error is the caller's call.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

JSON_MAX_BYTES = 16 * 1024 * 1024


def read_json_object(
    path: Path, what: str = "JSON file", max_bytes: int = JSON_MAX_BYTES,
    error: type[ValueError] = ValueError,
) -> dict[str, Any]:
    """The JSON object in path; raises `error` if it is too large, invalid or not an object."""
    if path.stat().st_size > max_bytes:
        raise error(f"{path}: too large for a {what}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    except RecursionError:  # json's parser recurses once per nesting level
        raise error(f"{path}: not a {what} (JSON nested too deeply)") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not a JSON object")
    return data
