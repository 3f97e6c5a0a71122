"""Evaluation: perplexity / bits per character on a split, and ``crtn-eval``.

``evaluate`` runs the model over a whole split in order (Transformer-XL batching,
memory and cache carried across segments and reset at the start, docs/method.md §4-5) and
returns JSON-ready metrics:

- ``loss``: mean NLL in nats per target token; ``ppl = exp(loss)`` for word-level
  corpora, ``bpc = loss / ln 2`` for character-level ones;
- what :mod:`crtn.measures` measures besides: repeat and fresh tokens of the passage-recall
  corpus, the answers of MQAR, perplexity by word frequency, loss by the distance to the previous
  occurrence of the target (``distance_buckets``, :mod:`crtn.analysis.distance`), and for crtn
  ``retrieval`` (the histogram of selected-segment distances and the weights alpha).

``crtn-eval checkpoint=PATH`` evaluates a checkpoint with eval-time lengths and cache
overrides (``eval.tgt_len``, ``eval.mem_len``, ``eval.n_slot``, ``cache.backend=faiss``...): they
make the run spec of the evaluation (:func:`load_with_overrides`), and the model is built for it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tqdm import tqdm

from crtn.app import given_keys, resolve_device, run_app
from crtn.checkpoint import checkpoint_spec, load_checkpoint
from crtn.config import ResolvedRun, metric_name
from crtn.data import load_corpus
from crtn.errors import CheckpointError, UserError
from crtn.measures import Measures, format_answers
from crtn.model import TransformerLM, build_model
from crtn.utils import atomic_write_text

log = logging.getLogger(__name__)


def metric_value(loss: float, level: str) -> float:
    """exp(loss) (perplexity) or loss / ln 2 (bits per character), as :func:`crtn.config.metric_name`
    chooses for ``level``; loss in nats per token."""
    if metric_name(level) == "bpc":
        return loss / math.log(2)
    return math.exp(min(loss, 700.0))


class EvaluationStopped(Exception):
    """An evaluation abandoned because its ``stop`` callback asked for it."""


@torch.no_grad()
def evaluate(
    model: TransformerLM,
    corpus: Any,
    split: str,
    batch_size: int,
    device: torch.device | str,
    max_step: int | None = None,
    progress: bool = False,
    per_token: bool = False,
    stop: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Evaluate ``model`` on a split of ``corpus`` with the model's own lengths and cache (a model
    built for evaluation-time settings: :attr:`crtn.config.ResolvedRun.eval_spec`, :func:`crtn.model.with_spec`).

    Args:
        model: the language model (its ``tgt_len``, ``mem_len``, ``n_slot``... apply).
        corpus: a :class:`crtn.data.Corpus`.
        split: ``train``, ``valid`` or ``test``.
        batch_size: number of streams.
        max_step: evaluate only the first ``max_step`` segments (None: all).
        per_token: also return ``nll_tokens`` / ``target_tokens`` (CPU tensors, stream order
            per row) for analyses such as frequency buckets.
        stop: asked before each segment; True abandons it (raises EvaluationStopped).

    Returns:
        metrics dict (see module docstring); the model is left in eval mode.

    Raises:
        DataError: the split is too short for one segment with ``batch_size`` streams.
        EvaluationStopped: ``stop`` returned True.
    """
    model.eval()
    it = corpus.iterator(split, batch_size, model.tgt_len, drop_last=False)
    n_seg = len(it) if max_step is None else min(max_step, len(it))
    state = model.init_state(it.local_batch_size, device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    measures = Measures(corpus, split, it, device=device, per_token=per_token, retrieves=model.has_cache)
    t_start = time.perf_counter()
    bar = tqdm(total=n_seg, desc=f"eval {split}", disable=not progress, leave=False, dynamic_ncols=True)
    for batch in it.iterate(0):
        if batch.index >= n_seg:
            break
        if stop is not None and stop():  # (training's validations show no bar to close)
            raise EvaluationStopped(f"evaluation of {split!r} stopped at segment {batch.index}")
        batch = batch.to(device)
        out = model(batch.input, batch.target, state)
        state = out.state
        total += out.nll.sum(dtype=torch.float64)
        count += out.nll.numel()
        measures.add(model, batch, out, state)
        bar.update(1)
    bar.close()
    elapsed = time.perf_counter() - t_start
    loss = (total / max(count, 1)).item()
    level = corpus.level
    result: dict[str, Any] = {"split": split, "loss": loss, metric_name(level): metric_value(loss, level)}
    result.update(
        tokens=count, segments=n_seg, time_s=elapsed, tokens_per_s=count / elapsed if elapsed > 0 else None
    )
    result.update(tgt_len=model.tgt_len, mem_len=model.mem_len)
    if model.has_cache:
        result.update(n_slot=model.n_slot, top_k=model.top_k)
    result.update(measures.metrics(model, count))
    return result


def format_metrics(m: dict[str, Any]) -> str:
    """One line: ``test: ppl 123.45 (loss 4.816) | repeat ppl 1.10 acc 0.97 | fresh ppl ...``."""
    key = "bpc" if "bpc" in m else "ppl"
    fmt = "{:.4f}" if key == "bpc" else "{:.2f}"
    parts = [f"{m['split']}: {key} {fmt.format(m[key])} (loss {m['loss']:.4f}, {m['tokens']:,} tokens)"]
    for k in ("repeat", "fresh"):
        e = m.get(k)
        if e and "ppl" in e:
            src = f", source ppl {e['source_ppl']:.2f}" if "source_ppl" in e else ""
            hit = f", retrieved {e['source_retrieved']:.2f}" if "source_retrieved" in e else ""
            if "copy_retrieved" in e:
                hit += f" (or a copy {e['copy_retrieved']:.2f})"
            parts.append(f"{k} ppl {e['ppl']:.2f} acc {e['acc']:.3f}{src}{hit}")
    parts += format_answers(m)  # data=mqar
    return " | ".join(parts)


def _jsonable(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not isinstance(v, torch.Tensor)}


def load_with_overrides(cfg: Any) -> tuple[dict[str, Any], ResolvedRun]:
    """Read ``cfg.checkpoint`` and make the run spec of its evaluation: the checkpoint's, with the
    ``cache.*`` and ``data.*`` keys given on the command line and the app's ``eval.*`` settings
    (:func:`crtn.checkpoint.checkpoint_spec`; the evaluation model is built from
    :attr:`crtn.config.ResolvedRun.eval_spec`). Used by crtn-eval and crtn-generate.

    Raises:
        CheckpointError: unreadable checkpoint. ConfigError: a setting the rules refuse.
    """
    ckpt = load_checkpoint(cfg.checkpoint)
    overrides = {
        "cache": given_keys(cfg, "cache"),
        "data": given_keys(cfg, "data"),
        "eval": OmegaConf.to_container(cfg.eval),
    }
    return ckpt, checkpoint_spec(ckpt, overrides)


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
