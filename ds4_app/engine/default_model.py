"""Where the model comes from when the user names none: the small model shipped in the package."""

from __future__ import annotations

import os
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_MODEL = MODELS_DIR / "ds4-default.gguf"


class NoModelError(Exception):
    """No model was named and none is shipped (one line, says what to do)."""


def resolve_model(path: str | os.PathLike | None) -> str:
    """The model file to load: ``path`` if given, else the embedded default model."""
    if path is not None:
        return os.fspath(path)
    if DEFAULT_MODEL.is_file():
        return os.fspath(DEFAULT_MODEL)
    raise NoModelError(f"no --model given and no embedded default model at {DEFAULT_MODEL}; "
                       "pass --model FILE (make one with `ds4-app model synth --preset tiny --out tiny.gguf`)")
