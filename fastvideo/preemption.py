"""Preemption: SIGTERM / SIGINT (what Slurm, torchrun and Ctrl-C send, to every rank) ask the run to stop cleanly.

The first signal only sets a flag; the trainer's step ends as usual, every rank learns of the request in the step's
end-of-step collective (``Run.end_step``), a checkpoint is written and the process exits 0 with a message. A second
signal at least ``REPEAT_AFTER_S`` seconds later exits at once (status 128 + signal): checkpoints are atomic, so
that never damages the newest complete one. Signals closer together count as one (Ctrl-C in a terminal reaches
every process of the job, and torchrun forwards its own copy a moment later).
"""
from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import contextmanager
from typing import Iterator

REPEAT_AFTER_S = 2.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)

_requested: str | None = None
_first_at = 0.0


def requested() -> str | None:
    """The name of the first stop signal received (``"SIGTERM"``), or None."""
    return _requested


def _handle(signum: int, _frame) -> None:
    global _requested, _first_at
    name = signal.Signals(signum).name
    now = time.monotonic()
    if _requested is None:
        _requested, _first_at = name, now
        print(f"[pid {os.getpid()}] {name}: finishing the current step, then a checkpoint and exit (send it again "
              f"to exit at once)", file=sys.stderr, flush=True)
    elif now - _first_at >= REPEAT_AFTER_S:
        print(f"[pid {os.getpid()}] second {name}: exiting now without a checkpoint (the last complete one is "
              "intact)", file=sys.stderr, flush=True)
        os._exit(128 + signum)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within this block SIGTERM/SIGINT request a stop (``requested()``) instead of killing the process; the
    previous handlers come back on exit. Main thread only (where Python runs signal handlers)."""
    global _requested
    _requested = None
    previous = {sig: signal.signal(sig, _handle) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
