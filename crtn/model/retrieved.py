"""Attention to retrieved cache segments, weighted by alpha (docs/method.md §3 step 3).

Every query token j attends to the L rows of each of its k retrieved segments Z_{j,1..k},
placed before the memory (docs/method.md §3 step 3):

    keys   from [Z_{j,1}; ...; Z_{j,k}; S; H_t]                 (unweighted)
    values from [a_{j,1} Z_{j,1}; ...; a_{j,k} Z_{j,k}; S; H_t]  (weighted by alpha)

The memory and current segment are shared by all tokens and handled exactly as in
Transformer-XL (``attention.py``). The retrieved rows differ per token, so projecting them per
token (k*L rows of d per token and layer) would cost O(B L k L d^2). Instead the keys and values
of retrieved rows are never formed (docs/method.md §3, "Efficient main pass"):

    (q_j + u) . (W_{k,E} z)  =  (W_{k,E}^T (q_j + u)) . z        query folded into model space
    sum_r p_{j,r} alpha W_v z_r  =  W_v (sum_r p_{j,r} alpha z_r)  mix first, project once

so each token costs O(H d) per retrieved row, and alpha scales the attention probabilities of
its segment. The products with the retrieved rows run grouped by slot, one dense product per
tile of (token, slot) pairs of one slot (``grouped.py``), so a slot's rows are read once per tile,
not once per token. ``tests/test_crtn_reference.py`` checks this against a naive per-token loop that
builds every context explicitly.

The position term of a retrieved row (``cache.pos``, docs/method.md §3 step 3 and "Positions of
retrieved rows") is its place in the concatenated context (``concat``: the columns of the
layer's relative-shift product), its stream distance (:class:`RealPositions`), or the first
plus a distance from its slot's best-matching row (:class:`MatchPositions`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from crtn.model import hardware
from crtn.model.grouped import SlotGroups, TokenRows, grouped_product, pairs_of


@dataclass
class CacheContext:
    """The segments retrieved for each token of the current segment (docs/method.md §3 steps 2-3).

    Shapes: B batch rows, L tokens, k retrieved segments per token, Ls rows per segment,
    d model width, n layers, H heads.

    Attributes:
        values: [n+1, B*N, Ls, d] cached hidden states of every slot (gradient-stopped),
            layer-major so that ``values[layer]`` is one contiguous block.
        index: [B, L, k] flat slot index ``b * N + slot`` of each retrieved segment,
            ordered by stream position, oldest first; None for a :attr:`gate` context before its
            layer selected.
        alpha: retrieval weights of ``index``'s shape (differentiable w.r.t. the query).
        weighted: whether alpha scales the values (``cache.weighted``).
        age: distance in tokens from the current segment's first token to the first token of
            each retrieved segment, ``index``'s shape (for ``cache.pos=real``), else None.
        first_layer: layer i reads ``values[i - first_layer]``: the layer whose input
            ``values[0]`` holds (``cache.layers``: the cache stores only what the retrieving layers
            read), one less where a key layer below them is stored first (``CRTN.value_base``).
        gate: selection inside attention (:class:`crtn.model.gate.Gate`): each retrieving layer
            selects for itself and reads :meth:`selected`; None for a query strategy's selection.
        gate_k: segments a gate selects per token (min(top_k, filled slots)).
        groups: ``index``'s (token, slot) pairs grouped by slot (:meth:`slot_groups`), computed
            once and shared by every layer that reads this selection; None until then.
        product_dtype: dtype of the products with the retrieved rows (``cache.product_dtype``,
            ``grouped.py``), and where 16-bit of the folding's with the weights
            (:func:`weights_dtype`); None: the dtype ``values`` are stored in.
        folded: [B, L, H, d] the layer's folded queries W_{k,E}^T (q + u) where its gate's
            selection computed them with their gradient (:meth:`crtn.model.gate.Gate.select`), so
            that a layer folds its queries once; None: :func:`attend_with_cache` folds them.
        retrieves: [B, L] bool, the tokens that read their retrieved rows (a lookup's, which
            retrieves nothing where no n-gram occurred: ``lookup.py``); the others' rows are
            masked out of the softmax, so they attend to the memory and segment alone, as with
            an empty cache. None: every token reads them.
    """

    values: Tensor
    index: Tensor | None
    alpha: Tensor | None
    weighted: bool
    age: Tensor | None = None
    first_layer: int = 0
    gate: Any = None
    gate_k: int = 0
    groups: SlotGroups | TokenRows | None = None
    product_dtype: torch.dtype | None = None
    folded: Tensor | None = None
    retrieves: Tensor | None = None

    @property
    def k(self) -> int:
        return self.index.shape[-1] if self.index is not None else self.gate_k

    def selected(self, sel: Any, folded: Tensor | None = None) -> CacheContext:
        """This context with a layer's selection ``sel`` (a :class:`crtn.model.cache.Selection`
        [B, L, 1, k]: one group, shared by the heads) as [B, L, k], and the layer's folded
        queries where the selection made them (:attr:`folded`)."""
        index, alpha, age = sel.flat_index[:, :, 0], sel.alpha[:, :, 0], sel.age[:, :, 0]
        return replace(self, index=index, alpha=alpha, age=age, gate=None, groups=None, folded=folded)

    def slot_groups(self) -> SlotGroups | TokenRows:
        """The pairs of ``index`` (flattened to [rows, k]) grouped by slot, or on a GPU read token
        by token (``grouped.py``, :func:`pairs_of`), made on the first call and kept: the query
        pass's selection serves every retrieving layer."""
        if self.groups is None:
            assert self.index is not None
            self.groups = pairs_of(self.index.reshape(-1, self.k), self.values.shape[2:])
        return self.groups

    @property
    def seg_len(self) -> int:
        return self.values.shape[2]


