"""Evaluation: perplexity / bits per character on a split, recall metrics, and ``crtn-eval``.

``evaluate`` runs the model over a whole split in order (Transformer-XL batching,
memory and cache carried across segments and reset at the start, SPEC §4-5) and
returns JSON-ready metrics:

- ``loss``: mean NLL in nats per target token; ``ppl = exp(loss)`` for word-level
  corpora, ``bpc = loss / ln 2`` for character-level ones.
- synthetic passage-recall corpus (SPEC §4): the same on ``repeat`` tokens (tokens of a
  copied passage after its first ``repeat_skip``) and ``fresh`` tokens, with next-token
  accuracy, and the Markov source's own NLL on those tokens for comparison.
- crtn: ``retrieval``, the histogram of selected-segment distances and mean distance.
- ``distance_buckets``: loss by distance to the previous occurrence of the target in its
  stream, symbol and longest n-gram (:mod:`crtn.analysis.distance`).

``crtn-eval checkpoint=PATH`` evaluates a checkpoint with eval-time lengths and cache
overrides (``eval.tgt_len``, ``eval.mem_len``, ``eval.n_slot``, ``cache.backend=faiss``...).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from tqdm import tqdm

from crtn.analysis.distance import DistanceBuckets
from crtn.app import resolve_device, run_app
from crtn.checkpoint import checkpoint_config, load_checkpoint
from crtn.config import metric_name, uses_cache, validate_eval
from crtn.data import load_corpus
from crtn.data.synthetic import copy_roots
from crtn.errors import CheckpointError, UserError
from crtn.model import RetrievalStats, TransformerLM, build_model
from crtn.utils import atomic_write_text

log = logging.getLogger(__name__)

EVAL_LENGTHS = ("tgt_len", "mem_len", "clamp_len", "same_length", "n_slot", "top_k")
# Word-frequency buckets of the CRTN paper's analysis (SPEC §5): occurrences in the training split.
FREQ_EDGES = [100, 1000, 10000]
FREQ_LABELS = ["<100", "100-1K", "1K-10K", ">10K"]


@contextmanager
def eval_lengths(model: TransformerLM, ev: Any) -> Iterator[None]:
    """Apply the non-null eval-time lengths of ``ev`` (an EvalConfig node) for the block."""
    saved = {
        "tgt_len": model.tgt_len,
        "mem_len": model.mem_len,
        "clamp_len": model.clamp_len,
        "same_length": model.same_length,
        "n_slot": model.n_slot,
        "top_k": model.top_k,
    }
    new = {k: getattr(ev, k) for k in EVAL_LENGTHS if getattr(ev, k, None) is not None}
    try:
        model.reset_length(**new)
    except ValueError as e:
        raise UserError(str(e)) from None
    try:
        yield
    finally:
        model.reset_length(**saved)


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
    """Evaluate ``model`` on a split of ``corpus`` with the model's current lengths.

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
    """
    model.eval()
    it = corpus.iterator(split, batch_size, model.tgt_len, drop_last=False)
    n_seg = len(it) if max_step is None else min(max_step, len(it))
    state = model.init_state(it.local_batch_size, device)
    total = torch.zeros((), dtype=torch.float64, device=device)
    count = 0
    recall = _RecallSums(corpus, split, it, device) if corpus.labels is not None else None
    stats = RetrievalStats()
    analyses = _TokenAnalyses(corpus, split, it, device)
    nll_tokens, target_tokens = [], []
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
        analyses.add(batch, out)
        if per_token:
            nll_tokens.append(out.nll.float().cpu())
            target_tokens.append(batch.target.cpu())
        if out.selection is not None:
            stats.update(out.selection.age, state.cache.seg_len, out.selection.alpha)
        if recall is not None:
            recall.add(model, batch, out, state)
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
    if uses_cache(model):
        result.update(n_slot=model.n_slot, top_k=model.top_k, retrieval=stats.summary())
    if recall is not None:
        result.update(recall.metrics(corpus, split))
    if count > 0:
        result.update(analyses.metrics(model))
    if per_token:
        result["nll_tokens"] = torch.cat(nll_tokens, 1) if nll_tokens else torch.empty(0)
        result["target_tokens"] = torch.cat(target_tokens, 1) if target_tokens else torch.empty(0)
    return result


class _RecallSums:
    """Passage-recall sums over a split of the synthetic corpus (SPEC §4): NLL, correct predictions
    and count on ``repeat`` and ``fresh`` tokens, and where the copied source of repeat tokens lay."""

    def __init__(self, corpus: Any, split: str, it: Any, device: torch.device | str):
        self.eos = corpus.vocab.eos_idx
        self.sums = {k: torch.zeros(3, dtype=torch.float64, device=device) for k in ("repeat", "fresh")}
        self.skip = corpus.info.get("repeat_skip", 0)
        self.gap_all = None if corpus.repeat_gap is None else corpus.repeat_gap[split].to(device)
        self.root_all = None if self.gap_all is None else copy_roots(self.gap_all)
        self.row_base = torch.arange(it.local_batch_size, device=device)[:, None] * it.stream_len
        # repeat tokens: source in memory, cached, retrieved; all
        self.where = torch.zeros(5, dtype=torch.float64, device=device)

    def add(self, model: TransformerLM, batch: Any, out: Any, state: Any) -> None:
        label = batch.label
        correct = (model.crit.log_prob(out.hidden).argmax(-1) == batch.target).double()
        masks = {"repeat": label > self.skip, "fresh": (label == 0) & (batch.target != self.eos)}
        for k, m in masks.items():
            m = m.double()
            self.sums[k] += torch.stack([(out.nll.double() * m).sum(), (correct * m).sum(), m.sum()])
        if self.gap_all is not None:
            self.where += _source_location(
                out,
                state,
                batch,
                gap_all=self.gap_all,
                root_all=self.root_all,
                row_base=self.row_base,
                repeat=masks["repeat"],
                model=model,
            )

    def metrics(self, corpus: Any, split: str) -> dict[str, Any]:
        """``{"repeat": {...}, "fresh": {...}}``: tokens, loss, ppl, acc, the source's ppl, where the source lay."""
        src = corpus.source_nll[split] if corpus.source_nll is not None else None
        labels_all = corpus.labels[split].long()
        target_all = corpus.splits[split]
        result: dict[str, Any] = {}
        for k in ("repeat", "fresh"):
            s_nll, s_acc, n = self.sums[k].tolist()
            entry: dict[str, Any] = {"tokens": int(n)}
            if n > 0:
                entry.update(loss=s_nll / n, ppl=math.exp(min(s_nll / n, 700.0)), acc=s_acc / n)
            if src is not None:
                m = labels_all > self.skip if k == "repeat" else (labels_all == 0) & (target_all != self.eos)
                m = m & torch.isfinite(src)
                if m.any():
                    entry["source_ppl"] = math.exp(src[m].double().mean().item())
            result[k] = entry
        if self.gap_all is not None and self.where[3] > 0:
            mem, cached, hit, n, chain = self.where.tolist()
            result["repeat"]["source_in_memory"] = mem / n
            result["repeat"]["source_in_cache"] = cached / n
            result["repeat"]["source_retrieved"] = hit / n
            result["repeat"]["copy_retrieved"] = chain / n
        return result


