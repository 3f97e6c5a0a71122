"""token_max's row match, computed slot chunk by slot chunk (docs/method.md §3, "Summaries").

:func:`ngram_row_scores` is the score of ``summary=token_max`` (``crtn/model/summary.py``) and of
the ``token_max`` block key of selection inside attention (``crtn/model/gate.py``): for every
query j and slot i, max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}>. It reads every row of every
slot, B L N L d multiply-adds per step; what this module removes is everything else that grew with
N L L: the score block of all slots, its w shifted copies and their gradients.
"""

from __future__ import annotations

import torch
from torch import Tensor

#: elements of one chunk's score block [G, w-1+L, slots, w-1+s+Ls] in :func:`ngram_row_scores` (16 MiB
#: in float64): the slots are scored this many at a time, so memory does not grow with N L L
CHUNK_ELEMENTS = 1 << 21


def ngram_row_scores(query: Tensor, rows: Tensor, lead: Tensor | None, *, ngram: int, shift: int) -> Tensor:
    """The n-gram row match of token_max, unscaled: max_r (1/w) sum_{a<w} <q_{j-a}, row_{r-s-a}>
    (w = ngram, s = shift; class :class:`TokenMax`), for every query against every slot.

    Computed slot chunk by slot chunk (docs/method.md §3, "Summaries", the computation): per chunk
    one product of the queries with the chunk's rows (and one with their lead-in rows), the w
    aligned diagonals summed as shifted slices, and the max over rows; only the maxima and the
    rows that attain them are kept for the backward pass, so the memory of a call is
    O(G L N) plus one chunk (:data:`CHUNK_ELEMENTS`), not O(G L N L w). The cached rows are read in
    place (no copy of them per step). Equal to the unchunked max of the same products (the
    gradient of a max shared by several rows is split evenly among them, as ``torch.amax``
    splits it).

    Args:
        query: [G, w-1+L, d] the L queries with the w-1 before them in front.
        rows: [G, n, Ls, d] the rows of n slots (G independent batches: batch rows, head groups);
            any floating dtype (cast to the query's chunk by chunk).
        lead: [G, n, w-1+s, d] the rows before each slot (zeros where none), or None when w-1+s = 0.

    Returns:
        [G, L, n] in the query's dtype.

    Raises:
        ValueError: ``lead`` is None although w-1+s > 0, or its row count is not w-1+s.
    """
    n_lead = ngram - 1 + shift
    if n_lead > 0 and (lead is None or lead.shape[2] != n_lead):
        got = None if lead is None else lead.shape[2]
        raise ValueError(
            f"ngram_row_scores: {n_lead} lead-in rows per slot needed (ngram-1+shift), got {got}"
        )
    if n_lead == 0:
        lead = None
    if lead is None:
        return _NgramRowMax.apply(query, rows, ngram, shift)
    return _NgramRowMax.apply(query, rows, ngram, shift, lead)


