"""What an evaluation measures on each segment besides the loss (docs/method.md §5):

- :class:`RecallSums`: the passage-recall corpus (``data=synthetic``, docs/method.md §4): NLL and
  next-token accuracy on ``repeat`` tokens (tokens of a copied passage after its first
  ``repeat_skip``) and ``fresh`` tokens, the Markov source's own NLL on them, and where the
  copied source of a repeat token lay (memory, cache, retrieved: :func:`source_location`);
- :class:`AnswerSums`: the multi-query associative recall corpus (``data=mqar``): loss and
  accuracy on the answers, by gap, and where each answer's stored value lay;
- :class:`FreqBuckets`: perplexity by the target word's training frequency (the CRTN paper's
  analysis; word-level corpora);
- :class:`crtn.analysis.distance.DistanceBuckets`: loss by the distance back to the previous
  occurrence of the target (and of the longest n-gram ending at it) in its stream (every corpus);
- retrieval statistics of models with a cache (:class:`crtn.model.RetrievalStats`).

:class:`Measures` holds the ones that apply to a corpus and model; :func:`crtn.evaluate.evaluate`
feeds it every segment and merges :meth:`Measures.metrics` into its result.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from crtn.analysis.distance import DistanceBuckets
from crtn.data.synthetic import copy_roots
from crtn.model import RetrievalStats, TransformerLM

#: Word-frequency buckets of the CRTN paper's analysis (docs/method.md §5): occurrences in the training split.
FREQ_EDGES = [100, 1000, 10000]
FREQ_LABELS = ["<100", "100-1K", "1K-10K", ">10K"]


class Measures:
    """What an evaluation measures on each segment beyond the loss: retrieval statistics (models
    with a cache), the passage-recall sums (the synthetic corpus), perplexity by training frequency
    (word-level corpora) and, on request, the per-token NLL. ``metrics`` gives their entries of the
    result dict (module docstring)."""

    def __init__(
        self,
        corpus: Any,
        split: str,
        it: Any,
        *,
        device: torch.device | str,
        per_token: bool,
        retrieves: bool,
    ):
        self.corpus, self.split, self.retrieves = corpus, split, retrieves
        self.recall: Any = None  # the sums of a corpus with labels: passage recall or MQAR answers
        if AnswerSums.applies(corpus):
            self.recall = AnswerSums(corpus, device)
        elif corpus.labels is not None:
            self.recall = RecallSums(corpus, split, it, device)
        self.stats = RetrievalStats()
        self.buckets = FreqBuckets(corpus, device) if FreqBuckets.applies(corpus) else None
        self.distance = DistanceBuckets(corpus, split, it, device)
        self.tokens: tuple[list, list] | None = ([], []) if per_token else None

    def add(self, model: TransformerLM, batch: Any, out: Any, state: Any) -> None:
        """Account one segment: ``batch`` (on the device), the model's output and its new state."""
        if self.buckets is not None:
            self.buckets.add(batch, out)
        self.distance.add(batch.index, out.nll)
        if self.tokens is not None:
            self.tokens[0].append(out.nll.float().cpu())
            self.tokens[1].append(batch.target.cpu())
        if out.selection is not None:
            self.stats.update(out.selection.age, state.cache.seg_len, out.selection.alpha)
        if self.recall is not None:
            self.recall.add(model, batch, out, state)

    def metrics(self, model: TransformerLM, count: int) -> dict[str, Any]:
        """The measures' entries of the result: ``retrieval``, ``repeat``/``fresh`` or
        ``answers``, ``freq_buckets``, ``distance_buckets`` (the buckets beyond ``model``'s reach
        marked), ``nll_tokens``/``target_tokens`` (where they apply)."""
        result: dict[str, Any] = {}
        if self.retrieves:
            result["retrieval"] = self.stats.summary()
        if self.recall is not None:
            result.update(self.recall.metrics(self.corpus, self.split))
        if self.buckets is not None and count > 0:
            result["freq_buckets"] = freq_bucket_ppl(self.buckets.sums)
        if count > 0:
            result["distance_buckets"] = self.distance.summary(model, self.corpus, self.split)
        if self.tokens is not None:
            nll, target = self.tokens
            result["nll_tokens"] = torch.cat(nll, 1) if nll else torch.empty(0)
            result["target_tokens"] = torch.cat(target, 1) if target else torch.empty(0)
        return result


