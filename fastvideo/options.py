"""The flag field of every component's options dataclass (``opt``) and the one-line check that refuses a bad value
(``need``): the pieces a component needs to own its flags without importing the parser (``config.py``)."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field that carries its argparse help (and choices/nargs/action) in metadata."""
    return field(default=default, metadata={"help": help, **kwargs})


def need(cond: bool, message: str) -> None:
    """ValueError(message) unless ``cond``: a flag's value refused with the fix named."""
    if not cond:
        raise ValueError(message)


_DEFAULT_NOTES: list[str] = []


def note_default(text: str) -> None:
    """Remember a value a validator filled in for an unset flag (e.g. the family's --guidance_scale), to be said once
    at start-up (``take_default_notes``), not by the launchers' flag check, which prints only errors."""
    if text not in _DEFAULT_NOTES:
        _DEFAULT_NOTES.append(text)


def take_default_notes() -> list[str]:
    """The notes of ``note_default`` since the last call (then forgotten)."""
    notes = list(_DEFAULT_NOTES)
    _DEFAULT_NOTES.clear()
    return notes
