"""The training objective of one batch chunk: the language-modelling loss, optionally on the
labelled tokens only, plus temporal activation regularisation.

- **NLL.** The mean negative log-likelihood (nats) of the step's target tokens, every token by
  default. A corpus' task may restrict it to some tokens (:meth:`crtn.data.task.Task.loss_mask`):
  MQAR with ``data.mqar.train_loss=answers`` scores the answers only, as Zoology trains it
  (Arora et al. 2023, "Zoology", §3 and their ``multiquery_ar.py``, whose other targets are
  ignored); filler, keys and values are unpredictable by construction (:mod:`crtn.data.mqar`).
- **TAR** (``train.tar``; Merity et al. 2018, AWD-LSTM): :func:`crtn.optim.tar_penalty`.
- **Selection** (``best.pt``): the corpus' task says which validation loss selects
  (:meth:`crtn.data.task.Task.selection_loss`: the loss on the tokens the training loss scores).

A step of ``chunks`` chunks (gradient accumulation) sums the chunks' losses: each chunk's mean
is divided by ``chunks`` (every chunk has as many tokens), and a scored subset is divided by
the step's whole count, so that the step's loss is the mean over all its scored tokens.
"""

from __future__ import annotations

import logging

from torch import Tensor

from crtn.optim import tar_penalty

log = logging.getLogger(__name__)


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
        scored: None (every token), or the chunk's rows of the task's loss mask
            (:meth:`crtn.data.task.Task.loss_mask`) with the step's count.

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
