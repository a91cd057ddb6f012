"""Input errors a user can act on: one line on stderr (``PROG: error: ...`` naming the fix) and exit status 2, as
argparse reports a bad flag, instead of a traceback.

A check raises ``ValueError`` / ``FileNotFoundError`` naming the flag and the fix (docs/design.md principle 5). Raised
while a script is still checking its inputs (``checking()``, which ends when the first model loads:
``inputs_checked()``), such an error is the user's and becomes a ``UsageError``; raised later it is a failure of the
run and keeps its traceback. ``exit_on_usage_error`` turns a ``UsageError`` into the one line and exit status 2
(under torchrun ``distributed.fail_fast`` does, printing it once for the job).
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

USAGE_STATUS = 2  # argparse's exit status for a bad command line


class UsageError(ValueError):
    """A bad flag or input path, found before the expensive work: reported in one line, exit status 2."""


_CHECKING = [False]


def prog() -> str:
    """The script's name as argparse shows it (``train_grpo_flux.py``)."""
    return Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "fastvideo"


def usage_line(err: BaseException) -> str:
    """The one line printed for ``err``: ``PROG: error: MESSAGE``."""
    return f"{prog()}: error: {err}"


@contextmanager
def checking() -> Iterator[None]:
    """The input-checking phase of a script: a ``ValueError`` / ``FileNotFoundError`` raised before
    ``inputs_checked()`` is re-raised as a ``UsageError`` with the same message."""
    _CHECKING[0] = True
    try:
        yield
    except UsageError:
        raise
    except (ValueError, FileNotFoundError) as err:
        if not _CHECKING[0]:
            raise
        raise UsageError(str(err)) from err
    finally:
        _CHECKING[0] = False


def inputs_checked() -> None:
    """Every input check passed (the models load next): later errors keep their tracebacks."""
    _CHECKING[0] = False


@contextmanager
def exit_on_usage_error() -> Iterator[None]:
    """Print a ``UsageError`` as one line (rank 0 of a torchrun job only: every rank raises the same one) and exit
    with status 2."""
    try:
        yield
    except UsageError as err:
        if os.environ.get("RANK", "0") == "0":
            print(usage_line(err), file=sys.stderr, flush=True)
        raise SystemExit(USAGE_STATUS) from None


def parse_or_exit(parse: Callable[[Sequence[str] | None], Any], argv: Sequence[str] | None = None) -> Any:
    """``parse(argv)``, with an error in a --config file (``config.parse_with_config``'s ValueError /
    FileNotFoundError) reported as one line and exit status 2, like a bad flag."""
    with exit_on_usage_error(), checking():
        return parse(argv)
