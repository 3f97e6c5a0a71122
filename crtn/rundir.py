"""The run folder of ``crtn-train``: one process at a time (a lock), and no silent overwrite.

- :func:`lock_run_dir` takes an exclusive ``fcntl.flock`` on ``RUN_DIR/.lock`` for the life of the
  process; a second ``crtn-train`` on the same folder refuses at once, before it writes anything,
  instead of interleaving its checkpoints and metrics with the first one's. The lock goes with the
  process (also when it is killed), so a stale ``.lock`` file never blocks a later run.
- :func:`claim_run_dir`: a folder that already holds a run (``checkpoints/last.pt``,
  ``checkpoints/best.pt``, ``metrics.jsonl`` or ``results.json``) is continued with
  ``train.resume=true`` (the default); with ``train.resume=false`` it is refused unless
  ``train.overwrite=true``, which deletes those files first.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from crtn.errors import ConfigError, UserError

#: What a previous run left in its folder, relative to it.
RUN_FILES = ("checkpoints/last.pt", "checkpoints/best.pt", "metrics.jsonl", "results.json")

_held: dict[str, IO[str]] = {}  # run folder -> the open lock file (closing it releases the lock)


class RunDirLocked(UserError):
    """Another process holds the run folder's lock."""


def lock_run_dir(run_dir: Path) -> None:
    """Take the exclusive lock of ``run_dir`` (``RUN_DIR/.lock``) until the process ends.

    Raises:
        RunDirLocked: another process holds it (the message names the folder and the pid written
            in the lock file by its holder).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    key = str(run_dir.resolve())
    if key in _held:
        return
    f = open(run_dir / ".lock", "a+")  # noqa: SIM115  (held open until the process ends)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise RunDirLocked(
            f"run folder {str(run_dir)!r} is in use by another crtn-train (pid {holder}); wait for it to "
            "finish or choose another hydra.run.dir"
        ) from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    _held[key] = f


def unlock_run_dir(run_dir: Path) -> None:
    """Release :func:`lock_run_dir`'s lock (it is released anyway when the process ends)."""
    f = _held.pop(str(run_dir.resolve()), None)
    if f is not None:
        fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        f.close()


def previous_run(run_dir: Path) -> list[Path]:
    """The files of :data:`RUN_FILES` present in ``run_dir``."""
    return [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]


def claim_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Check that a run may write into ``run_dir`` (module docstring); with ``overwrite`` and no
    ``resume``, delete the previous run's files.

    Raises:
        ConfigError: ``train.resume=false`` on a folder holding a run, without ``train.overwrite=true``.
    """
    found = previous_run(run_dir)
    if resume or not found:
        return
    if not overwrite:
        raise ConfigError(
            f"train.resume=false but {str(run_dir)!r} holds a run ({found[0].relative_to(run_dir)}); "
            "pass train.overwrite=true to start it again from scratch, or choose another hydra.run.dir"
        )
    for path in found:
        path.unlink()
