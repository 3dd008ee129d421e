"""The bundled demo model: its folder, and (in engine.demo.data) its training and
validation text."""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """The bundled demo model (a Hugging Face folder shipped inside the package)."""
    return Path(__file__).resolve().parent.parent / "demo_model"