def attend_with_cache(
    attn: Any,
    score: Tensor,
    bd_cache: Tensor,
    *,
    q: tuple[Tensor, Tensor],
    v: Tensor,
    cache: CacheContext,
    layer: int,
    positions: RealPositions | MatchPositions | None,
) -> Tensor:
    """Joint softmax over [retrieved rows; memory; segment] without projecting retrieved rows
    (module docstring; docs/method.md §3 step 3).

    Args:
        attn: the layer's :class:`crtn.model.attention.RelPartialLearnableMultiHeadAttn` (its
            W_{k,E}, W_v, W_{k,R}, LayerNorm, attention dropout and scale).
        score: [B, H, L, M+L] memory/segment scores (unscaled, masked).
        bd_cache: [B, H, L, C] position scores of the retrieved rows at their places in the
            concatenated context (``cache.pos=concat``; empty with ``real``).
        q: (rw_q, rr_q), [B, L, H, d_h] each: q + u and q + v.
        v: [B, M+L, H, d_h] values of memory and segment.
        cache: the retrieved segments; layer: this layer's index (its input in ``cache.values``).
        positions: the position terms of the retrieved rows for ``cache.pos=real`` or ``match``;
            None: ``bd_cache`` alone (``concat``).

    Returns:
        [B, L, H d_h] the attention vectors before the output projection.
    """
    rw_q, rr_q = q
    B, L = rw_q.shape[:2]
    H, dh = attn.n_head, attn.d_head
    assert cache.index is not None and cache.alpha is not None
    C = cache.k * cache.seg_len
    values = cache.values[layer - cache.first_layer]
    groups = cache.slot_groups()
    dtype = products_dtype(cache.product_dtype, values)
    # a gate's selection folded them (in the queries' dtype, with the gradient of its scores)
    folded = fold(attn, rw_q, dtype=weights_dtype(dtype, rw_q)) if cache.folded is None else cache.folded
    ac_c = _folded_scores(attn, folded, values, groups=groups, dtype=dtype)
    ac_c = ac_c.view(B, L, H, C).transpose(1, 2)
    bd_c = bd_cache if positions is None else positions.bd(rr_q, attn.r_net.weight, concat=bd_cache)
    score_c = ac_c + bd_c
    if cache.retrieves is not None:
        score_c = score_c.masked_fill(~cache.retrieves[:, None, :, None], float("-inf"))
    prob = torch.softmax(torch.cat([score_c, score], -1) * attn.scale, dim=-1)
    prob = attn.dropatt(prob)
    prob_c, prob_m = prob.split([C, score.shape[-1]], dim=-1)
    out = torch.matmul(prob_m, v.transpose(1, 2)).transpose(1, 2)  # [B, L, H, dh]
    # value term: mix retrieved rows per head (scaled by alpha), then project with W_v
    prob_c = prob_c.transpose(1, 2)  # [B, L, H, C]
    if cache.weighted:
        alpha = cache.alpha[:, :, None]  # [B, L, 1, k]
        prob_c = (prob_c.view(B, L, H, cache.k, cache.seg_len) * alpha[..., None]).view(B, L, H, C)
    prob_c = prob_c.reshape(B * L, H, C)
    mixed = _folded_mix(attn, prob_c, values, groups=groups, dtype=dtype)
    out = out + mixed.view(B, L, H, dh)
    return out.reshape(B, L, H * dh)


