"""Evaluation with projected keys and values kept (issue 15).

At evaluation (no gradient, weights fixed) the keys W_{k,E} h and values W_v h of a row do
not depend on where the row is attended from: relative positions enter only through the
separate term (q + v).W_{k,R} R_{i-j} (SPEC §2), and pre-LN normalises each row on its own.
So the memory's keys and values (Transformer-XL and CRTN) and those of every cached slot
(CRTN) are projected once, when the row is made, and reused at every later step instead of
re-projecting the memory (M rows per layer and step) and folding every token's query into
model space for its k L retrieved rows (SPEC §3, "Efficient main pass"): a retrieved row
then costs d multiply-adds per token and product, not H d.

Training keeps the plain path (the projections change with every update).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor


def keep_last(cat_kv: list[Tensor], mem_len: int) -> list[Tensor] | None:
    """Keys and values of the new memory: the last ``mem_len`` rows of each layer's [S; H_t]
    keys and values [B, M+L, 2 H d_h] (views, no copy); None when ``mem_len`` is 0."""
    if mem_len <= 0:
        return None
    return [c[:, max(0, c.shape[1] - mem_len) :] for c in cat_kv]


def _kv_chunks(kv: Tensor, index: Tensor, dtype: torch.dtype) -> Iterator[tuple[int, int, Tensor]]:
    """Yield (start, end, rows) with rows [end-start, k*Ls, 2 H d_h] of each token's retrieved slots."""
    T, k = index.shape
    Ls, w = kv.shape[1], kv.shape[2]
    # CPU: ~4 MB chunks stay in cache; GPU: one chunk
    chunk = T if kv.is_cuda else max(1, min(T, (1 << 20) // (k * Ls * w)))
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        yield s, e, kv.index_select(0, index[s:e].reshape(-1)).view(e - s, k * Ls, w).to(dtype)


def kv_scores(q: Tensor, kv: Tensor, index: Tensor) -> Tensor:
    """Content scores of each token against its retrieved rows' projected keys.

    Args:
        q: [T, H, d_h] the queries plus u, (q_j + u).
        kv: [B*N, Ls, 2 H d_h] one layer's projected keys and values of every slot.
        index: [T, k] long, the rows of ``kv`` each token retrieved.

    Returns:
        [T, H, k*Ls], (q_j + u) . W_{k,E} z for every retrieved row z.
    """
    T, H, dh = q.shape
    out = q.new_empty(T, H, index.shape[1] * kv.shape[1])
    for s, e, z in _kv_chunks(kv, index, q.dtype):
        keys = z[..., : H * dh].view(e - s, -1, H, dh)
        out[s:e] = torch.einsum("thd,tchd->thc", q[s:e], keys)
    return out


def kv_mix(prob: Tensor, kv: Tensor, index: Tensor) -> Tensor:
    """Attention-weighted sum of each token's retrieved rows' projected values.

    Args:
        prob: [T, H, k*Ls] attention probabilities of the retrieved rows (alpha applied).
        kv, index: as in :func:`kv_scores`.

    Returns:
        [T, H, d_h], sum_r prob_r W_v z_r.
    """
    T, H, _ = prob.shape
    dh = kv.shape[2] // (2 * H)
    out = prob.new_empty(T, H, dh)
    for s, e, z in _kv_chunks(kv, index, prob.dtype):
        vals = z[..., H * dh :].view(e - s, -1, H, dh)
        out[s:e] = torch.einsum("thc,tchd->thd", prob[s:e], vals)
    return out
