"""Faster paths through what PyTorch already has (issue 15), each behind an option and tested
against the eager model in float64 (``tests/test_fused.py``).

- ``model.sdpa``: Transformer-XL attention (without retrieved rows) by
  ``F.scaled_dot_product_attention``; the relative-position term (q + v).W_{k,R} R_{i-j}
  (SPEC §2, "BD"), rel-shifted, masked and pre-scaled, is its additive mask, so
  softmax((AC + BD) / sqrt(d_h)) V is the same function.
- ``train.compile``: ``torch.compile`` of every decoder layer (:func:`compile_layers`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


def rel_shift(x: Tensor) -> Tensor:
    """Transformer-XL's relative shift of the position scores.

    Input ``x[..., i, c]`` [..., L, K] holds the score of query i against distance
    ``K-1-c`` (position sequence K-1, ..., 0). Output ``y[..., i, j]`` is the score of
    query i (at position K-L+i) against key position j, i.e. distance K-L+i-j. Entries
    with j > K-L+i (future keys) are garbage and must be masked by the caller.
    """
    *lead, qlen, klen = x.shape
    x = F.pad(x, (1, 0))  # [..., L, K+1]
    x = x.view(*lead, klen + 1, qlen)[..., 1:, :]
    return x.reshape(*lead, qlen, klen)


def sdpa_attention(
    q: tuple[Tensor, Tensor], k: Tensor, v: Tensor, *, r_head_k: Tensor, mask: Tensor, dropout: float
) -> Tensor:
    """softmax(((q+u).k + (q+v).W_{k,R} R) / sqrt(d_h)) v through ``F.scaled_dot_product_attention``.

    Args:
        q: (rw_q, rr_q), [B, L, H, d_h] each, q + u and q + v.
        k, v: [B, K, H, d_h] keys and values of [memory; segment].
        r_head_k: [K, H, d_h] W_{k,R} R of the distances K-1 .. 0.
        mask: bool, True = masked, broadcastable to [B, H, L, K].
        dropout: attention-probability dropout (0 at evaluation).

    Returns:
        [B, L, H d_h].
    """
    rw_q, rr_q = q
    B, L, H, dh = rw_q.shape
    scale = 1.0 / math.sqrt(dh)
    bd = rel_shift(torch.matmul(rr_q.transpose(1, 2), r_head_k.permute(1, 2, 0)))  # [B, H, L, K]
    bias = (bd * scale).masked_fill(mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        rw_q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=bias,
        dropout_p=dropout,
        scale=scale,
    )
    return out.transpose(1, 2).reshape(B, L, H * dh)


def compile_layers(model: Any, **options: Any) -> Any:
    """``torch.compile`` every decoder layer of ``model`` in place (``train.compile``); returns it.

    Layers, not the whole model: the model's step has Python control flow around the cache
    (retrieval, renewal) that would break the graph, while a layer is one graph per input
    shape (recompiled while the memory fills). ``options`` go to ``torch.compile`` (e.g.
    ``backend``).
    """
    for layer in model.layers:
        layer.compile(**options)
    return model
