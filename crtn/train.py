"""``crtn-train``: train vanilla / Transformer-XL / CRTN language models (a Hydra app).

    crtn-train                                   # crtn on the synthetic passage-recall task
    crtn-train model=txl data=ptb data.root=...  # any model x corpus; see conf/
    crtn-train -m query=last_l,token             # Hydra multirun sweep

Everything a run produces goes into its Hydra run directory: ``.hydra/`` (the composed
config), ``train.log``, ``metrics.jsonl`` (one JSON record per log or evaluation event),
``checkpoints/last.pt`` and ``checkpoints/best.pt``, and ``results.json``.

Checkpoints hold the model, optimizer, scheduler, step, data position, the memory and
cache of every training stream, RNG states and the config, so a run that is killed
continues exactly where its last checkpoint left it (``crtn-train ... hydra.run.dir=DIR``
on the same directory; bit-identical losses on CPU). A resume refuses a changed config
(``train.allow_change=true`` lets ``train.max_step`` and the like change); ``train.resume=false``
on a folder holding a run refuses unless ``train.overwrite=true``; a second ``crtn-train`` on a
folder in use refuses (a lock, :mod:`crtn.rundir`). A non-finite loss stops the run
before anything is saved, so the last good checkpoint stays.

Training follows the Transformer-XL recipes (docs/method.md §5): Adam, linear warm-up then
cosine / inverse-sqrt / constant, gradient clipping, gradient accumulation over batch
chunks (``train.batch_chunk``; each chunk keeps its own streams' memory and cache).
The loop's parts are the methods of :class:`crtn.trainer.Trainer`; this module sets a run
up, runs it and writes its results.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from crtn.app import mark_run_started, resolve_device, run_app
from crtn.config import resolve, uses_cache
from crtn.distributed import DistributedContext
from crtn.errors import ConfigError
from crtn.evaluate import format_metrics
from crtn.rundir import claim_run_dir
from crtn.trainer import Trainer
from crtn.utils import atomic_write_text

__all__ = ["main", "run_training", "train_in"]

log = logging.getLogger("crtn.train")


def _set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def run_training(cfg: Any) -> dict[str, Any]:
    """Train a model as configured in the Hydra run directory; returns ``results.json``'s contents.

    Raises:
        UserError: bad config, data or checkpoint (printed as one line by the CLI).
        TrainingDiverged: a non-finite training loss.
    """
    hc = HydraConfig.get()
    if hc.mode != RunMode.MULTIRUN:  # a sweep may pair model=txl with cache settings on purpose
        check_unused_overrides(cfg, list(hc.overrides.task))
    return train_in(cfg, Path(hc.runtime.output_dir))


def check_unused_overrides(cfg: Any, overrides: list[str]) -> None:
    """Refuse ``cache.*``, ``query`` or ``summary`` settings given on the command line of a single run
    whose model keeps no cache (``model=txl cache.n_slot=4``): they would be ignored silently.

    Raises:
        ConfigError: names the first such override and the model.
    """
    if uses_cache(cfg.model):
        return
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key.split(".")[0] in ("cache", "query", "summary"):
            raise ConfigError(
                f"{item} has no effect: model={cfg.model.name} keeps no cache (use model=crtn, or drop it)"
            )


def train_in(cfg: Any, run_dir: Path) -> dict[str, Any]:
    """Train a model as configured (a composed config or a run spec, resolved first:
    :func:`crtn.config.resolve`), writing into ``run_dir`` (:func:`run_training` without Hydra).

    Raises:
        UserError: bad config, data or checkpoint; ``train.resume=false`` on a folder holding a run
            without ``train.overwrite=true`` (:func:`crtn.rundir.claim_run_dir`).
        TrainingDiverged: a non-finite training loss.
        SystemExit: 130 after SIGINT/SIGTERM (``last.pt`` saved).
    """
    cfg = resolve(cfg)
    dist = DistributedContext.from_env(cfg.train.device)
    if not dist.is_main:  # rank 0 logs, evaluates and writes; the others only train
        logging.getLogger().setLevel(logging.WARNING)
    if dist.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        claim_run_dir(run_dir, resume=cfg.train.resume, overwrite=cfg.train.overwrite)
    device = dist.device if dist.enabled else resolve_device(cfg.train.device)
    _set_seed(cfg.seed)
    trainer = Trainer(cfg, dist=dist, device=device, run_dir=run_dir)
    trainer.start()
    mark_run_started()
    stopped_by = trainer.fit()
    trainer.save_last()
    if stopped_by and stopped_by.startswith("signal"):
        log.warning(
            "stopped by %s at step %d; checkpoint saved to %s", stopped_by, trainer.step, trainer.last
        )
        print(
            f"crtn-train: stopped by {stopped_by} at step {trainer.step}; resume with hydra.run.dir={run_dir}",
            file=sys.stderr,
        )
        sys.exit(130)
    if stopped_by:
        log.info("stopped at step %d by %s", trainer.step, stopped_by)
    if not dist.is_main:  # rank 0 evaluates and reports
        dist.close()
        return {}
    final = trainer.final_evaluation()
    results = _results(cfg, trainer, final, stopped_by)
    atomic_write_text(run_dir / "results.json", json.dumps(results, indent=2))
    print(f"final {format_metrics(final['valid'])}", flush=True)
    print(f"final {format_metrics(final['test'])}", flush=True)
    print(
        f"params {trainer.n_params:,} | {trainer.step} steps | {results['tokens_per_s']:,.0f} tok/s | "
        f"{results['train_time_s']:.0f}s | results in {run_dir}",
        flush=True,
    )
    trainer.close()
    dist.close()
    return results


def _results(cfg: Any, trainer: Trainer, final: dict[str, Any], stopped_by: str | None) -> dict[str, Any]:
    """``results.json``: what was trained, how long, and the final metrics of the best weights."""
    p = trainer.progress
    cached = uses_cache(cfg.model)
    train_time = p.elapsed  # training and the validations during it
    return {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "metric": trainer.mname,
        "query": cfg.query.strategy if cached else None,
        "summary": cfg.summary.name if cached else None,
        "n_slot": cfg.cache.n_slot if cached else None,
        "top_k": cfg.cache.top_k if cached else None,
        "tgt_len": cfg.model.tgt_len,
        "mem_len": cfg.model.mem_len,
        "params": trainer.n_params,
        "steps": p.step,
        "epochs": p.epoch,
        "tokens_seen": p.tokens_seen,
        "train_time_s": train_time,
        "tokens_per_s": p.tokens_seen / train_time if train_time > 0 else None,
        "stopped_by": stopped_by or "train.max_step",
        "valid": {k: v for k, v in final["valid"].items() if not isinstance(v, torch.Tensor)},
        "test": {k: v for k, v in final["test"].items() if not isinstance(v, torch.Tensor)},
    }


def main() -> None:
    """Console entry point of ``crtn-train`` (config ``conf/train.yaml``)."""
    run_app("crtn-train", "train", run_training, record_status=True, lock=True)


if __name__ == "__main__":
    main()
