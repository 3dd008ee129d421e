"""Exceptions the engine raises for bad model folders and bad inputs.

Each subclasses the built-in exception a caller would naturally catch (ValueError for bad
data, FileNotFoundError for a missing file), so generic handlers keep working.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np


class ColibriError(Exception):
    """Base class of every Colibri engine error."""


class FormatError(ColibriError, ValueError):
    """A model file or config.json is corrupt, truncated or not in Colibri's format."""


class ShapeError(FormatError):
    """A tensor exists but its dtype or shape disagrees with config.json."""


class ModelError(ColibriError, ValueError):
    """A model folder that cannot be loaded; str(error) is one line meant for the user."""


class ModelFileNotFoundError(ColibriError, FileNotFoundError):
    """A file the model folder layout requires is missing."""


class InputError(ColibriError, ValueError):
    """A caller passed an invalid token id, sequence id or position."""


class ContextOverflowError(InputError):
    """A position lies past the context the model was loaded with (n_ctx)."""


class ModelFaultError(ColibriError, RuntimeError):
    """The loaded model can no longer compute correctly (a weight file changed under it, or
    its outputs are not finite); every later step fails the same way until it is reloaded."""


class WeightFileChangedError(ModelFaultError, OSError):
    """A mapped weight file was truncated or overwritten while the model was loaded."""


class StorageStalledError(ModelFaultError, OSError):
    """A weight file read took longer than its timeout (storage that stopped answering)."""


class TokenIdError(InputError):
    """A list of token ids is empty or holds something that is not an id of the vocabulary;
    `param` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(ids: Iterable[Any], vocab_size: int, param: str = "prompt",
                    allow_empty: bool = False) -> list[int]:
    """The one check of token ids that every entry point (HTTP prompts, /detokenize, the
    engine's admission, the tokenizer's decode) runs: each must be an integer (not a bool) in
    0..vocab_size-1, and the list must not be empty unless allow_empty. Returns the ids as ints;
    raises TokenIdError naming `param`."""
    out: list[int] = []
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TokenIdError(f"{param} holds {t!r}, which is not a token id", param)
        if not 0 <= t < vocab_size:
            raise TokenIdError(f"token id {t} is outside the vocabulary (0..{vocab_size - 1})",
                               param)
        out.append(int(t))
    if not out and not allow_empty:
        raise TokenIdError(f"{param} must not be empty", param)
    return out
