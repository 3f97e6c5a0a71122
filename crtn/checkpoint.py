"""Checkpoints: written atomically, read with clear errors.

A checkpoint is a ``torch.save`` dict::

    format      "crtn-checkpoint"
    version     1
    config      the full training config (plain dict, resolved)
    vocab       list of symbols (index -> symbol) or None
    model       model.state_dict()
    # training checkpoints only (crtn-train):
    optimizer, scheduler, step, epoch, batch_index, states (per batch chunk), rng,
    best_valid, elapsed, tokens_seen, averaged (train.avg_start: the AveragedModel's state, or
    None; best.pt's ``model`` is then the averaged weights, last.pt's the trained ones)

``crtn-convert`` writes the first five keys only (a model to evaluate, fine-tune or
sample from). Files are written to a temporary name in the same folder and renamed
into place, so a run killed mid-write never leaves a truncated checkpoint.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from crtn.config import train_config
from crtn.errors import CheckpointError

FORMAT = "crtn-checkpoint"
VERSION = 1


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (with ``format``/``version`` added) to ``path`` atomically.

    Raises:
        OSError: the folder cannot be written (the previous file, if any, is untouched).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"format": FORMAT, "version": VERSION, **payload}
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a crtn checkpoint.

    Only tensors, containers and plain values are unpickled (``weights_only=True``).

    Raises:
        CheckpointError: missing file, unreadable/corrupt file, or not a crtn checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # corrupt, truncated, or not a torch file
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({first})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(
            f"{str(path)!r} is not a crtn checkpoint (convert Transformer-XL weights with crtn-convert)"
        )
    if ckpt.get("version") != VERSION:
        raise CheckpointError(
            f"checkpoint {str(path)!r} has version {ckpt.get('version')}; expected {VERSION}"
        )
    for key in ("config", "model"):
        if key not in ckpt:
            raise CheckpointError(f"checkpoint {str(path)!r} lacks {key!r}")
    return ckpt


def checkpoint_config(ckpt: dict[str, Any]) -> Any:
    """The training config saved in ``ckpt`` as a typed OmegaConf node: ``crtn-train``'s
    schema (:class:`crtn.config.TrainAppConfig`) with the saved values merged in, so keys
    added to the schema after the checkpoint was written take their defaults.

    Raises:
        omegaconf.errors.ValidationError: a saved value does not fit the schema.
    """
    return OmegaConf.merge(train_config(), ckpt["config"])


def rng_state() -> dict[str, Any]:
    """The RNG states of python, numpy, torch (and CUDA when available)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`."""
    random.setstate(_to_python(state["python"]))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_python(x: Any) -> Any:
    """weights_only loading returns lists where tuples were saved; RNG setters need tuples."""
    if isinstance(x, list):
        return tuple(_to_python(v) for v in x)
    return x


def config_mismatch(saved: dict, current: dict, sections: tuple[str, ...]) -> str | None:
    """First key (dotted) under ``sections`` whose value differs, as ``"key: saved -> current"``."""

    def walk(a: Any, b: Any, prefix: str) -> str | None:
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                found = walk(a.get(k), b.get(k), f"{prefix}.{k}")
                if found:
                    return found
            return None
        return None if a == b else f"{prefix}: {a!r} -> {b!r}"

    for section in sections:
        found = walk(saved.get(section), current.get(section), section)
        if found:
            return found
    return None
