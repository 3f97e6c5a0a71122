"""Dropout variants for the regularisation of the AWD-LSTM family, as the CRTN authors use them
(xyz961014/longterm, ``CRTN/utils/fancy_dropout.py``; Merity et al. 2018; Gal & Ghahramani 2016).

- :class:`LockedDropout` (variational dropout): one mask per sequence, shared over time.
- :func:`word_dropout` (embedding dropout): drops whole word types, i.e. rows of the
  embedding matrix, with one mask per forward call shared by every occurrence.

Both are identity at evaluation and rescale kept units by 1 / (1 - p).
"""

from __future__ import annotations

from torch import Tensor, nn


class LockedDropout(nn.Module):
    """Dropout whose mask is shared along one axis (time): x [..., T, ...] with ``time_dim``.

    The mask has size 1 along ``time_dim`` and the size of ``x`` elsewhere, so each
    (sequence, feature) unit is dropped for the whole segment. ``p`` as in ``nn.Dropout``.
    """

    def __init__(self, p: float = 0.5):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor, time_dim: int = -2) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        shape = list(x.shape)
        shape[time_dim] = 1
        mask = x.new_empty(shape).bernoulli_(1.0 - self.p) / (1.0 - self.p)
        return x * mask

    def extra_repr(self) -> str:
        return f"p={self.p}"


class Dropout(nn.Dropout):
    """``nn.Dropout`` that accepts (and ignores) ``time_dim``, so both kinds share one call."""

    def forward(self, x: Tensor, time_dim: int = -2) -> Tensor:  # noqa: ARG002
        return super().forward(x)


def make_dropout(p: float, locked: bool) -> nn.Module:
    """Elementwise (``nn.Dropout``) or locked dropout with rate ``p``; both take ``(x, time_dim)``."""
    return LockedDropout(p) if locked else Dropout(p)


def word_dropout(embed: Tensor, tokens: Tensor, n_token: int, p: float, training: bool) -> Tensor:
    """Embedding (word-type) dropout: zero the embedding of whole word types.

    Equivalent to dropping rows of the embedding matrix (one mask over the vocabulary per
    call, shared by all occurrences of a type in the batch) and rescaling by 1/(1-p).

    Args:
        embed: [..., d] embeddings of ``tokens`` [...].
        n_token: vocabulary size.
        p: drop probability; training: identity when False.

    Returns:
        [..., d].
    """
    if not training or p == 0.0:
        return embed
    keep = embed.new_empty(n_token).bernoulli_(1.0 - p) / (1.0 - p)
    return embed * keep[tokens].unsqueeze(-1)
