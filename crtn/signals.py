"""How a run stops on a signal: SIGINT or SIGTERM sets a flag that the training loop (and a
validation in progress) checks at its next step, so the run saves ``last.pt`` and exits with
status 130 instead of dying mid-step (docs/reliability.md, "Signals")."""

from __future__ import annotations

import signal
from contextlib import ExitStack


class Stop:
    """Set by SIGINT/SIGTERM: the loop stops at the next step boundary and checkpoints."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        if self.signal is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        self.signal = signum


def catch_signals(stop: Stop, stack: ExitStack) -> None:
    """Route SIGINT/SIGTERM to ``stop`` until ``stack`` closes (main thread only)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old = signal.signal(sig, stop)
        except ValueError:  # not in the main thread (some launchers)
            return
        stack.callback(signal.signal, sig, old)