class _FreqBuckets:
    """NLL sums and token counts per training-frequency bucket of the target word (SPEC §5)."""

    @staticmethod
    def applies(corpus: Any) -> bool:
        return corpus.level == "word" and corpus.train_counts is not None and corpus.name != "synthetic"

    def __init__(self, corpus: Any, device: torch.device | str):
        self.bucket_of = torch.bucketize(corpus.train_counts, torch.tensor(FREQ_EDGES), right=True).to(device)
        self.sums = torch.zeros(2, len(FREQ_EDGES) + 1, dtype=torch.float64, device=device)

    def add(self, batch: Any, out: Any) -> None:
        b = self.bucket_of[batch.target].reshape(-1)
        self.sums[0].index_add_(0, b, out.nll.reshape(-1).double())
        self.sums[1].index_add_(0, b, torch.ones_like(b, dtype=torch.float64))


class _TokenAnalyses:
    """The per-token analyses summed during an evaluation: training-frequency buckets (word-level
    corpora, :class:`_FreqBuckets`) and distance buckets (:class:`crtn.analysis.distance.DistanceBuckets`)."""

    def __init__(self, corpus: Any, split: str, it: Any, device: torch.device | str):
        self.freq = _FreqBuckets(corpus, device) if _FreqBuckets.applies(corpus) else None
        self.distance = DistanceBuckets(corpus, split, it, device)
        self.corpus, self.split = corpus, split

    def add(self, batch: Any, out: Any) -> None:
        if self.freq is not None:
            self.freq.add(batch, out)
        self.distance.add(batch.index, out.nll)

    def metrics(self, model: TransformerLM) -> dict[str, Any]:
        """``freq_buckets`` (when it applies) and ``distance_buckets``, JSON-ready."""
        out = {} if self.freq is None else {"freq_buckets": freq_bucket_ppl(self.freq.sums)}
        out["distance_buckets"] = self.distance.summary(model, self.corpus, self.split)
        return out


