"""Evaluation: perplexity / bits per character on a split (the library of ``crtn-train``'s
validations, ``crtn-eval``: :mod:`crtn.eval_app`, and ``crtn-recl``).

``evaluate`` runs the model over a whole split in order (Transformer-XL batching,
memory and cache carried across segments and reset at the start, docs/method.md §4-5) and
returns JSON-ready metrics:

- ``loss``: mean NLL in nats per target token; ``ppl = exp(loss)`` for word-level
  corpora, ``bpc = loss / ln 2`` for character-level ones;
- what :mod:`crtn.measures` measures besides: the corpus' own metrics (its task,
  :class:`crtn.data.task.Task`: repeat and fresh tokens of the passage-recall corpus, the answers
  of MQAR), perplexity by word frequency, loss by the distance to the previous
  occurrence of the target (``distance_buckets``, :mod:`crtn.analysis.distance`), and for crtn
  ``retrieval`` (the histogram of selected-segment distances and the weights alpha).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from crtn.data.spec import metric_name
from crtn.data.task import Task
from crtn.measures import Measures
from crtn.model import TransformerLM


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
    parts += Task.format_all(m)  # the corpus' own metrics (crtn.data.task)
    return " | ".join(parts)
