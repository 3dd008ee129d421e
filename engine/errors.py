"""Exceptions the engine raises for bad model folders and bad inputs.

Each subclasses the built-in exception a caller would naturally catch (ValueError for bad
data, FileNotFoundError for a missing file), so generic handlers keep working.
"""

from __future__ import annotations


class ColibriError(Exception):
    """Base class of every Colibri engine error."""


class FormatError(ColibriError, ValueError):
    """A model file or config.json is corrupt, truncated or not in Colibri's format."""


class ShapeError(FormatError):
    """A tensor exists but its dtype or shape disagrees with config.json."""


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
