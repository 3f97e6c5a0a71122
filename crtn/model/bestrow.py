"""The row that attains each slot's best score, for ``cache.pos=match`` (docs/method.md §3,
"Positions of retrieved rows"): for every slot, or, given the selection's k, for the slots
that can be among a query's top k alone (docs/results.md, "Best rows of the candidate slots
alone"). Called by the row match (``rowmatch.py``) chunk of slots by chunk of slots."""

from __future__ import annotations

import torch
from torch import Tensor


def chunk_maxima(
    sums: Tensor, best: Tensor, where: Tensor | None, *, top_k: int | None, scored: Tensor | None = None
) -> None:
    """One chunk's maxima over the rows, written into best [G, n, L] (views of the callers'
    outputs): sums [G, n, Ls, L] the n-gram sums of n slots (any strides); with ``where`` [G, n, L]
    long also the first row attaining each, for every slot or, with ``top_k``, for the slots that
    can be among each query's top_k (:func:`candidate_rows`, ``scored`` as there)."""
    if where is None or top_k is not None:
        torch.amax(sums, -2, out=best)
        if where is not None:
            candidate_rows(sums, best, top_k, out=where, scored=scored)
    else:
        torch.max(sums, -2, out=(best, where))


def candidate_rows(sums: Tensor, top: Tensor, k: int, *, out: Tensor, scored: Tensor | None = None) -> None:
    """The best rows of the slots that can be among each query's top k, from one chunk of slots:
    sums [G, n, Ls, L] the n-gram sums (any strides), top [G, n, L] their maxima over the rows;
    writes the first row attaining each maximum into out [G, n, L] for every slot that scores at
    least the chunk's k-th best for that query (ties included), -1 for the others. A slot the
    whole selection takes scores at least the k-th best of all slots, which is at least the
    chunk's, so it is always among them; so are slots within 2^-16 of the k-th best, which the
    scaling after the match (1/w, the summary's factor) may round onto it, and NaN scores, which
    a max takes. ``scored`` [G, n] bool: the slots whose maxima are final (False: scored again
    later, with their rows; left out of the k-th best, which can only lower it and so keeps more
    slots). Finding them is a host sync; the index-tracking max runs over the Ls rows of about k
    slots per query instead of n."""
    ranked = top if scored is None else top.masked_fill(~scored[..., None], float("-inf"))
    kth = ranked.topk(min(k, top.shape[1]), dim=1).values[:, -1:]  # [G, 1, L]
    kth = kth - kth.abs() * 2.0**-16
    g, i, j = ((top >= kth) | top.isnan()).nonzero(as_tuple=True)
    out.fill_(-1)
    out[g, i, j] = sums[g, i, :, j].argmax(-1)
