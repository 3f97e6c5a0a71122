"""What an evaluation measures on each segment besides the loss (docs/method.md §5):

- the sums of the corpus' own task (:meth:`crtn.data.task.Task.measure`: the passage-recall
  corpus' :class:`crtn.data.synthetic.RecallSums`, MQAR's :class:`crtn.data.mqar.AnswerSums`);
- :class:`FreqBuckets`: perplexity by the target word's training frequency (the CRTN paper's
  analysis; word-level corpora);
- :class:`crtn.analysis.distance.DistanceBuckets`: loss by the distance back to the previous
  occurrence of the target (and of the longest n-gram ending at it) in its stream (every corpus);
- retrieval statistics of models with a cache (:class:`crtn.model.RetrievalStats`): of the
  reported selection (the top retrieving layer's) and, with selection inside attention, of each
  retrieving layer's.

:class:`Measures` holds the ones that apply to a corpus and model; :func:`crtn.evaluate.evaluate`
feeds it every segment and merges :meth:`Measures.metrics` into its result.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from crtn.analysis.distance import DistanceBuckets
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
        self.recall: Any = corpus.task.measure(corpus, split, it, device)  # the corpus' own sums
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
            self.stats.update(
                out.selection.age, state.cache.seg_len, out.selection.alpha, found=out.selection.found
            )
            self.stats.update_layers(out.layer_selections, state.cache.seg_len)
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


class FreqBuckets:
    """NLL sums and token counts per training-frequency bucket of the target word (docs/method.md §5)."""

    @staticmethod
    def applies(corpus: Any) -> bool:
        return corpus.level == "word" and corpus.train_counts is not None and corpus.task.freq_buckets

    def __init__(self, corpus: Any, device: torch.device | str):
        self.bucket_of = torch.bucketize(corpus.train_counts, torch.tensor(FREQ_EDGES), right=True).to(device)
        self.sums = torch.zeros(2, len(FREQ_EDGES) + 1, dtype=torch.float64, device=device)

    def add(self, batch: Any, out: Any) -> None:
        b = self.bucket_of[batch.target].reshape(-1)
        self.sums[0].index_add_(0, b, out.nll.reshape(-1).double())
        self.sums[1].index_add_(0, b, torch.ones_like(b, dtype=torch.float64))


def freq_bucket_ppl(sums: torch.Tensor) -> dict[str, dict[str, float]]:
    """Perplexity per training-frequency bucket: sums [2, 4] (NLL sum, token count) -> JSON dict."""
    out = {}
    for label, (nll, n) in zip(FREQ_LABELS, sums.t().tolist()):
        out[label] = {"tokens": int(n), "ppl": math.exp(min(nll / n, 700.0)) if n else None}
    return out
