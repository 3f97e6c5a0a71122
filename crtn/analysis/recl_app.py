"""``crtn-recl``: the relative effective context length of a group of checkpoints (Dai et al. 2019,
section 4.3 and appendix, or the CRTN authors' variant; the definitions are in
:mod:`crtn.analysis.recl`; docs/method.md §5).

    crtn-recl 'checkpoints=[txl/best.pt,crtn/best.pt]' 'names=[txl,crtn]' delta=64 c_max=640 \\
        split=test 'ratios=[0.1,1.0]' max_tokens=10000 [definition=crtn_authors] [threshold=T]

``definition`` picks the gain, the threshold (unless ``threshold`` is given), the hardest-token
count and the base (:mod:`crtn.analysis.recl`).

Context length c of each model (:func:`context_lengths`):

- a model with memory and no cache (``txl``, ``txl_long``): the evaluation memory ``mem_len = c``;
- a model with a cache (``crtn``): its dependency range ``c = m + N·L`` with its trained memory m
  and segment length L, realised by the evaluation cache size ``n_slot = N = (c - m) / L``; so
  c moves in steps of L, and ``delta`` must be a multiple of every cached model's L (and c0 of
  the form m + N·L);
- a model without memory (``vanilla``): its context is its segment and does not depend on c; it
  is evaluated once, at its trained lengths, and takes part in the group's base at every c (its
  gains are 0).

With ``same_length=true`` (the default) every query attends exactly ``mem_len`` positions of
memory and segment, itself included (Transformer-XL's ``same_length``): the prediction of a
scored target ``x_p`` of a model without a cache reads exactly the c inputs ``x_{p-c} ..
x_{p-1}`` in every layer, the attention length with which the Transformer-XL paper measures
RECL; a cached model reads m of them plus the top_k segments it retrieves among its N cached
ones. With ``false`` the query at position j of its segment (0-based) reads ``c + j + 1``
inputs. It is applied to the models with memory only (without memory it would hide every key).

Scored tokens, the same for every model and context: ``batch_size`` streams (Transformer-XL
batching, :class:`crtn.data.StreamIterator`), and in each the target columns ``[w, w + T)`` with
``T = max_tokens // batch_size`` and the warm-up ``w = c_max + max L``: every scored token lies
after ``c_max`` tokens of its stream plus a segment, so that its memory and cache are full at
every context. Each model is evaluated once per context (:func:`per_token_nll`); the losses are
reused for every ratio and every model's scan.

Writes into its Hydra run folder (``outputs/recl/DATE/TIME``): ``recl.json`` (settings, the mean
loss of each model at each context, per ratio each model's gains and RECL), ``recl.md`` (the
RECL table model x r and the gain curves as tables) and ``recl_gain.png``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig

from crtn.analysis.recl import (
    DEFINITIONS,
    THRESHOLDS,
    plot_gains,
    recl_markdown,
    recl_of,
    recl_text,
    relative_gains,
)
from crtn.app import given_keys, resolve_device, run_app
from crtn.checkpoint import check_vocab, checkpoint_spec, load_checkpoint
from crtn.config import EvalSpec
from crtn.data import load_corpus
from crtn.errors import ConfigError, DataError, check_choice
from crtn.evaluate import evaluate
from crtn.model import TransformerLM, build_model, evaluation_spec, with_spec
from crtn.utils import atomic_write_text

log = logging.getLogger(__name__)


@dataclass
class Member:
    """One model of the group: its name in the outputs, its checkpoint, the loaded model."""

    name: str
    checkpoint: str
    model: TransformerLM

    @property
    def context(self) -> str:
        """What realises its context c: ``mem_len``, ``n_slot`` (a cache) or ``fixed`` (no memory)."""
        if not self.model.has_memory:
            return "fixed"
        return "n_slot" if self.model.has_cache else "mem_len"


def context_lengths(model: TransformerLM, context: int, same_length: bool = True) -> EvalSpec:
    """The evaluation-time lengths that give ``model`` the context length ``context`` (tokens):
    ``mem_len = c`` without a cache, ``n_slot = (c - m) / L`` with one, nothing without memory
    (module docstring); ``same_length`` for models with memory.

    Raises:
        ConfigError: a cached model and a c that is not ``m + N·L`` with N >= 0.
    """
    if not model.has_memory:
        return EvalSpec()
    if model.has_cache:
        n_slot, rest = divmod(context - model.mem_len, model.tgt_len)
        if n_slot < 0 or rest:
            raise ConfigError(
                f"context {context} is not m + N*L (m={model.mem_len}, L={model.tgt_len}, N >= 0) for "
                f"model={model.name}"
            )
        return EvalSpec(n_slot=n_slot, same_length=same_length)
    return EvalSpec(mem_len=context, same_length=same_length)


def per_token_nll(
    model: TransformerLM,
    corpus: Any,
    split: str,
    context: int,
    columns: tuple[int, int],
    batch_size: int,
    device: torch.device | str,
    same_length: bool = True,
) -> torch.Tensor:
    """Per-token NLL of ``model`` at context length ``context`` on target columns
    ``[start, stop)`` of every stream of ``split`` (``batch_size`` streams).

    The one place that turns "checkpoint X at context c" into losses: a model over the same
    parameters built for the settings of :func:`context_lengths` (:func:`crtn.model.with_spec`),
    then :func:`crtn.evaluate.evaluate` over the first
    ``ceil(stop / L)`` segments (memory and cache from each stream's start).

    Returns:
        float32 [batch_size, stop - start] (CPU), NLL in nats; column j is the target at stream
        position ``start + j + 1``.

    Raises:
        ConfigError: see :func:`context_lengths`. DataError: the streams are shorter than ``stop``.
    """
    start, stop = columns
    at_context = with_spec(model, evaluation_spec(model.spec, context_lengths(model, context, same_length)))
    n_seg = -(-stop // at_context.tgt_len)
    m = evaluate(
        at_context, corpus, split, batch_size=batch_size, device=device, max_step=n_seg, per_token=True
    )
    nll = m["nll_tokens"]
    if nll.shape[1] < stop:
        raise DataError(f"split {split!r} has {nll.shape[1]} target columns per stream, fewer than {stop}")
    return nll[:, start:stop]


def load_group(cfg: Any, device: torch.device) -> tuple[Any, list[Member], int]:
    """The corpus (of the first checkpoint, with ``data.*`` overrides), the group's models, and the
    number of streams: ``batch_size``, else the first checkpoint's ``data.eval_batch_size``.

    Raises:
        CheckpointError: a missing or unreadable checkpoint, or another vocabulary (names the file).
        ConfigError: ``checkpoints`` empty, ``names`` of another length or repeated.
    """
    paths = [str(p) for p in cfg.checkpoints]
    if not paths:
        raise ConfigError("checkpoints is empty: give checkpoints=[A.pt,B.pt,...]")
    if cfg.names is not None and len(cfg.names) != len(paths):
        raise ConfigError(f"names has {len(cfg.names)} entries for {len(paths)} checkpoints")
    loaded = []
    overrides = {"cache": given_keys(cfg, "cache"), "data": given_keys(cfg, "data")}
    for path in paths:
        ckpt = load_checkpoint(path)
        loaded.append((path, ckpt, checkpoint_spec(ckpt, overrides)))
    corpus = load_corpus(loaded[0][2].data)
    names = list(cfg.names) if cfg.names is not None else _default_names([t.model.name for _, _, t in loaded])
    if len(set(names)) != len(names):
        raise ConfigError(f"names: {next(n for n in names if names.count(n) > 1)!r} is given twice")
    members = []
    for name, (path, ckpt, train_cfg) in zip(names, loaded):
        check_vocab(ckpt, corpus, path)
        model = build_model(train_cfg, len(corpus.vocab)).to(device)
        model.load_state_dict(ckpt["model"])
        members.append(Member(str(name), path, model.eval()))
    return corpus, members, cfg.batch_size or loaded[0][2].data.eval_batch_size


def _default_names(models: list[str]) -> list[str]:
    """Model names, with ``#i`` (1-based position) where a name repeats."""
    return [m if models.count(m) == 1 else f"{m}#{i + 1}" for i, m in enumerate(models)]


def check_contexts(cfg: Any, members: list[Member]) -> list[int]:
    """The contexts ``c0, c0 + delta, ..., c_max``, after checking ``delta``, ``c0`` and ``c_max``
    against every model (module docstring).

    Raises:
        ConfigError: one line naming the value at fault and the checkpoint it does not fit.
    """
    delta = cfg.delta
    if delta <= 0:
        raise ConfigError(f"delta={delta} must be > 0")
    cached = [m for m in members if m.context == "n_slot"]
    for m in cached:
        if delta % m.model.tgt_len:
            raise ConfigError(
                f"delta={delta} is not a multiple of tgt_len={m.model.tgt_len} of checkpoint {m.checkpoint!r} "
                f"(model={m.model.name}: its context m + N*L moves in steps of L)"
            )
    c0 = cfg.c0
    if c0 is None:
        least = max([m.model.mem_len for m in cached] + [1])
        c0 = -(-least // delta) * delta
    if c0 <= 0:
        raise ConfigError(f"c0={c0} must be > 0")
    for m in cached:
        if c0 < m.model.mem_len or (c0 - m.model.mem_len) % m.model.tgt_len:
            raise ConfigError(
                f"c0={c0} is not m + N*L (N >= 0) for checkpoint {m.checkpoint!r} "
                f"(m={m.model.mem_len}, L={m.model.tgt_len})"
            )
    if cfg.c_max <= c0 or (cfg.c_max - c0) % delta:
        raise ConfigError(f"c_max={cfg.c_max} must be c0 + k*delta with k >= 1 (c0={c0}, delta={delta})")
    return list(range(c0, cfg.c_max + 1, delta))


def scored_columns(cfg: Any, corpus: Any, members: list[Member], batch_size: int) -> tuple[int, int]:
    """Target columns ``[w, w + T)`` scored in every stream (module docstring).

    Raises:
        ConfigError: bad ``max_tokens``, ``ratios``, ``batch_size`` or ``split``.
        DataError: the split's streams are too short for the warm-up and the scored tokens.
    """
    if cfg.split not in corpus.splits:
        raise ConfigError(f"split={cfg.split!r} is not one of {', '.join(corpus.splits)}")
    for r in cfg.ratios:
        if not 0 < r <= 1:
            raise ConfigError(f"ratios: {r} must be in (0, 1]")
    if not cfg.ratios:
        raise ConfigError("ratios is empty: give e.g. ratios=[0.1,1.0]")
    if batch_size <= 0:
        raise ConfigError(f"batch_size={batch_size} must be > 0")
    per_stream = cfg.max_tokens // batch_size
    if per_stream <= 0:
        raise ConfigError(
            f"max_tokens={cfg.max_tokens} gives no token per stream with batch_size={batch_size}"
        )
    warmup = cfg.c_max + max(m.model.tgt_len for m in members)
    n_cols = len(corpus.splits[cfg.split]) // batch_size - 1
    if warmup + per_stream > n_cols:
        raise DataError(
            f"split {cfg.split!r} of {corpus.name} has {n_cols:,} target tokens per stream with "
            f"batch_size={batch_size}; RECL needs c_max + tgt_len = {warmup:,} before the "
            f"max_tokens/batch_size = {per_stream:,} scored ones: lower max_tokens, c_max or batch_size"
        )
    return warmup, warmup + per_stream


def loss_grid(
    members: list[Member],
    corpus: Any,
    cfg: Any,
    contexts: list[int],
    columns: tuple[int, int],
    batch_size: int,
) -> torch.Tensor:
    """float32 [M, C, tokens]: each model's per-token NLL at each context, computed once each
    (once in all for a model of fixed context)."""
    device = resolve_device(cfg.device)
    grid = []
    for m in members:
        row: list[torch.Tensor] = []
        for c in contexts:
            if m.context == "fixed" and row:
                row.append(row[0])
                continue
            t0 = time.perf_counter()
            nll = per_token_nll(
                m.model,
                corpus,
                cfg.split,
                context=c,
                columns=columns,
                batch_size=batch_size,
                device=device,
                same_length=cfg.same_length,
            ).reshape(-1)
            row.append(nll)
            log.info(
                "%s at c=%d: loss %.4f (%.1fs)", m.name, c, nll.double().mean(), time.perf_counter() - t0
            )
        grid.append(torch.stack(row))
    return torch.stack(grid)


def recl_result(cfg: Any, members: list[Member], losses: torch.Tensor, contexts: list[int]) -> dict[str, Any]:
    """The ``recl.json`` dict (module docstring) from the loss grid [M, C, T], under
    ``cfg.definition`` and its threshold (:func:`threshold_of`)."""
    threshold = threshold_of(cfg)
    result: dict[str, Any] = {
        "contexts": contexts,
        "delta": cfg.delta,
        "definition": cfg.definition,
        "threshold": threshold,
        "same_length": cfg.same_length,
        "models": [
            {
                "name": m.name,
                "checkpoint": m.checkpoint,
                "model": m.model.name,
                "context": m.context,
                "tgt_len": m.model.tgt_len,
                "mem_len": m.model.mem_len,
                "n_slot": m.model.n_slot if m.context == "n_slot" else None,
                "loss": losses[i].double().mean(-1).tolist(),
            }
            for i, m in enumerate(members)
        ],
        "recl": {},
    }
    for r in cfg.ratios:
        gains = relative_gains(losses, float(r), cfg.definition)
        per_model = {}
        for m, g in zip(members, gains.tolist()):
            recl, status = recl_of(g, contexts, threshold)
            per_model[m.name] = {"recl": recl, "status": status, "gains": g}
        result["recl"][str(r)] = per_model
    return result


def threshold_of(cfg: Any) -> float:
    """``threshold``, else the threshold of ``definition`` (:data:`crtn.analysis.recl.THRESHOLDS`).

    Raises:
        ConfigError: ``definition`` is not one of :data:`crtn.analysis.recl.DEFINITIONS`.
    """
    check_choice("definition", cfg.definition, DEFINITIONS)
    return THRESHOLDS[cfg.definition] if cfg.threshold is None else float(cfg.threshold)


def run_recl(cfg: Any) -> dict[str, Any]:
    """``crtn-recl``: load the group, check the settings, compute the loss grid, write the outputs."""
    threshold_of(cfg)  # a bad definition fails before any checkpoint is read
    device = resolve_device(cfg.device)
    corpus, members, batch_size = load_group(cfg, device)
    contexts = check_contexts(cfg, members)
    columns = scored_columns(cfg, corpus, members, batch_size)
    losses = loss_grid(members, corpus, cfg, contexts=contexts, columns=columns, batch_size=batch_size)
    result = {
        "corpus": corpus.name,
        "split": cfg.split,
        "batch_size": batch_size,
        "tokens": losses.shape[-1],
        "columns": list(columns),
        **recl_result(cfg, members, losses, contexts),
    }
    out = Path(HydraConfig.get().runtime.output_dir)
    atomic_write_text(out / "recl.json", json.dumps(result, indent=2))
    atomic_write_text(out / "recl.md", recl_markdown(result))
    plot_gains(result, out / "recl_gain.png")
    for r, per_model in result["recl"].items():
        line = ", ".join(f"{n} {recl_text(e)}" for n, e in per_model.items())
        print(f"RECL ({cfg.definition}) r={r}: {line}", flush=True)
    log.info("wrote %s", out / "recl.json")
    return result


def main() -> None:
    """Console entry point of ``crtn-recl`` (a Hydra app, config ``conf/recl.yaml``)."""
    run_app("crtn-recl", "recl", run_recl)


if __name__ == "__main__":
    main()
