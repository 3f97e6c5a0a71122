"""Selection inside attention (``query=gate``; docs/method.md §3, "Selection inside attention").

The modern form of per-token top-k segment retrieval (MoBA, Lu et al. 2025; Native Sparse
Attention, Yuan et al. 2025; landmark attention, Mohtashami and Jaggi 2023) has no separate
query pass: every retrieving layer selects cached segments with its own attention query. For
head h, token j and cached slot i, with x(z) the layer's attention input of a cached row z
(LayerNorm'ed for pre-LN) and q_j^h + u^h the content query of the layer (Transformer-XL's
terms (a) + (c)):

    g_{j,i}^h = score_h(q_j^h + u^h, slot i) / sqrt(d_head)                       (gate score)

where the slot's *block key* decides ``score_h`` (``summary=``):

    mean        <q + u, W_{k,E}^h mean_r x(z_r)>        mean-pooled keys (MoBA, NSA); W is linear,
                                                         so the mean of the projections is the
                                                         projection of the mean: one d-vector per
                                                         slot and layer, stored when it enters
    last_state  <q + u, W_{k,E}^h x(z_last)>            the block's last row (a landmark)
    token_max   max_r <q + u, W_{k,E}^h x(z_r)>         the best row (landmark attention's exact
                                                         block score); with ``summary.ngram`` w and
                                                         ``summary.shift`` s the n-gram row match
                                                         of docs/method.md §3, "Summaries"

The heads' scores are summed (per row, before the block's max) and one top-k serves every head
(landmark's ``max_over_heads`` sums, NSA sums within a head group). The selected slots' rows join
the attention exactly as in step 3 (keys unweighted, values weighted by alpha), with alpha from the
gate scores by ``cache.alpha_norm``, or unweighted (``cache.weighted``).

The queries are folded into model space as in the main pass (``retrieved.py``): with
qm_j^h = W_{k,E}^{h T} (q_j^h + u^h) in R^d, every score is a product with d-vectors of the cache,
B L N d multiply-adds per layer for pooled keys, and no projection
of cached rows. For pre-LN, x(z) = g * n(z) + b with n the parameter-free normalisation: the
cache stores n(z) pooled (mean or last row: linear in n(z)), and the scores use
(g * qm) . pooled + qm . b; the rows of ``token_max`` are normalised with g and b when scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from crtn.model.cache import SegmentCache, Selection
from crtn.model.retrieved import fold, products_dtype, weights_dtype
from crtn.model.rowmatch import ngram_row_scores
from crtn.model.summary import Summary


def normalized(rows: Tensor, eps: float) -> Tensor:
    """n(z): LayerNorm without its weight and bias, over the last axis (pre-LN's attention input
    is g * n(z) + b)."""
    return F.layer_norm(rows, (rows.shape[-1],), eps=eps)


def block_keys(states: Tensor, summary: Summary, pre_lnorm: bool, eps: float) -> Tensor | None:
    """The pooled block keys of one new slot at every retrieving layer, stored by the cache.

    Args:
        states: [n_ret, B, Ls, d] the slot's inputs of the retrieving layers.
        summary: the pooling (``mean``, ``last_state``); ``token_max`` keeps the rows themselves
            (None is returned: the cache reads its stored states).
        pre_lnorm: pool n(z) (pre-LN) instead of z.

    Returns:
        [B, n_ret, d] or None.
    """
    if not summary.stores_key:
        return None
    return summary.stored_key(normalized(states, eps) if pre_lnorm else states).transpose(0, 1)


@dataclass
class Gate:
    """What the retrieving layers need to select inside attention during one step.

    Attributes:
        cache: the stream's cache (its values, block keys and positions).
        summary: the block key (module docstring).
        top_k, alpha_norm: as in :meth:`SegmentCache.choose`.
        detach: no gradient from the gate scores into the layer's query q + u (``query.detach``;
            the key projection W_{k,E} still learns from them).
        first_layer: the first retrieving layer (``cache.values[0]`` holds its input).
        t0: stream position of the segment's first token.
        product_dtype: the retrieved attention's product dtype (``cache.product_dtype``; None:
            the dtype the cache stores). Where it is 16-bit the gate multiplies its folded
            queries with the rows of ``token_max`` in it, with a gradient and without, as the
            retrieved attention multiplies its rows (:func:`crtn.model.retrieved.weights_dtype`;
            docs/results.md, "The best-row gate's products in bfloat16"); otherwise in the
            queries' dtype. The folding itself stays in the queries' dtype.
        selections: the selection of every retrieving layer run so far, in order.
    """

    cache: SegmentCache
    summary: Summary
    top_k: int
    alpha_norm: str
    detach: bool
    first_layer: int
    t0: int
    product_dtype: torch.dtype | None = None
    selections: list[Selection] = field(default_factory=list)

    def select(
        self, attn: Any, layer: int, rw_q: Tensor, lead_q: Tensor | None
    ) -> tuple[Selection, Tensor | None]:
        """The selection of layer ``layer`` for every token: top-k by the gate scores.

        Args:
            attn: the layer's :class:`crtn.model.attention.RelPartialLearnableMultiHeadAttn`.
            rw_q: [B, L, H, d_h] the layer's content queries q + u.
            lead_q: [B, w-1, H, d_h] the same for the w-1 positions before the segment (the
                memory's last rows; zeros where there is none), for an n-gram match (w > 1).

        Returns:
            a :class:`Selection` of shape [B, L, 1, k] (one group: the heads share it), also
            appended to :attr:`selections`; and the segment's folded queries [B, L, H, d]
            (:func:`crtn.model.retrieved.fold` of ``rw_q``) for the layer's retrieved attention,
            which reads the same W_{k,E}^T (q + u), so a layer folds them once; None with
            :attr:`detach`, where the selection's are folded from q + u without its gradient.
        """
        q = torch.cat([lead_q, rw_q], 1) if lead_q is not None else rw_q
        # folded in the queries' dtype, whatever the product dtype: folded in bfloat16, the top
        # layer's selection did not learn to find the copy (docs/results.md, "The best-row
        # gate's products in bfloat16")
        qm = fold(attn, q.detach() if self.detach else q)  # [B, Lq, H, d]; W_{k,E} keeps its gradient
        folded = None if self.detach else qm[:, q.shape[1] - rw_q.shape[1] :]
        qm = qm.sum(2, keepdim=True)  # [B, Lq, 1, d]: the heads' scores summed
        scores = self._scores(attn, layer, qm) * (1.0 / math.sqrt(attn.d_head))
        sel = self.cache.choose(scores, top_k=self.top_k, alpha_norm=self.alpha_norm, t0=self.t0)
        self.selections.append(sel)
        return sel, folded

    def _dtype(self, q: Tensor) -> torch.dtype:
        """The dtype of the gate's products (:attr:`product_dtype`) for queries ``q``."""
        return weights_dtype(products_dtype(self.product_dtype, self.cache.values), q)

    def _scores(self, attn: Any, layer: int, qm: Tensor) -> Tensor:
        """Unscaled block scores [B, L, G, n_valid] of folded queries qm [B, Lq, G, d] (Lq - L lead
        queries before the segment for an n-gram match)."""
        cache, nv = self.cache, self.cache.n_valid
        L = qm.shape[1] - self.summary.query_lead_rows
        if cache.keys is not None:  # pooled keys: [B, N, n_ret, d] -> this layer's [B, nv, d]
            return self._pooled(attn, qm[:, -L:], cache.keys[:, :nv, layer - self.first_layer])
        rows = cache.layer_values(layer - self.first_layer)[:, :nv]  # [B, nv, Ls, d]
        return self._row_scores(attn, qm, rows)  # token_max: the row match on every slot

    def _pooled(self, attn: Any, qm: Tensor, keys: Tensor) -> Tensor:
        """Scores [B, L, G, n] of qm [B, L, G, d] against pooled keys [B, n, d]: with pre-LN,
        x = g * n(z) + b pooled linearly, (g * qm) . pooled + qm . b."""
        keys = keys.to(qm.dtype)
        if not attn.pre_lnorm:
            return torch.einsum("blgd,bnd->blgn", qm, keys)
        ln = attn.layer_norm
        return torch.einsum("blgd,bnd->blgn", qm * ln.weight, keys) + (qm @ ln.bias)[..., None]

    def _row_scores(self, attn: Any, qm: Tensor, rows: Tensor) -> Tensor:
        """token_max's row match (max over rows, or the n-gram match) of qm [B, Lq, G, d] against
        rows [B, nv, Ls, d] (LayerNorm'ed for pre-LN), on every slot: [B, L, G, nv]."""
        B, Lq, G, d = qm.shape
        ln = attn.layer_norm
        if attn.pre_lnorm:  # normalised in the queries' dtype (the cache may store another)
            rows = F.layer_norm(rows.to(qm.dtype), (d,), weight=ln.weight, bias=ln.bias, eps=ln.eps)
        # otherwise the rows as stored: the match casts them chunk by chunk where they are stored
        # in another dtype than its products', multiplies in the same dtype with a gradient or
        # without (bf16_products=False: evaluation selects as training does), and keeps the
        # cache's own tensor for its backward pass, not a copy of every slot's rows
        lead = None
        if self.summary.lead_rows > 0:  # the rows before each slot: its predecessor's last ones
            lead = self.cache._lead_in(self.summary.lead_rows).rows(rows)
        q = qm.transpose(1, 2).reshape(B * G, Lq, d)
        rows, lead = _per_group(rows, G), None if lead is None else _per_group(lead, G)
        w, s = self.summary.ngram, self.summary.shift
        scores = ngram_row_scores(
            q, rows, lead, ngram=w, shift=s, bf16_products=False, product_dtype=self._dtype(q)
        )  # [B*G, L, n]
        return scores.view(B, G, -1, scores.shape[-1]).transpose(1, 2)


def _per_group(x: Tensor, G: int) -> Tensor:
    """[B, ...] -> [B*G, ...]: the same tensor for each of G head groups (a view when G = 1)."""
    return x if G == 1 else x[:, None].expand(x.shape[0], G, *x.shape[1:]).reshape(-1, *x.shape[1:])
