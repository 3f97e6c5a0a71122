"""Transformer-XL's relative attention through FlexAttention (``model.flex``; docs/method.md §2).

The GPU path of :class:`crtn.model.attention.RelPartialLearnableMultiHeadAttn` over
[memory; segment] (no retrieved rows: those keep the eager path, ``retrieved.py``). Per head,
query i (0..L-1, at position M+i of [memory; segment], M the memory length) and key j (0..K-1,
K = M+L), with s = 1/sqrt(d_h) (Dai et al. 2019, section 3.3, eq. A_rel):

    A[i, j] = s (q_i + u).k_j                      "AC": FlexAttention's own product, q + u its query
            + s (q_i + v).W_{k,R} R_{M+i-j}        "BD": the score_mod
    a_i     = sum_j softmax_j(A[i, j] over the visible j) v_j

FlexAttention computes ``scale * query.key`` and then applies the score_mod, so the score_mod
adds the position term already multiplied by s.

The position term is computed once per call against the K distances K-1, ..., 0 (the order of
``pos_emb``, clamped at ``clamp_len`` by the caller):

    bd_raw = (q + v) (W_{k,R} R)^T                 [B, H, L, K], column c: distance K-1-c

the very tensor that :func:`crtn.model.attention.rel_shift` moves into place. Key j is at
distance M+i-j from query i, so its column is c = K-1-(M+i-j) = L-1-i+j (M cancels): the
score_mod reads ``bd_raw[b, h, i, L-1-i+j]``; no shift and no [B, H, L, K] bias tensor. Future
keys (j > M+i) would read past the last column; their column is clamped to K-1 and the mask
hides them (masked entries take no gradient).

The mask (:func:`block_mask`) is :meth:`crtn.model.transformer.TransformerLM._attn_mask` as a
rule, a FlexAttention ``mask_mod``: key j is visible to query i iff

    j <= M + i                     causal over [memory; segment]
    j >  i - shift                 ``same_length`` only (each query sees as many keys)
    not hidden[b, j]               ``extra_mask``: memory rows hidden from every query of
                                   sequence b (the ``fixed_length_2`` query strategy)

Where it runs (:func:`attend`): on CUDA through ``torch.compile(flex_attention)``, compiled
once per process on first use (fused kernels, forward and backward); on the CPU, for tests:
FlexAttention's unfused implementation without gradients, and with gradients (FlexAttention
has no backward on the CPU) the same score_mod and mask_mod evaluated on broadcast index grids,
a dense softmax (:func:`dense_attention`).

FlexAttention has no attention dropout: ``model.flex`` with ``model.dropatt > 0`` is refused
when the model options are resolved (:func:`check_options`), so training never skips it silently.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from crtn.errors import ConfigError

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # older torch: model.flex is refused at resolution (check_options)
    BlockMask = Any  # type: ignore[misc,assignment]
    create_block_mask = flex_attention = None  # type: ignore[assignment]

#: whether this torch has FlexAttention
AVAILABLE = flex_attention is not None


def check_options(model: Any) -> None:
    """The rules of ``model.flex`` (a :class:`crtn.model.spec.ModelSpec` or any object with its fields).

    Raises:
        ConfigError: ``model.flex`` with ``model.dropatt > 0`` (FlexAttention has no attention dropout); ``model.flex`` on a
            torch without FlexAttention.
    """
    if not model.flex:
        return
    if model.dropatt > 0:
        raise ConfigError(
            f"model.flex=true has no attention dropout, but model.dropatt={model.dropatt}: "
            "set model.dropatt=0 or model.flex=false"
        )
    if not AVAILABLE:
        raise ConfigError(
            f"model.flex=true needs FlexAttention (torch >= 2.5); this is torch {torch.__version__}"
        )


def block_mask(
    L: int, M: int, *, shift: int | None, hidden: Tensor | None, device: torch.device
) -> BlockMask:
    """The visible keys of [memory; segment] as a FlexAttention ``BlockMask`` (module docstring).

    Args:
        L: queries (the segment); M: memory rows, so K = M + L keys.
        shift: ``same_length``: query i sees keys j > i - shift; None: no lower bound.
        hidden: bool [B, K], True hides key j from every query of sequence b, or None.
        device: where the mask is used.

    Returns:
        a ``BlockMask`` for [B or 1, 1, L, K]; its ``mask_mod`` is the rule itself, written with
        broadcasting tensor ops (:func:`dense_attention` evaluates it on index grids).
    """
    if hidden is None:
        return _shared_block_mask(L, M, shift, torch.device(device))
    mask_mod = _mask_mod(M, shift, hidden)
    return create_block_mask(mask_mod, B=hidden.shape[0], H=None, Q_LEN=L, KV_LEN=M + L, device=device)


@functools.lru_cache(maxsize=64)
def _shared_block_mask(L: int, M: int, shift: int | None, device: torch.device) -> BlockMask:
    """:func:`block_mask` without hidden rows, built once per shape (every layer and step share it;
    made outside inference mode, so that a mask first built by an evaluation serves training too)."""
    with torch.inference_mode(False):
        return create_block_mask(
            _mask_mod(M, shift, None), B=None, H=None, Q_LEN=L, KV_LEN=M + L, device=device
        )


def _mask_mod(M: int, shift: int | None, hidden: Tensor | None) -> Callable[..., Tensor]:
    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        keep = kv_idx <= q_idx + M
        if shift is not None:
            keep = keep & (kv_idx > q_idx - shift)
        if hidden is not None:
            keep = keep & ~hidden[b, kv_idx]
        return keep

    return mask_mod


def position_score_mod(bd_raw: Tensor, scale: float) -> Callable[..., Tensor]:
    """The score_mod adding s (q_i + v).W_{k,R} R_{M+i-j}: ``score + scale * bd_raw[b, h, i, L-1-i+j]``.

    Args:
        bd_raw: [B, H, L, K] un-shifted position scores, column c = distance K-1-c.
        scale: s = 1/sqrt(d_h).

    The column of a future key (past K-1) is clamped to K-1, and every column to [0, K-1] (the
    kernels may evaluate padding rows); the mask hides those entries. L and K are read from
    ``bd_raw``'s shape inside the score_mod, so that a compiled kernel sees sizes, not constants.
    """

    def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        L, K = bd_raw.shape[-2], bd_raw.shape[-1]
        col = (L - 1 - q_idx + kv_idx).clamp(0, K - 1)
        return score + bd_raw[b, h, q_idx, col] * scale

    return score_mod


def rel_attention(
    q: tuple[Tensor, Tensor], k: Tensor, v: Tensor, *, r_head_k: Tensor, mask: BlockMask
) -> Tensor:
    """softmax(s (q+u).k + s (q+v).W_{k,R} R) v over [memory; segment] through FlexAttention.

    Args:
        q: (rw_q, rr_q), [B, L, H, d_h] each, q + u and q + v.
        k, v: [B, K, H, d_h] keys and values of [memory; segment].
        r_head_k: [R, H, d_h] W_{k,R} R of the distances R-1 .. 0 (R >= K; the last K rows are
            used: distances K-1 .. 0).
        mask: :func:`block_mask` for L queries and K keys.

    Returns:
        [B, L, H d_h], in the dtype of the attention (autocast's inside autocast).
    """
    rw_q, rr_q = q
    B, L, H, dh = rw_q.shape
    K = k.shape[1]
    scale = 1.0 / math.sqrt(dh)
    bd_raw = torch.einsum("blhd,rhd->bhlr", rr_q, r_head_k[-K:])  # [B, H, L, K], as attention.py's
    dtype = _attention_dtype(rw_q, k)
    query, key, value = (t.transpose(1, 2).to(dtype) for t in (rw_q, k, v))  # [B, H, *, d_h]
    score_mod = position_score_mod(bd_raw, scale)
    out = attend(query, key, value, score_mod=score_mod, mask=mask, scale=scale, captured=(bd_raw,))
    return out.transpose(1, 2).reshape(B, L, H * dh)


def _attention_dtype(q: Tensor, k: Tensor) -> torch.dtype:
    """One dtype for query, key and value (FlexAttention needs it): autocast's where it is on (as
    the eager path's matmuls), else the promoted type (q + u may be wider than k inside autocast)."""
    device = q.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(q.dtype, k.dtype)


def attend(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    score_mod: Callable[..., Tensor],
    mask: BlockMask,
    scale: float,
    captured: tuple[Tensor, ...] = (),
) -> Tensor:
    """FlexAttention where it has kernels; [B, H, L, d_h], [B, H, K, d_h] x2 -> [B, H, L, d_h].

    CUDA: the compiled ``flex_attention`` (:func:`_compiled`), or the plain one inside a graph
    being compiled (``train.compile``). CPU (tests): the unfused ``flex_attention`` without
    gradients, :func:`dense_attention` when ``query``, ``key``, ``value`` or a tensor the
    score_mod reads (``captured``) needs one (FlexAttention refuses backward on the CPU).
    """
    if query.device.type == "cuda":
        fn = flex_attention if torch.compiler.is_compiling() else _compiled()
        return fn(query, key, value, score_mod=score_mod, block_mask=mask, scale=scale)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, *captured))
    if query.device.type == "cpu" and grad:
        return dense_attention(query, key, value, score_mod=score_mod, mask_mod=mask.mask_mod, scale=scale)
    return flex_attention(query, key, value, score_mod=score_mod, block_mask=mask, scale=scale)