def _source_location(
    out: Any,
    state: Any,
    batch: Any,
    gap_all: torch.Tensor,
    root_all: torch.Tensor,
    row_base: torch.Tensor,
    repeat: torch.Tensor,
    model: TransformerLM,
) -> torch.Tensor:
    """Where the token that each repeated target copies lies, for the passage-recall corpus.

    Returns [5] counts over ``repeat`` targets: source within the memory or current
    segment (reachable without retrieval), source in a cached slot, source in one of the
    token's retrieved slots, all repeat targets, and targets for which a retrieved slot
    holds *the same text*: the source or any other copy of the same original passage
    (the source's own source, or another copy made from it; ``root_all``, see
    :func:`copy_roots`). A passage copied more than once appears several times in a
    large cache, and any occurrence lets the model copy. Positions are per-stream (SPEC §4).
    """
    L = batch.input.shape[1]
    t0 = batch.index * model.tgt_len
    j = torch.arange(L, device=repeat.device)
    gap = gap_all[row_base + t0 + j + 1].long()  # [B, L] gap of each target token
    src = (t0 + j + 1)[None, :] - gap  # stream position of the copied token
    in_memory = src >= t0 - min(model.mem_len, t0)  # memory as read during this step
    counts = [(in_memory & repeat).sum()]
    cache = state.cache
    if cache is not None and cache.n_valid > 0 and out.selection is not None:
        seg = cache.seg_len
        valid_pos = cache.pos[:, : cache.n_valid][:, None, :]  # [B, 1, n_valid]
        # the cache as it was read during this step: renewal is committed at the next step
        cached = ((valid_pos <= src[..., None]) & (src[..., None] < valid_pos + seg)).any(-1)
        pos = t0 - out.selection.age  # [B, L, k]
        hit = ((pos <= src[..., None]) & (src[..., None] < pos + seg)).any(-1)
        counts += [(cached & repeat & ~in_memory).sum(), (hit & repeat).sum()]
        # the same text: a row of a selected slot with the source's root
        flat_src = row_base + src  # [B, L]; < 0 only before the first stream's start
        want = root_all[flat_src.clamp(min=0)]
        rows = (row_base[..., None, None] + pos[..., None] + torch.arange(seg, device=pos.device)).clamp(
            max=root_all.numel() - 1
        )  # [B, L, k, seg] split index of each row of the selected slots
        # a direct hit is one of these: the source row has the source's root
        same = (root_all[rows] == want[..., None, None]).flatten(-2).any(-1) & (flat_src >= 0)
        chain = (same & repeat).sum()
    else:
        counts += [torch.zeros((), device=repeat.device, dtype=torch.long)] * 2
        chain = torch.zeros((), device=repeat.device, dtype=torch.long)
    counts += [repeat.sum(), chain]
    return torch.stack(counts).double()


def freq_bucket_ppl(sums: torch.Tensor) -> dict[str, dict[str, float]]:
    """Perplexity per training-frequency bucket: sums [2, 4] (NLL sum, token count) -> JSON dict."""
    out = {}
    for label, (nll, n) in zip(FREQ_LABELS, sums.t().tolist()):
        out[label] = {"tokens": int(n), "ppl": math.exp(min(nll / n, 700.0)) if n else None}
    return out


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
    return " | ".join(parts)


def _jsonable(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not isinstance(v, torch.Tensor)}


def load_with_overrides(cfg: Any) -> tuple[dict[str, Any], Any]:
    """Read ``cfg.checkpoint`` and apply the app's non-null ``cache.*``/``data.*`` overrides.

    Used by crtn-eval and crtn-generate. Returns (checkpoint dict, the checkpoint's training
    config as a typed node with the overrides merged in).

    Raises:
        CheckpointError: unreadable checkpoint. ConfigError: invalid ``eval.*`` values.
    """
    ckpt = load_checkpoint(cfg.checkpoint)
    train_cfg = checkpoint_config(ckpt)
    for section in ("cache", "data"):
        overrides = {k: v for k, v in OmegaConf.to_container(cfg[section]).items() if v is not None}
        train_cfg[section] = OmegaConf.merge(train_cfg[section], overrides)
    validate_eval(cfg.eval, train_cfg.model)
    return ckpt, train_cfg


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
    ckpt, train_cfg = load_with_overrides(cfg)
    device = resolve_device(cfg.device)
    corpus = load_corpus(train_cfg.data)
    check_vocab(ckpt, corpus, cfg.checkpoint)
    model = build_model(train_cfg, len(corpus.vocab)).to(device)
    model.load_state_dict(ckpt["model"])
    batch_size = cfg.eval.batch_size or train_cfg.data.eval_batch_size
    results: dict[str, Any] = {"checkpoint": str(cfg.checkpoint), "step": ckpt.get("step")}
    with eval_lengths(model, cfg.eval):
        for split in cfg.splits:
            if split not in corpus.splits:
                raise UserError(f"splits: {split!r} is not one of {', '.join(corpus.splits)}")
            m = evaluate(
                model,
                corpus,
                split,
                batch_size=batch_size,
                device=device,
                max_step=cfg.eval.max_step,
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