class RecallSums:
    """Passage-recall sums over a split of the synthetic corpus (docs/method.md §4): NLL, correct predictions
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
            self.where += source_location(
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


class FreqBuckets:
    """NLL sums and token counts per training-frequency bucket of the target word (docs/method.md §5)."""

    @staticmethod
    def applies(corpus: Any) -> bool:
        return (
            corpus.level == "word"
            and corpus.train_counts is not None
            and corpus.name not in ("synthetic", "mqar")
        )

    def __init__(self, corpus: Any, device: torch.device | str):
        self.bucket_of = torch.bucketize(corpus.train_counts, torch.tensor(FREQ_EDGES), right=True).to(device)
        self.sums = torch.zeros(2, len(FREQ_EDGES) + 1, dtype=torch.float64, device=device)

    def add(self, batch: Any, out: Any) -> None:
        b = self.bucket_of[batch.target].reshape(-1)
        self.sums[0].index_add_(0, b, out.nll.reshape(-1).double())
        self.sums[1].index_add_(0, b, torch.ones_like(b, dtype=torch.float64))


def source_location(
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
    large cache, and any occurrence lets the model copy. Positions are per-stream (docs/method.md §4).
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


#: ``(nll, correct, count)`` columns of :attr:`AnswerSums.sums`.
_NLL, _CORRECT, _COUNT = 0, 1, 2


class AnswerSums:
    """Sums over the answers of one pass over an MQAR split (module docstring).

    Args:
        corpus: the MQAR :class:`crtn.data.Corpus` (``labels``: gap at each answer, 0 elsewhere;
            ``info["gap_buckets"]``, ``info["n_values"]``).
        device: where the sums live (the model's device).

    Attributes:
        sums: ``float64 [n_buckets, 3]``: NLL (nats), correct predictions and count of the
            answers of each gap bucket.
        all_tokens: ``float64 [2]``: correct predictions and count over every target.
        where: ``float64 [4]``: answers whose stored value lay in the memory or the current
            segment, in a cached slot, in a slot the answer's token retrieved; answers counted.
        cut: answers whose stored value lies before their stream's start.
    """

    @staticmethod
    def applies(corpus: Any) -> bool:
        """Whether ``corpus`` is an MQAR corpus."""
        return corpus.name == "mqar"

    def __init__(self, corpus: Any, device: torch.device | str):
        buckets = corpus.info["gap_buckets"]
        self.bucket_names = [f"{lo}-{hi}" for lo, hi in buckets]
        self.inner_edges = torch.tensor([lo for lo, _ in buckets[1:]], dtype=torch.long, device=device)
        self.n_values = int(corpus.info["n_values"])
        self.sums = torch.zeros(len(buckets), 3, dtype=torch.float64, device=device)
        self.all_tokens = torch.zeros(2, dtype=torch.float64, device=device)
        self.where = torch.zeros(4, dtype=torch.float64, device=device)
        self.cut = torch.zeros((), dtype=torch.float64, device=device)
        self.has_cache = False

    def add(self, model: Any, batch: Any, out: Any, state: Any) -> None:
        """Add one segment: ``batch`` (a :class:`crtn.data.Batch` with labels), the model's output
        ``out`` (``nll`` [B, L'], ``hidden``, ``selection``) and the state after it (its cache as
        read during this step)."""
        pred = model.crit.log_prob(out.hidden).argmax(-1)
        t0 = batch.index * model.tgt_len
        answer, src = self.update(batch.label, batch.target, out.nll, pred=pred, t0=t0)
        self.has_cache = self.has_cache or bool(getattr(model, "has_cache", False))
        cache = getattr(state, "cache", None)
        self.locate(answer, src, t0, mem_len=model.mem_len, cache=cache, selection=out.selection)

    def update(
        self, label: torch.Tensor, target: torch.Tensor, nll: torch.Tensor, pred: torch.Tensor, t0: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the losses and predictions of one segment.

        Args:
            label: ``[B, L']`` gap of each target token (0: not an answer).
            target, pred: ``[B, L']`` token ids: the targets and the model's argmax predictions.
            nll: ``[B, L']`` NLL of the targets, nats.
            t0: stream position of the segment's first input token (``index * tgt_len``).

        Returns:
            ``(answer, src)``: ``[B, L']`` bool, the answers counted (stored value inside the
            stream), and the stream position of each target's stored value (``t0 + j + 1 - gap``).
        """
        correct = (pred == target).double()
        self.all_tokens[0] += correct.sum()
        self.all_tokens[1] += correct.numel()
        gap = label.long()
        src = t0 + 1 + torch.arange(gap.shape[1], device=gap.device)[None, :] - gap
        answer = (gap > 0) & (src >= 0)
        self.cut += ((gap > 0) & (src < 0)).sum()
        bucket = torch.bucketize(gap[answer], self.inner_edges, right=True)
        rows = torch.stack([nll[answer].double(), correct[answer], torch.ones_like(correct[answer])], 1)
        self.sums.index_add_(0, bucket, rows)
        return answer, src

    def locate(
        self, answer: torch.Tensor, src: torch.Tensor, t0: int, mem_len: int, cache: Any, selection: Any
    ) -> None:
        """Count where the stored values of the ``answer`` targets lay (positions ``src``, [B, L']):
        within the memory or the current segment (``src >= t0 - min(mem_len, t0)``), in a valid
        slot of ``cache`` (a :class:`crtn.model.cache.SegmentCache` or None: ``pos``,
        ``n_valid``, ``seg_len``), in one of the slots ``selection`` retrieved for that target
        (``age`` [B, L', k]; None: none retrieved)."""
        in_memory = src >= t0 - min(mem_len, t0)
        zero = torch.zeros((), dtype=torch.long, device=src.device)
        cached, hit = zero, zero
        if cache is not None and cache.n_valid > 0:
            seg, s = cache.seg_len, src[..., None]
            slot_pos = cache.pos[:, : cache.n_valid][:, None, :]  # [B, 1, n_valid]
            cached = (((slot_pos <= s) & (s < slot_pos + seg)).any(-1) & answer).sum()
            if selection is not None:
                sel_pos = t0 - selection.age  # [B, L', k] stream position of each selected slot
                hit = (((sel_pos <= s) & (s < sel_pos + seg)).any(-1) & answer).sum()
        self.where += torch.stack([(in_memory & answer).sum(), cached, hit, answer.sum()]).double()

    def metrics(self, corpus: Any = None, split: str | None = None) -> dict[str, Any]:
        """``{"acc": accuracy on all tokens, "answers": {...}}``: the answers' ``tokens``, ``loss``
        (nats), ``ppl``, ``acc``, ``chance_acc`` (1 / n_values), ``chance_loss`` (ln n_values),
        ``cut``, ``by_gap`` (per bucket ``tokens``, ``loss``, ``acc``), ``pair_in_memory``, and
        for a model with a cache ``pair_in_cache`` and ``pair_retrieved`` (fractions of the
        answers; see :meth:`locate`). ``corpus`` and ``split`` are unused (the signature of the
        passage-recall sums in :mod:`crtn.evaluate`)."""
        correct, count = self.all_tokens.tolist()
        result: dict[str, Any] = {"acc": correct / count if count else None}
        nll, right, n = self.sums.sum(0).tolist()
        entry: dict[str, Any] = {"tokens": int(n)}
        if n > 0:
            entry.update(loss=nll / n, ppl=math.exp(min(nll / n, 700.0)), acc=right / n)
        entry.update(chance_acc=1.0 / self.n_values, chance_loss=math.log(self.n_values), cut=int(self.cut))
        entry["by_gap"] = {}
        for name, (b_nll, b_right, b_n) in zip(self.bucket_names, self.sums.tolist()):
            e: dict[str, Any] = {"tokens": int(b_n)}
            if b_n > 0:
                e.update(loss=b_nll / b_n, acc=b_right / b_n)
            entry["by_gap"][name] = e
        mem, cached, hit, located = self.where.tolist()
        if located > 0:
            entry["pair_in_memory"] = mem / located
            if self.has_cache:
                entry.update(pair_in_cache=cached / located, pair_retrieved=hit / located)
        result["answers"] = entry
        return result


def format_answers(m: dict[str, Any]) -> list[str]:
    """Parts of :func:`crtn.evaluate.format_metrics`'s line for the MQAR metrics of ``m`` (none
    without them): ``acc 0.412 | answers ppl 3.10 acc 0.650 (chance 0.002; by gap 1024-2047
    0.700, ...), pair retrieved 0.91``."""
    a = m.get("answers")
    if not a or "acc" not in a:
        return []
    gaps = ", ".join(f"{k} {e['acc']:.3f}" for k, e in a["by_gap"].items() if "acc" in e)
    where = f", pair retrieved {a['pair_retrieved']:.2f}" if "pair_retrieved" in a else ""
    return [
        f"acc {m['acc']:.3f}",
        f"answers ppl {a['ppl']:.2f} acc {a['acc']:.3f} (chance {a['chance_acc']:.3f}; by gap {gaps}){where}",
    ]
