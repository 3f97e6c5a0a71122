"""Evaluation with projected keys and values kept.

At evaluation (no gradient, weights fixed) the keys W_{k,E} h and values W_v h of a row do
not depend on where the row is attended from: relative positions enter only through the
separate term (q + v).W_{k,R} R_{i-j} (docs/method.md §2), and pre-LN normalises each row on its own.
So the memory's keys and values (Transformer-XL and CRTN) are projected once, when the row is
made, and reused at every later step instead of re-projecting the memory (M rows per layer and
step). Training keeps the plain path (the projections change with every update).

:func:`kv_scores` and :func:`kv_mix` read a context's projected slot keys and values
(``CacheContext.kv``) where a caller supplies them; the CRTN step does not (the retrieved rows
are folded, docs/method.md §3, "Efficient main pass"; keeping the slots' projections measured
1.04-1.07x for 2.6x the cache's memory, docs/results.md, "Options removed").
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class StepKV:
    """The memory's keys and values during one step, as the attention layers use them.

    Attributes:
        mem: per layer 0..n-1, [B, M, 2 H d_h] keys and values of the memory: those the state kept
            (evaluation) or projected once for every pass over the memory (CRTN's query pass and
            main pass); None: each layer projects its memory itself.
        out: at evaluation, a list that receives each layer's keys and values of [memory; segment]
            [B, M+L, 2 H d_h] as the layers run (``RelPartialLearnableMultiHeadAttn``); None in
            training.
    """

    mem: list[Tensor] | None = None
    out: list[Tensor] | None = None

    def next_memory(self, mem_len: int) -> list[Tensor] | None:
        """The keys and values of the next step's memory (:func:`keep_last` of :attr:`out`), or
        None when this step kept none."""
        return None if self.out is None else keep_last(self.out, mem_len)


def keep_last(cat_kv: list[Tensor], mem_len: int) -> list[Tensor] | None:
    """Keys and values of the new memory: the last ``mem_len`` rows of each layer's [S; H_t]
    keys and values [B, M+L, 2 H d_h] (views, no copy); None when ``mem_len`` is 0."""
    if mem_len <= 0:
        return None
    return [c[:, max(0, c.shape[1] - mem_len) :] for c in cat_kv]


def _chunks(part: Tensor, index: Tensor) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, end, rows): rows [k, end-start, H, Ls, d_h], each token's retrieved slots of
    ``part`` [B*N, H, Ls, d_h] (keys or values), gathered ~4 MB at a time on CPU (one chunk on GPU);
    segment-major, so that ``rows[j]`` is contiguous."""
    T, k = index.shape
    per_token = k * part[0].numel()
    chunk = T if part.is_cuda else max(1, min(T, (1 << 20) // per_token))
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        rows = part.index_select(0, index[s:e].t().reshape(-1))
        yield s, e, rows.view(k, e - s, *part.shape[1:])


def kv_scores(q: Tensor, kv: Tensor, index: Tensor) -> Tensor:
    """Content scores of each token against its retrieved rows' projected keys.

    Args:
        q: [T, H, d_h] the queries plus u, (q_j + u).
        kv: [2, B*N, H, Ls, d_h] one layer's projected keys and values of every slot.
        index: [T, k] long, the slots each token retrieved.

    Returns:
        [T, H, k*Ls], (q_j + u) . W_{k,E} z for every retrieved row z (segment-major).
    """
    T, H, dh = q.shape
    k, Ls = index.shape[1], kv.shape[3]
    out = q.new_empty(T, H, k, Ls)
    for s, e, keys in _chunks(kv[0], index):
        qs = q[s:e].reshape((e - s) * H, 1, dh)
        for j in range(k):  # one batched product per retrieved segment: no copy of the rows
            rows = keys[j].to(q.dtype).view((e - s) * H, Ls, dh)
            out[s:e, :, j] = torch.bmm(qs, rows.transpose(1, 2)).view(e - s, H, Ls)
    return out.view(T, H, k * Ls)


def kv_mix(prob: Tensor, kv: Tensor, index: Tensor) -> Tensor:
    """Attention-weighted sum of each token's retrieved rows' projected values.

    Args:
        prob: [T, H, k*Ls] attention probabilities of the retrieved rows (alpha applied).
        kv, index: as in :func:`kv_scores`.

    Returns:
        [T, H, d_h], sum_r prob_r W_v z_r.
    """
    T, H, _ = prob.shape
    k, Ls, dh = index.shape[1], kv.shape[3], kv.shape[4]
    out = prob.new_zeros(T * H, 1, dh)
    p = prob.view(T, H, k, Ls)
    for s, e, vals in _chunks(kv[1], index):
        o = out[s * H : e * H]
        for j in range(k):
            rows = vals[j].to(prob.dtype).view((e - s) * H, Ls, dh)
            o.baddbmm_(p[s:e, :, j].reshape((e - s) * H, 1, Ls), rows)
    return out.view(T, H, dh)
