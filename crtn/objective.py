"""The training objective of one batch chunk: the language-modelling loss, optionally on the
labelled tokens only, plus temporal activation regularisation.

- **NLL.** The mean negative log-likelihood (nats) of the step's target tokens, every token by
  default. A corpus may restrict it to its labelled tokens (:attr:`crtn.data.Corpus.train_on_labels`):
  MQAR with ``data.mqar.train_loss=answers`` scores the answers only, as Zoology trains it
  (Arora et al. 2023, "Zoology", §3 and their ``multiquery_ar.py``, whose other targets are
  ignored); filler, keys and values are unpredictable by construction (:mod:`crtn.data.mqar`).
- **TAR** (``train.tar``; Merity et al. 2018, AWD-LSTM): :func:`crtn.optim.tar_penalty`.
- **Selection** (``best.pt``): the validation loss on the tokens the training loss scores
  (:func:`selection_loss`); a validation that scores none of them cannot select.

A step of ``chunks`` chunks (gradient accumulation) sums the chunks' losses: each chunk's mean
is divided by ``chunks`` (every chunk has as many tokens), and a scored subset is divided by
the step's whole count, so that the step's loss is the mean over all its scored tokens.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from crtn.optim import tar_penalty

log = logging.getLogger(__name__)


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


def chunk_loss(
    nll: Tensor,
    hidden: Tensor,
    *,
    chunks: int = 1,
    tar: float = 0.0,
    scored: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """The loss of one chunk of a step, to back-propagate, and its NLL part (module docstring).

    Args:
        nll: ``[B_chunk, L]`` NLL of the chunk's targets (nats).
        hidden: ``[B_chunk, L, d]`` top-layer outputs (for TAR).
        chunks: chunks per step.
        tar: the TAR weight (``train.tar``; 0: off).
        scored: None (every token), or the chunk's rows of :func:`scored_tokens`' mask with the
            step's count.

    Returns:
        ``(loss, nll_part)``: scalars; ``nll_part`` is detached, the chunk's share of the step's
        mean NLL (the sum over the chunks is the step's training loss).
    """
    if scored is None:
        loss = nll.float().mean() / chunks
    else:
        mask, count = scored
        loss = nll.float().masked_fill(~mask, 0.0).sum() / count
    part = loss.detach()
    if tar > 0:
        loss = loss + tar_penalty(hidden.float(), tar) / chunks
    return loss, part


def selection_loss(metrics: dict, train_on_labels: bool) -> float | None:
    """The validation loss that picks ``best.pt``: on the tokens the training loss scores.

    Args:
        metrics: :func:`crtn.evaluate.evaluate`'s result on the validation split.
        train_on_labels: :attr:`crtn.data.Corpus.train_on_labels`; the one corpus that sets it,
            MQAR, reports its labelled tokens as ``metrics["answers"]``.

    Returns:
        ``metrics["answers"]["loss"]`` when training scores the labelled tokens (the other tokens
        are never trained), else ``metrics["loss"]`` (nats). None, with a warning, when training
        scores the labelled tokens and the validation held none of them (its first
        ``train.eval_max_step`` segments end before the first answer): ``best.pt`` stays as it is.
    """
    if not train_on_labels:
        return metrics["loss"]
    answers = metrics["answers"]
    if answers["tokens"] == 0:
        log.warning(
            "validation scored no answers (its first train.eval_max_step segments hold none, "
            "or only answers whose pair lies before the stream's start): best.pt is kept as it is"
        )
        return None
    return answers["loss"]
