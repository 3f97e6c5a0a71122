"""Checkpoints: written atomically, read with clear errors.

A checkpoint is a ``torch.save`` dict::

    format      "crtn-checkpoint"
    version     1
    config      the run spec (crtn.config.spec_dict of the resolved spec: every default filled)
    vocab       list of symbols (index -> symbol) or None
    model       model.state_dict()
    # training checkpoints only (crtn-train):
    optimizer, scheduler, step, epoch, batch_index, states (per batch chunk), rng,
    best_valid, elapsed, tokens_seen, averaged (train.avg_start: the AveragedModel's state, or
    None; best.pt's ``model`` is then the averaged weights, last.pt's the trained ones)

``crtn-convert`` writes the first five keys only (a model to evaluate, fine-tune or
sample from). Files are written to a temporary name in the same folder, fsynced and renamed
into place, so a run killed mid-write never leaves a truncated checkpoint; tensors are saved
as compact copies (never the whole storage a view belongs to). Files are read with
``torch.load(weights_only=True)``, which unpickles only tensors and plain containers and never
runs code named by the file.
"""

from __future__ import annotations

import logging
import pickle
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crtn.config import ResolvedRun, load_spec
from crtn.data import Corpus, load_corpus
from crtn.errors import CheckpointError
from crtn.model import build_model
from crtn.utils import atomic_write

log = logging.getLogger("crtn.checkpoint")

FORMAT = "crtn-checkpoint"
VERSION = 1


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (with ``format``/``version`` added) to ``path`` atomically
    (:func:`crtn.utils.atomic_write`: temporary file, fsync, ``os.replace``), tensors as compact
    copies (:func:`compact`).

    Raises:
        CheckpointError: the file cannot be written (full disk, read-only folder...); the previous
            file, if any, is untouched and no temporary file is left.
    """
    path = Path(path)
    payload = compact({"format": FORMAT, "version": VERSION, **payload})
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: torch.save(payload, f))
    except OSError as e:
        raise CheckpointError(
            f"cannot write checkpoint {str(path)!r} ({e.strerror or e}); the previous one is kept"
        ) from None


def compact(x: Any) -> Any:
    """``x`` (nested dicts, lists, tuples) with every tensor that is a view of a larger storage
    replaced by a copy of its own elements.

    ``torch.save`` writes a tensor's whole storage: a [1, 64] slice of a 1M-token split would
    write the split (8 MB). Tensors that own their storage are returned as they are.
    """
    if isinstance(x, torch.Tensor):
        if x.untyped_storage().nbytes() > x.numel() * x.element_size() or not x.is_contiguous():
            return x.clone(memory_format=torch.contiguous_format)
        return x
    if isinstance(x, dict):
        return {k: compact(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(compact(v) for v in x)
    return x


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
    except Exception as e:  # corrupt, truncated, not a torch file, or a pickle payload
        raise CheckpointError(unreadable(path, e)) from None
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


def _first_line(e: BaseException) -> str:
    """The first sentence of the first line of ``e``'s message."""
    text = str(e).strip()
    return text.splitlines()[0].split(". ")[0] if text else type(e).__name__


def unreadable(path: Path, e: BaseException) -> str:
    """Why ``torch.load(path, weights_only=True)`` failed with ``e``, as one line naming the file."""
    found = re.search(r"GLOBAL (\S+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
    if found:
        return (
            f"checkpoint {str(path)!r} holds pickled Python objects ({found.group(1)}), not only tensors "
            "and plain values; crtn reads checkpoints with torch.load(weights_only=True) and never runs "
            "code from a file (there is no opt-in: re-save the weights you trust as a state_dict and "
            "convert them with crtn-convert)"
        )
    try:
        with open(path, "rb") as f:
            zipped = f.read(4) == b"PK\x03\x04"
    except OSError:
        zipped = False
    if zipped:
        return f"checkpoint {str(path)!r} cannot be read: it is truncated or corrupt ({_first_line(e)})"
    if isinstance(e, pickle.UnpicklingError):
        return f"{str(path)!r} is not a torch checkpoint file (it does not unpickle as tensors)"
    return f"checkpoint {str(path)!r} cannot be read ({_first_line(e)})"


def checkpoint_spec(ckpt: dict[str, Any], overrides: dict[str, Any] | None = None) -> ResolvedRun:
    """The run spec a checkpoint was trained with (:func:`crtn.config.load_spec`: a config saved by
    an earlier version is upgraded, keys added to the schema since take their defaults), with
    ``overrides`` (nested dict, e.g. evaluation-time ``cache.*``) merged in and resolved.

    Raises:
        ConfigError: a saved value or an override that the schema or the rules refuse.
    """
    return load_spec(ckpt["config"], overrides)


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


def init_from(model: torch.nn.Module, path: str, corpus: Any) -> None:
    """Load weights from a crtn checkpoint (e.g. converted Transformer-XL); new parameters stay fresh."""
    ckpt = load_checkpoint(path)
    vocab = ckpt.get("vocab")
    if vocab is not None and list(vocab) != list(corpus.vocab.idx2sym):
        raise CheckpointError(
            f"init_from={path!r}: its vocabulary ({len(vocab)} symbols) differs from the corpus' "
            f"({len(corpus.vocab)}); train on the corpus the weights were made for"
        )
    own = model.state_dict()
    bad = [k for k, v in ckpt["model"].items() if k in own and own[k].shape != v.shape]
    if bad:
        raise CheckpointError(
            f"init_from={path!r}: tensor {bad[0]!r} has shape {tuple(ckpt['model'][bad[0]].shape)}, "
            f"the model expects {tuple(own[bad[0]].shape)}"
        )
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    if unexpected:
        raise CheckpointError(f"init_from={path!r}: unknown tensor {unexpected[0]!r} for this model")
    log.info("init_from %s: loaded %d tensors", path, len(ckpt["model"]))
    if missing:
        log.info("freshly initialised (not in %s): %s", path, ", ".join(missing))


def restore_model(ckpt: dict[str, Any], run: ResolvedRun, path: str) -> tuple[Corpus, torch.nn.Module]:
    """The corpus of ``run.data`` and the model of ``run`` with the weights of the checkpoint
    ``ckpt`` (read from ``path``: :func:`load_checkpoint`; ``run``: its :func:`checkpoint_spec`),
    in evaluation mode on the CPU: what the analysis tools run.

    Raises:
        CheckpointError: the corpus has another vocabulary than the checkpoint (:func:`check_vocab`).
    """
    corpus = load_corpus(run.data)
    check_vocab(ckpt, corpus, path)
    model = build_model(run, len(corpus.vocab))
    model.load_state_dict(ckpt["model"])
    return corpus, model.eval()


def check_vocab(ckpt: dict[str, Any], corpus: Any, path: str) -> None:
    """Refuse a corpus whose vocabulary differs from the checkpoint's (ids would mean other symbols).

    Raises:
        CheckpointError: names the checkpoint and the corpus folder or file.
    """
    saved = ckpt.get("vocab")
    if saved is None or list(saved) == list(corpus.vocab.idx2sym):
        return
    files = corpus.info.get("files") or []
    where = repr(str(Path(files[0]).parent)) if files else f"data.name={corpus.name}"
    raise CheckpointError(
        f"checkpoint {str(path)!r} was trained with another vocabulary ({len(saved)} symbols) than the "
        f"corpus of {where} ({len(corpus.vocab)}); point data.root/data.dir/data.path "
        "at the corpus it was trained on"
    )