@functools.cache
def _compiled() -> Callable[..., Tensor]:
    """``torch.compile(flex_attention)``, made once per process on first use (compilation itself
    happens at the first call of each shape)."""
    return torch.compile(flex_attention)


def dense_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    score_mod: Callable[..., Tensor],
    mask_mod: Callable[..., Tensor],
    scale: float,
) -> Tensor:
    """What FlexAttention computes, unfused: softmax(mask(score_mod(scale q.k))) v, with the
    score_mod and mask_mod evaluated once on broadcast index grids b [B,1,1,1], h [1,H,1,1],
    i [1,1,L,1], j [1,1,1,K] (they must broadcast, as this module's do). For the CPU with
    gradients (tests); [B, H, L, d_h], [B, H, K, d_h] x2 -> [B, H, L, d_h]."""
    B, H, L, _ = query.shape
    idx = index_grids((B, H, L, key.shape[2]), device=query.device)
    score = score_mod(torch.matmul(query, key.transpose(-1, -2)) * scale, *idx)
    score = score.masked_fill(~mask_mod(*idx), float("-inf"))
    return torch.matmul(torch.softmax(score, dim=-1), value)


def index_grids(sizes: tuple[int, int, int, int], device: torch.device) -> tuple[Tensor, ...]:
    """(b, h, q_idx, kv_idx) for ``sizes`` (B, H, L, K) as broadcast index grids, [B,1,1,1],
    [1,H,1,1], [1,1,L,1], [1,1,1,K]: a score_mod or mask_mod written with broadcasting ops, called
    on them, gives its dense values."""
    grids = []
    for dim, n in enumerate(sizes):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        grids.append(torch.arange(n, device=device).view(shape))
    return tuple(grids)
