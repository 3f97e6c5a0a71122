"""Answer metrics of the multi-query associative recall corpus (``data=mqar``; docs/method.md §4-5).

:class:`AnswerSums` accumulates, segment by segment of :func:`crtn.evaluate.evaluate`, the loss
and next-token accuracy on the *answers* of an MQAR split (the value token after a queried
key, :mod:`crtn.data.mqar`), overall and by gap bucket, next to the accuracy on all tokens and
where each answer's stored value lay (memory, cache, retrieved slots). An answer whose stored
value lies before the start of its stream (the iterator cuts the split into B streams;
docs/method.md §4) is out of every model's reach: it is counted as ``cut`` and left out of
the answer metrics. Accuracy is that of the argmax of the model's full next-token
distribution.
"""

from __future__ import annotations

import math
from typing import Any

import torch

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
