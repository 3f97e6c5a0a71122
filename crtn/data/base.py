"""The :class:`Corpus` container, shared by the file corpora (:mod:`crtn.data.corpus`), the
synthetic passage-recall corpus (:mod:`crtn.data.synthetic`) and the multi-query associative
recall corpus (:mod:`crtn.data.mqar`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from crtn.data.iterator import StreamIterator
from crtn.data.task import Task
from crtn.data.vocab import Vocab
from crtn.errors import ConfigError

SPLITS = ("train", "valid", "test")


@dataclass
class Corpus:
    """A tokenised corpus (docs/method.md §4).

    Attributes:
        name: ``data.name`` (``"wt2"``, ``"ptb"``, ``"synthetic"``, ...).
        vocab: the :class:`Vocab` shared by all splits.
        level: ``"word"`` or ``"char"``.
        metric: ``"ppl"`` (word level and synthetic) or ``"bpc"`` (character level).
        splits: ``{"train", "valid", "test"}`` -> 1-D ``torch.int64`` CPU tensor of ids.
        labels: synthetic only, per split a 1-D ``torch.int16`` tensor aligned with
            ``splits``: 0 for a fresh token or ``<eos>``, ``i >= 1`` for the i-th
            token (1-based) of a repeated passage. ``mqar``: ``torch.int32``, the gap
            of each answer token (> 0, :mod:`crtn.data.mqar`), 0 elsewhere. None for
            other corpora.
        source_nll: synthetic only, per split a 1-D ``torch.float32`` tensor: the
            NLL in nats of each token under the generating Markov source (nan for
            ``<eos>``, inf where the source gives probability 0, which happens
            only at the first token of a repeated passage). None otherwise.
        train_counts: ``torch.int64`` tensor ``[len(vocab)]``: occurrences of each
            id in the train split (for word-frequency buckets, docs/method.md §5).
        info: extra facts (JSON-friendly): token counts, cache use, and for the
            synthetic corpus the source's entropies and repeat statistics.
        source: synthetic only, the :class:`crtn.data.synthetic.MarkovSource`.
        repeat_gap: synthetic only, per split a 1-D ``torch.int32`` tensor: for each
            token of a copied passage the distance in tokens back to the token it
            copies, 0 elsewhere (to check what retrieval finds); ``mqar``: the
            ``labels`` tensor (an answer copies its stored value). None otherwise.
        task: what training and evaluation ask of the corpus besides the loss
            (:class:`crtn.data.task.Task`: the tokens the training loss scores, the loss that
            selects ``best.pt``, the corpus' own metrics); language modelling by default,
            :class:`crtn.data.synthetic.RecallTask`, :class:`crtn.data.mqar.MqarTask`.
            Evaluation always scores every token.
    """

    name: str
    vocab: Vocab
    level: str
    metric: str
    splits: dict[str, torch.Tensor]
    train_counts: torch.Tensor
    labels: dict[str, torch.Tensor] | None = None
    source_nll: dict[str, torch.Tensor] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    source: Any = None
    repeat_gap: dict[str, torch.Tensor] | None = None
    task: Task = field(default_factory=Task)

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s}={len(t):,}" for s, t in self.splits.items())
        return f"Corpus({self.name!r}, level={self.level}, vocab={len(self.vocab):,}, {sizes})"

    def iterator(self, split: str, batch_size: int, tgt_len: int, **kwargs: Any):
        """A :class:`crtn.data.StreamIterator` over ``split`` (labels attached when present).

        ``kwargs`` go to :class:`StreamIterator` (``rank``, ``world_size``, ``drop_last``).
        """
        if split not in self.splits:
            raise ConfigError(f"split {split!r} is not one of: {', '.join(self.splits)}")
        labels = None if self.labels is None else self.labels[split]
        return StreamIterator(
            self.splits[split], batch_size, tgt_len, labels=labels, split=f"{self.name}/{split}", **kwargs
        )
