"""``crtn-eval``: evaluate a checkpoint (a Hydra app, config ``conf/eval.yaml``).

``crtn-eval checkpoint=PATH`` evaluates a checkpoint with eval-time lengths and cache
overrides (``eval.tgt_len``, ``eval.mem_len``, ``eval.n_slot``, ``cache.backend=faiss``...): they
make the run spec of the evaluation (:func:`crtn.app.load_with_overrides`), and the model is built
for it; the metrics are :func:`crtn.evaluate.evaluate`'s, written to ``eval.json``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig

from crtn.app import load_with_overrides, resolve_device, run_app
from crtn.checkpoint import check_vocab
from crtn.data import load_corpus
from crtn.errors import UserError
from crtn.evaluate import evaluate, format_metrics
from crtn.model import build_model
from crtn.utils import atomic_write_text

log = logging.getLogger(__name__)


def _jsonable(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not isinstance(v, torch.Tensor)}


def run_eval(cfg: Any) -> dict[str, Any]:
    """``crtn-eval``: evaluate ``cfg.checkpoint`` on ``cfg.splits``; writes ``eval.json``."""
    ckpt, run = load_with_overrides(cfg)
    device = resolve_device(cfg.device)
    corpus = load_corpus(run.data)
    check_vocab(ckpt, corpus, cfg.checkpoint)
    model = build_model(run.eval_spec, len(corpus.vocab)).to(device)
    model.load_state_dict(ckpt["model"])
    results: dict[str, Any] = {"checkpoint": str(cfg.checkpoint), "step": ckpt.get("step")}
    for split in cfg.splits:
        if split not in corpus.splits:
            raise UserError(f"splits: {split!r} is not one of {', '.join(corpus.splits)}")
        m = evaluate(
            model,
            corpus,
            split,
            batch_size=run.eval.batch_size,
            device=device,
            max_step=run.eval.max_step,
            progress=cfg.progress,
        )
        print(format_metrics(m), flush=True)
        results[split] = _jsonable(m)
    out = Path(HydraConfig.get().runtime.output_dir) / "eval.json"
    atomic_write_text(out, json.dumps(results, indent=2))
    log.info("wrote %s", out)
    return results


def main() -> None:
    """Console entry point of ``crtn-eval`` (a Hydra app, config ``conf/eval.yaml``)."""
    run_app("crtn-eval", "eval", run_eval, record_status=True)


if __name__ == "__main__":
    main()