def _chunk_slots(query: Tensor, n_cols: int) -> int:
    """Slots per chunk: a score block [G, Lq, slots, n_cols] of at most :data:`CHUNK_ELEMENTS`."""
    return max(1, CHUNK_ELEMENTS // max(1, query.shape[0] * query.shape[1] * n_cols))


def _chunk_ext(query: Tensor, rows: Tensor, lead: Tensor | None, span: tuple[int, int]) -> Tensor:
    """<q, row> of every query against the lead-in and rows of slots span = (i0, i1): [G, Lq, i1-i0, n_lead+Ls]
    (column c: row c - n_lead of the slot)."""
    i0, i1 = span
    G, Lq, d = query.shape
    Ls = rows.shape[2]
    block = rows[:, i0:i1].to(query.dtype).reshape(G, -1, d)
    ext = torch.bmm(query, block.transpose(1, 2)).view(G, Lq, i1 - i0, Ls)
    if lead is None:
        return ext
    before = torch.einsum("bqd,bnrd->bqnr", query, lead[:, i0:i1].to(query.dtype))
    return torch.cat([before, ext], -1)


def _diagonal_sums(ext: Tensor, w: int, Ls: int) -> Tensor:
    """(1/w) sum_{a<w} of the aligned diagonals of ext [G, w-1+L, n, w-1+s+Ls] -> [G, L, n, Ls]."""
    if ext.shape[-1] == Ls:  # w = 1, s = 0: the products themselves
        return ext
    Lq = ext.shape[1] - w + 1  # row r - s - a is column r + w - 1 - a
    total = ext[:, w - 1 : w - 1 + Lq, :, w - 1 : w - 1 + Ls].clone()
    for a in range(1, w):
        total += ext[:, w - 1 - a : w - 1 - a + Lq, :, w - 1 - a : w - 1 - a + Ls]
    return total * (1.0 / w) if w > 1 else total


class _NgramRowMax(torch.autograd.Function):
    """:func:`ngram_row_scores` with a chunked forward and a backward that rebuilds each chunk's
    gradient from the rows that attain the max (recomputing only chunks with several)."""

    @staticmethod
    def forward(ctx, query, rows, w, shift, lead=None):  # type: ignore[override]
        G, Lq, _ = query.shape
        N, Ls = rows.shape[1], rows.shape[2]
        L = Lq - w + 1
        n_cols = Ls + (0 if lead is None else lead.shape[2])
        step = _chunk_slots(query, n_cols)
        best = query.new_empty(G, L, N)
        where = torch.empty(G, L, N, dtype=torch.long, device=query.device)
        tied = []  # per chunk: whether several rows attain a max (no host sync in the loop)
        for i0 in range(0, N, step):
            i1 = min(N, i0 + step)
            with torch.no_grad():
                scores = _diagonal_sums(_chunk_ext(query, rows, lead, (i0, i1)), w, Ls)
                top, arg = scores.max(-1)
                best[:, :, i0:i1], where[:, :, i0:i1] = top, arg
                several = (scores == top[..., None]).sum(-1) > 1
                tied.append(several.any())
        ctx.w, ctx.step, ctx.has_lead = w, step, lead is not None
        saved = [query, rows, best, where, torch.stack(tied)] + ([] if lead is None else [lead])
        ctx.save_for_backward(*saved)
        return best

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        query, rows, best, where, tied, *rest = ctx.saved_tensors
        lead = rest[0] if ctx.has_lead else None
        w, step = ctx.w, ctx.step
        G, Lq, d = query.shape
        N, Ls = rows.shape[1], rows.shape[2]
        L = Lq - w + 1
        n_lead = 0 if lead is None else lead.shape[2]
        need_q, need_rows = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_lead = lead is not None and ctx.needs_input_grad[4]
        g_query = torch.zeros_like(query) if need_q else None
        g_rows = torch.zeros(rows.shape, dtype=query.dtype, device=rows.device) if need_rows else None
        g_lead = torch.zeros(lead.shape, dtype=query.dtype, device=lead.device) if need_lead else None
        grad = grad * (1.0 / w)
        tied = tied.tolist()
        for c, i0 in enumerate(range(0, N, step)):
            i1 = min(N, i0 + step)
            n = i1 - i0
            g = grad[:, :, i0:i1]
            if tied[c]:  # several rows attain a max: split evenly (torch.amax)
                with torch.no_grad():
                    scores = _diagonal_sums(_chunk_ext(query, rows, lead, (i0, i1)), w, Ls)
                    at = (scores == best[:, :, i0:i1, None]).to(query.dtype)
                weight = at * (g / at.sum(-1))[..., None]
            else:
                weight = query.new_zeros(G, L, n, Ls)
                weight.scatter_(-1, where[:, :, i0:i1, None], g[..., None])
            g_ext = query.new_zeros(G, Lq, n, n_lead + Ls)  # the diagonals' transpose
            for a in range(w):
                g_ext[:, w - 1 - a : w - 1 - a + L, :, w - 1 - a : w - 1 - a + Ls] += weight
            g_rows_part = g_ext[..., n_lead:].reshape(G, Lq, n * Ls)
            block = rows[:, i0:i1].to(query.dtype).reshape(G, n * Ls, d)
            if g_query is not None:
                g_query += torch.bmm(g_rows_part, block)
                if lead is not None:
                    g_query += torch.einsum(
                        "bqnr,bnrd->bqd", g_ext[..., :n_lead], lead[:, i0:i1].to(query.dtype)
                    )
            if g_rows is not None:
                g_rows[:, i0:i1] = torch.bmm(g_rows_part.transpose(1, 2), query).view(G, n, Ls, d)
            if g_lead is not None:
                g_lead[:, i0:i1] = torch.einsum("bqnr,bqd->bnrd", g_ext[..., :n_lead], query)
        if g_rows is not None:
            g_rows = g_rows.to(rows.dtype)
        if g_lead is not None:
            g_lead = g_lead.to(lead.dtype)
        return g_query, g_rows, None, None, g_lead