def _folded_scores(
    attn: Any, folded: Tensor, values: Tensor, *, groups: SlotGroups | TokenRows, dtype: torch.dtype | None
) -> Tensor:
    """(q_j + u).W_{k,E} z with the query folded into model space (:func:`fold`): folded
    [B, L, H, d], values [B*N, Ls, d], ``groups`` the pairs of the selection [B*L, k] ->
    [B*L, H, k*Ls]; the products with the rows in ``dtype`` (None: the rows')."""
    B, L, H, _ = folded.shape
    q_model = folded.reshape(-1, H, attn.d_model)
    if attn.pre_lnorm:  # LN(z) = g * n(z) + b, n parameter-free: (g q).n(z) + q.b
        g, b, eps = attn.layer_norm.weight, attn.layer_norm.bias, attn.layer_norm.eps
        q_model = q_model.to(g.dtype)  # the terms of the parameters in their dtype
        out = (
            grouped_product(q_model * g, values, groups, to_rows=True, normalize=True, eps=eps, dtype=dtype)
            + (q_model @ b)[..., None]
        )
    else:
        out = grouped_product(q_model, values, groups, to_rows=True, dtype=dtype)
    return out.reshape(B * L, H, -1)


def fold(attn: Any, rw_q: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Queries folded into model space, qm^h = W_{k,E}^{h T} (q^h + u^h): rw_q [B, L, H, d_h] ->
    [B, L, H, d]; qm^h . x(z) is head h's content score of a row z (module docstring;
    docs/method.md §3, "Efficient main pass"). ``attn``: the layer's
    :class:`crtn.model.attention.RelPartialLearnableMultiHeadAttn`, whose W_{k,E} is read.
    ``dtype``: the product's (both factors cast, the result in it, as autocast runs a matrix
    product; the retrieved attention's ``cache.product_dtype``); None: rw_q's.

    Raises:
        RuntimeError: from ``torch.einsum`` when rw_q's heads do not match the layer's."""
    H, dh = rw_q.shape[-2:]
    w_k = attn.qkv_net.weight.view(3, H, dh, -1)[1]
    dtype = dtype or rw_q.dtype
    return torch.einsum("blhe,hed->blhd", rw_q.to(dtype), w_k.to(dtype))


def _folded_mix(
    attn: Any, prob_c: Tensor, values: Tensor, *, groups: SlotGroups | TokenRows, dtype: torch.dtype | None
) -> Tensor:
    """W_v (sum_r p_r z_r): mix the rows per head first, then project: prob_c [T, H, k*Ls], values
    [B*N, Ls, d], ``groups`` the pairs of the selection [T, k] -> [T, H, d_h]; the products with
    the rows in ``dtype`` (None: the rows')."""
    H = prob_c.shape[1]
    w_v = attn.qkv_net.weight.view(3, H, attn.d_head, attn.d_model)[2]
    if attn.pre_lnorm:
        g, b, eps = attn.layer_norm.weight, attn.layer_norm.bias, attn.layer_norm.eps
        mix = (
            grouped_product(prob_c, values, groups, to_rows=False, normalize=True, eps=eps, dtype=dtype) * g
            + prob_c.sum(-1, keepdim=True) * b
        )
    else:
        mix = grouped_product(prob_c, values, groups, to_rows=False, dtype=dtype)  # [T, H, d]
    w_dtype = weights_dtype(dtype, prob_c)
    # per head [T, d] x [d, dh], the mixed rows one contiguous [H, T, d] factor: the weight
    # gradient reads its transpose, which a CPU's bfloat16 product runs slowly from a permuted view
    heads = mix.transpose(0, 1).to(w_dtype, memory_format=torch.contiguous_format)
    out = torch.bmm(heads, w_v.to(w_dtype).transpose(1, 2))  # [H, T, dh]
    return out.transpose(0, 1).to(prob_c.dtype, memory_format=torch.contiguous_format)


def products_dtype(product_dtype: torch.dtype | None, values: Tensor) -> torch.dtype:
    """The dtype of the products with the cached rows ``values`` [..., Ls, d]: ``product_dtype``
    (``cache.product_dtype``), or where it is None the dtype the rows are stored in where their
    device multiplies it natively, else float32 (a CPU without bfloat16 units:
    :func:`crtn.model.hardware.multiplies_natively`; docs/method.md §3, "The products' dtype")."""
    if product_dtype is not None:
        return product_dtype
    return values.dtype if hardware.multiplies_natively(values.dtype, values.device) else torch.float32


def weights_dtype(dtype: torch.dtype, x: Tensor) -> torch.dtype:
    """The dtype of the folding's products with W_{k,E} and W_v (:func:`fold`, :func:`_folded_mix`;
    a gate's best-row match, :class:`crtn.model.gate.Gate`, multiplies its rows in it too):
    the retrieved attention's product dtype where it is 16-bit, as autocast runs a matrix product
    (the operands are rounded to it before the products with the rows anyway; a CPU's bfloat16
    units run these shapes several times faster than float32: docs/results.md, "The folding in
    bfloat16"), else x's: a float32 product dtype of a float64 model keeps the folding exact."""
    return dtype if dtype.itemsize == 2 else x.dtype


class RealPositions:
    """Position term of retrieved rows at their true stream distance (``cache.pos=real``, docs/method.md §3).

    Row r of a segment whose first token lies ``D`` tokens before the current segment's
    first token is at distance ``D + j - r`` from token j. With R = [sin, cos] and the
    angle-addition formula, ``(q_j + v).W_{k,R} R_{D+j-r}`` equals
    ``rot_D(W_{k,R}^T (q_j + v)) . R_{j-r}``, where rot_D rotates each (sin, cos)
    frequency pair by ``D w``. This costs O(H d) per retrieved row and never embeds
    the (up to m + N L) distinct distances. Distances above ``clamp_len`` use
    ``R_{clamp_len}`` as in Transformer-XL.

    When the position embeddings are dropped out (training with ``dropout`` or ``dropinp``),
    the rotation cannot carry a dropout mask per distance, so the model passes the dropped
    table of every distance (:meth:`with_table`: the table whose rows the memory and the
    current segment use too, as with ``cache.pos=concat``) and the scores are gathered
    from it: O(B L H d_h D) for D distances, in training only.

    Args:
        pos_emb: the model's :class:`crtn.model.attention.PositionalEmbedding`.
        age: [B, L, k] long, distance of each retrieved segment's first row (``Selection.age``),
            or [B, L, n_valid] for every filled slot.
        seg_len: Ls, rows per retrieved segment; q_len: L, tokens in the segment.
        clamp_len: -1 for none.
        dtype: compute dtype.
    """

    #: whether the model keeps the concatenated context's position term of the retrieved rows
    #: (``crtn.model.transformer.TransformerLM.core``): no, these terms replace it
    concat = False

    def __init__(
        self,
        pos_emb: Any,
        age: Tensor,
        seg_len: int,
        q_len: int,
        clamp_len: int,
        dtype: torch.dtype,
    ):
        self.pos_emb, self.seg_len, self.q_len, self.dtype = pos_emb, seg_len, q_len, dtype
        self.age = age
        self.table: Tensor | None = None
        j = torch.arange(q_len, device=age.device)
        r = torch.arange(seg_len, device=age.device)
        self.dist = age[..., None] + (j[None, :, None, None] - r[None, None, None, :])  # [B, L, k, Ls]
        self.rel = pos_emb(j[:, None] - r[None, :], dtype)  # [L, Ls, d]  R_{j-r}
        ang = pos_emb.angles(age)  # [B, L, k, d/2] float64
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)
        self.clamp_len = clamp_len
        if clamp_len > 0:
            self.clamped = self.dist > clamp_len
            self.r_clamp = pos_emb(torch.tensor([float(clamp_len)], device=age.device), dtype)  # [1, d]

    @property
    def max_dist(self) -> int:
        """The largest distance of a retrieved row (tokens)."""
        return int(self.dist.max())

    def with_table(self, table: Tensor) -> RealPositions:
        """Use ``table`` [D, d] (row i: the dropped-out embedding of distance i, clamped as in
        Transformer-XL; D > :attr:`max_dist`) for the position terms; returns self."""
        self.table = table
        return self

    def for_age(self, age: Tensor) -> RealPositions:
        """The position terms of other retrieved segments (a layer's own selection, ``query=gate``)
        with the same table: ``age`` as in the constructor, no farther than :attr:`max_dist`."""
        out = RealPositions(
            self.pos_emb,
            age,
            seg_len=self.seg_len,
            q_len=self.q_len,
            clamp_len=self.clamp_len,
            dtype=self.dtype,
        )
        return out if self.table is None else out.with_table(self.table)

    def bd(self, rr_q: Tensor, r_weight: Tensor, concat: Tensor | None = None) -> Tensor:
        """(q_j + v).W_{k,R} R_{dist} for every retrieved row: rr_q [B, L, H, dh] -> [B, H, L, k*Ls]
        (``concat``, the concatenated context's term, is not used: :attr:`concat` is False)."""
        B, L, H, dh = rr_q.shape
        d = r_weight.shape[1]
        if self.table is not None:
            r_head = F.linear(self.table, r_weight).view(-1, H, dh)  # [D, H, dh]
            every = torch.einsum("blhe,Dhe->bhlD", rr_q, r_head)  # [B, H, L, D]
            index = self.dist.reshape(B, 1, L, -1).expand(B, H, L, self.dist[0, 0].numel())
            return every.gather(-1, index)
        w = torch.einsum("blhe,hed->blhd", rr_q, r_weight.view(H, dh, d))  # [B, L, H, d]
        ws, wc = w[..., None, :, : d // 2], w[..., None, :, d // 2 :]  # [B, L, 1, H, d/2]
        cos, sin = self.cos[:, :, :, None], self.sin[:, :, :, None]  # [B, L, k, 1, d/2]
        rot = torch.cat([ws * cos - wc * sin, ws * sin + wc * cos], -1)  # [B, L, k, H, d]
        bd = torch.einsum("blkhd,lrd->bhlkr", rot, self.rel)  # [B, H, L, k, Ls]
        if self.clamp_len > 0:
            bd_clamp = torch.einsum("blhd,d->bhl", w, self.r_clamp[0])[..., None, None]
            bd = torch.where(self.clamped[:, None], bd_clamp, bd)
        return bd.reshape(B, H, L, -1)


class MatchPositions:
    """Position terms aligned on each selected slot's best-matching row (``cache.pos=match``,
    docs/method.md §3, "Positions of retrieved rows").

    The concatenated context's term of a retrieved row (``concat``) is kept, and a second one is
    added: row r of a slot whose best match (token_max's argmax, :attr:`crtn.model.cache.Selection.row`)
    is row r* sits at distance c + r* - r from every query of the segment, c = m + L + Ls (one
    segment beyond the memory's and the segment's distances 0 .. m + L - 1). Its score is
    (q_j + v).W_{k,R} R_{c + r* - r}, the same W_{k,R} and v as every other distance. With
    ``summary.shift`` 1 the row r* follows the matched n-gram (the token to copy), so the term
    tells the attention which row of the slot is the copy's source: the alignment that a
    contiguous placement gives only when the match lies at the slot's own offset.

    Only 2 Ls - 1 distances occur, so the term costs one product [B, H, L, 2 Ls - 1] per layer
    and a gather of each row's column, r* - r + Ls - 1. Where the model's position table is
    dropped out in training, :meth:`with_table` hands it the same dropped rows (as
    :class:`RealPositions`).

    Args:
        pos_emb: the model's :class:`crtn.model.attention.PositionalEmbedding`.
        best_row: [B, L, k] long, r* of each retrieved segment (0 .. Ls - 1).
        seg_len: Ls, rows per retrieved segment; offset: c, the distance of the matched row.
        clamp_len: -1 for none; distances above it use R_{clamp_len}, as in Transformer-XL.
        dtype: compute dtype.
    """

    concat = True

    def __init__(
        self, pos_emb: Any, best_row: Tensor, *, seg_len: int, offset: int, clamp_len: int, dtype: torch.dtype
    ):
        self.pos_emb, self.best_row, self.seg_len, self.offset = pos_emb, best_row, seg_len, offset
        self.clamp_len, self.dtype = clamp_len, dtype
        self.table: Tensor | None = None
        self._emb: Tensor | None = None  # embeddings(), made once for every retrieving layer
        # [B, 1, L, k*Ls] each row's column of the distances c - Ls + 1 .. : distance c + r* - r
        B, L, k = best_row.shape
        r = torch.arange(seg_len, device=best_row.device)
        self.column = (best_row[..., None] - r + (seg_len - 1)).view(B, 1, L, k * seg_len)

    @property
    def max_dist(self) -> int:
        """The largest distance of a term, c + Ls - 1 (tokens)."""
        return self.offset + self.seg_len - 1

    def with_table(self, table: Tensor) -> MatchPositions:
        """Use ``table`` [D, d] (row i: the dropped-out embedding of distance i, clamped;
        D > :attr:`max_dist`) for the terms; returns self."""
        self.table, self._emb = table, None
        return self

    def embeddings(self) -> Tensor:
        """R of the distances c - Ls + 1 .. c + Ls - 1: [2 Ls - 1, d] (made on the first call,
        then shared by every retrieving layer)."""
        if self._emb is None:
            first, n = self.offset - self.seg_len + 1, 2 * self.seg_len - 1
            if self.table is not None:
                self._emb = self.table[first : first + n]
            else:
                dist = torch.arange(first, first + n, device=self.best_row.device, dtype=torch.float)
                if self.clamp_len > 0:
                    dist = dist.clamp(max=self.clamp_len)
                self._emb = self.pos_emb(dist, self.dtype)
        return self._emb

    def bd(self, rr_q: Tensor, r_weight: Tensor, concat: Tensor | None = None) -> Tensor:
        """``concat`` [B, H, L, k*Ls] plus (q_j + v).W_{k,R} R_{c + r* - r} for every retrieved row:
        rr_q [B, L, H, dh] -> [B, H, L, k*Ls]."""
        B, L, H, dh = rr_q.shape
        r_head = F.linear(self.embeddings(), r_weight).view(-1, H, dh)  # [2Ls-1, H, dh]
        every = torch.einsum("blhe,the->bhlt", rr_q, r_head)  # [B, H, L, 2Ls-1]
        term = every.gather(-1, self.column.expand(B, H, L, self.column.shape[-1]))
        return term if concat is None else concat + term


#: the position terms of retrieved rows other than the concatenated context's alone
RetrievedPositions = RealPositions | MatchPositions
