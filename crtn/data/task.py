"""What a corpus asks of training and evaluation besides the language-modelling loss: its
:class:`Task` (``corpus.task``), so that the trainer and the evaluation name no corpus.

A task says which target tokens the training loss scores (:meth:`Task.loss_mask`), which
validation loss picks ``best.pt`` (:meth:`Task.selection_loss`), which sums an evaluation
keeps besides the loss (:meth:`Task.measure`), and how its metrics appear in the validation
record and in the one-line summary (:meth:`Task.record`, :meth:`Task.format`). The corpora of
text need nothing more than the loss: :class:`Task` itself. The passage-recall corpus
(:mod:`crtn.data.synthetic_task`) and MQAR (:mod:`crtn.data.mqar_task`) have their own; a new
corpus with its own metric adds a subclass next to its generator and sets it on its
:class:`crtn.data.Corpus`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor


def scored_tokens(label: Tensor | None, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor]:
    """The tokens a step's loss scores when it scores the labelled ones only.

    Args:
        label: ``[B, L]`` labels of the step's target tokens (a :class:`crtn.data.Batch`'s
            ``label``); a token is scored when its label is > 0.
        device: where the mask goes (the model's device).

    Returns:
        ``(scored, count)``: a ``[B, L]`` bool mask and the number of scored tokens, at least 1
        (a step without one has loss 0).

    Raises:
        ValueError: ``label`` is None (the corpus has no labels).
    """
    if label is None:
        raise ValueError("the training loss scores the labelled tokens, but the batch carries no labels")
    scored = label.to(device, non_blocking=True) > 0
    return scored, scored.sum().clamp(min=1)


def slots_hold(start: Tensor, seg_len: int, pos: Tensor) -> Tensor:
    """Whether one of the slots starting at stream positions ``start`` [B, L | 1, k] (each
    ``seg_len`` tokens long) holds the stream position ``pos`` [B, L] of each target: [B, L] bool.
    The recall corpora's evaluations locate a target's source this way, in the cached slots and in
    the selected ones (docs/method.md §4)."""
    p = pos[..., None]
    return ((start <= p) & (p < start + seg_len)).any(-1)


class Task:
    """Language modelling of a text corpus: every target token scored, the validation loss
    selects, no sums beyond the evaluation's own (module docstring). Subclasses register
    themselves (:data:`REGISTRY`), so that :meth:`format_all` shows the metrics of any of them.

    Attributes:
        keys: the entries of an evaluation's result the task adds (each a dict with ``ppl`` and
            ``acc`` where it has tokens), recorded by :meth:`record`.
        freq_buckets: whether perplexity by training frequency applies (word-level text; the
            generated corpora's word frequencies mean nothing).
    """

    REGISTRY: ClassVar[list[type[Task]]] = []
    keys: ClassVar[tuple[str, ...]] = ()
    freq_buckets: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        Task.REGISTRY.append(cls)

    def loss_mask(self, label: Tensor | None, device: torch.device | str) -> tuple[Tensor, Tensor] | None:
        """The tokens the training loss scores (:func:`scored_tokens`' mask and count, for
        :func:`crtn.objective.chunk_loss`); None: every token."""
        return None

    def selection_loss(self, metrics: dict[str, Any]) -> float | None:
        """The validation loss that picks ``best.pt`` (nats): ``metrics["loss"]``, the result of
        :func:`crtn.evaluate.evaluate` on the validation split; None: this validation cannot
        select (``best.pt`` stays as it is)."""
        return metrics["loss"]

    def measure(self, corpus: Any, split: str, it: Any, device: torch.device | str) -> Any | None:
        """The sums an evaluation of ``split`` keeps (an object with ``add(model, batch, out,
        state)`` and ``metrics(corpus, split)``, whose dict joins the result), or None."""
        return None

    def record(self, metrics: dict[str, Any]) -> dict[str, float]:
        """The validation record's entries of :attr:`keys`: ``valid_KEY_ppl``, ``valid_KEY_acc``."""
        out: dict[str, float] = {}
        for k in self.keys:
            if k in metrics and "acc" in metrics[k]:
                out[f"valid_{k}_ppl"], out[f"valid_{k}_acc"] = metrics[k]["ppl"], metrics[k]["acc"]
        return out

    @classmethod
    def format(cls, metrics: dict[str, Any]) -> list[str]:
        """The parts of :func:`crtn.evaluate.format_metrics`' line for this task's metrics in
        ``metrics`` (none when they are absent)."""
        return []

    @staticmethod
    def format_all(metrics: dict[str, Any]) -> list[str]:
        """The parts of every registered task for the metrics ``metrics`` holds."""
        return [part for cls in Task.REGISTRY for part in cls.format(metrics)]
