"""Relative multi-head attention of Transformer-XL, extended with retrieved cache segments.

Transformer-XL layer n for segment tau (SPEC §2; Dai et al. 2019, eq. A_rel; seed 000):

    h~ = [SG(m) o h]                                   memory, then the current segment
    q, k, v = h W_q, h~ W_{k,E}, h~ W_v
    A[i, j] = q_i.k_j + q_i.W_{k,R} R_{i-j} + u.k_j + v.W_{k,R} R_{i-j}
            = (q_i + u).k_j  +  (q_i + v).(W_{k,R} R_{i-j})        ("AC" + "BD")
    a = Masked-Softmax(A / sqrt(d_head)) v

For CRTN (SPEC §3 step 3) every query token j also attends to the L rows of each of
its k retrieved segments Z_{j,1..k}, placed before the memory:

    keys   from [Z_{j,1}; ...; Z_{j,k}; S; H_t]                 (unweighted)
    values from [a_{j,1} Z_{j,1}; ...; a_{j,k} Z_{j,k}; S; H_t]  (weighted by alpha)

The memory and current segment are shared by all tokens and handled exactly as in
Transformer-XL. The retrieved rows differ per token, so projecting them per token
(k*L rows of d per token and layer) would cost O(B L k L d^2). Instead the keys
and values of retrieved rows are never formed (SPEC §3, "Efficient main pass"):

    (q_j + u) . (W_{k,E} z)  =  (W_{k,E}^T (q_j + u)) . z        query folded into model space
    sum_r p_{j,r} alpha W_v z_r  =  W_v (sum_r p_{j,r} alpha z_r)  mix first, project once

so each token costs O(H d) per retrieved row, and alpha scales the attention
probabilities of its segment. ``tests/test_crtn_reference.py`` checks this against
a naive per-token loop that builds every context explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from crtn.model.dropout import make_dropout
from crtn.model.evalkv import kv_mix, kv_scores
from crtn.model.fused import rel_shift, sdpa_attention


class PositionalEmbedding(nn.Module):
    """Sinusoid embedding of relative distances, R[p] = [sin(p w), cos(p w)] (Vaswani et al. 2017).

    ``w_i = 10000^(-2i/d)``, i = 0..d/2-1, as in the Transformer-XL release. Angles are
    computed in float64 so that long distances (CRTN's ``cache.pos=real``) stay exact.

    Args:
        d_model: embedding width d (even).
    """

    def __init__(self, d_model: int):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0.0, d_model, 2.0, dtype=torch.float64) / d_model))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def angles(self, pos: Tensor) -> Tensor:
        """``pos[..., None] * w`` in float64: [...] -> [..., d/2]."""
        return pos.to(torch.float64)[..., None] * self.inv_freq.to(torch.float64)

    def forward(self, pos: Tensor, dtype: torch.dtype) -> Tensor:
        """Embed distances ``pos`` [...] (any real values) -> [..., d] in ``dtype``."""
        ang = self.angles(pos)
        return torch.cat([ang.sin(), ang.cos()], -1).to(dtype)


@dataclass
class CacheContext:
    """The segments retrieved for each token of the current segment (SPEC §3 steps 2-3).

    Shapes: B batch rows, L tokens, k retrieved segments per token, Ls rows per segment,
    d model width, n layers.

    Attributes:
        values: [n+1, B*N, Ls, d] cached hidden states of every slot (gradient-stopped),
            layer-major so that ``values[layer]`` is one contiguous block.
        index: [B, L, k] flat slot index ``b * N + slot`` of each retrieved segment,
            ordered by stream position, oldest first.
        alpha: [B, L, k] retrieval weights (differentiable w.r.t. the query).
        weighted: whether alpha scales the values (``cache.weighted``).
        age: [B, L, k] distance in tokens from the current segment's first token to the
            first token of each retrieved segment (for ``cache.pos=real``), else None.
        first_layer: the layer whose input ``values[0]`` holds (``cache.layers``: the cache
            stores only what the retrieving layers read); layer i reads ``values[i - first_layer]``.
        kv: [n_kv, 2, B*N, H, Ls, d_h] projected keys and values of every slot (evaluation,
            ``crtn/model/evalkv.py``; layer i reads ``kv[i - first_layer]``), or None.
    """

    values: Tensor
    index: Tensor
    alpha: Tensor
    weighted: bool
    age: Tensor | None = None
    first_layer: int = 0
    kv: Tensor | None = None

    @property
    def k(self) -> int:
        return self.index.shape[-1]

    @property
    def seg_len(self) -> int:
        return self.values.shape[2]


class _RetrievedProduct(torch.autograd.Function):
    """Batched product of per-token operands with each token's retrieved rows, never materialised.

    For token n, let Z_n = f(values[index[n]]) be its k retrieved segments' rows, [k*Ls, d]
    (f: cast to the compute dtype, and a parameter-free LayerNorm when ``normalize``).

        mode "scores":  a [T, H, d] -> a_n Z_n^T  [T, H, k*Ls]     (d/da: g_n Z_n)
        mode "mix":     a [T, H, k*Ls] -> a_n Z_n  [T, H, d]       (d/da: g_n Z_n^T)

    Z is gathered chunk by chunk into a small buffer that stays in cache, and gathered
    again in backward instead of being saved: a plain gather would allocate and keep
    T*k*Ls*d values per layer (134 MB at B=16, L=64, k=2, d=256). No gradient flows to
    the cached values (they are gradient-stopped, SPEC §3). ``values`` is saved with
    ``save_for_backward`` (no copy), so a backward pass after the cache was renewed in
    place raises autograd's "modified by an inplace operation" error instead of
    silently using the new values.
    """

    @staticmethod
    def forward(
        ctx, a: Tensor, values: Tensor, index: Tensor, mode: str, normalize: bool, eps: float
    ) -> Tensor:
        ctx.mode, ctx.normalize, ctx.eps = mode, normalize, eps
        ctx.save_for_backward(values, index)
        T, k = index.shape
        C, d = k * values.shape[1], values.shape[2]
        out = a.new_empty(T, a.shape[1], C if mode == "scores" else d)
        for s, e, z in _retrieved_chunks(values, index, a.dtype, normalize=normalize, eps=eps):
            torch.bmm(a[s:e], z.transpose(1, 2) if mode == "scores" else z, out=out[s:e])
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        values, index = ctx.saved_tensors
        grad = grad.contiguous()
        T = index.shape[0]
        C, d = index.shape[1] * values.shape[1], values.shape[2]
        out = grad.new_empty(T, grad.shape[1], d if ctx.mode == "scores" else C)
        for s, e, z in _retrieved_chunks(values, index, grad.dtype, normalize=ctx.normalize, eps=ctx.eps):
            torch.bmm(grad[s:e], z if ctx.mode == "scores" else z.transpose(1, 2), out=out[s:e])
        return out, None, None, None, None, None


def _retrieved_chunks(values: Tensor, index: Tensor, dtype: torch.dtype, normalize: bool, eps: float):
    """Yield (start, end, Z[start:end]) with Z [end-start, k*Ls, d] gathered into a reused buffer."""
    T, k = index.shape
    Ls, d = values.shape[1], values.shape[2]
    per_token = k * Ls * d
    # CPU: ~4 MB chunks stay in cache and reuse one allocation; GPU: one chunk
    chunk = T if values.is_cuda else max(1, min(T, (1 << 20) // per_token))
    buf = torch.empty(chunk * k, Ls, d, dtype=values.dtype, device=values.device)
    for s in range(0, T, chunk):
        e = min(T, s + chunk)
        z = torch.index_select(values, 0, index[s:e].reshape(-1), out=buf[: (e - s) * k])
        z = z.view(e - s, k * Ls, d).to(dtype)
        if normalize:
            z = F.layer_norm(z, (d,), eps=eps)
        yield s, e, z


def retrieved_product(
    a: Tensor, values: Tensor, index: Tensor, mode: str, normalize: bool = False, eps: float = 1e-5
) -> Tensor:
    """Per-token products with the retrieved segments' rows (SPEC §3 step 3, the cache part of
    the main pass), computed without materialising the gathered rows; see :class:`_RetrievedProduct`.

    Args:
        a: [T, H, d] (``mode="scores"``) or [T, H, k*Ls] (``mode="mix"``), one row per token.
        values: [B*N, Ls, d] one layer of the cache (gradient-stopped; cast to ``a``'s dtype).
        index: [T, k] long, rows of ``values`` retrieved by each token.
        mode: ``"scores"`` -> [T, H, k*Ls]; ``"mix"`` -> [T, H, d].
        normalize: apply a parameter-free LayerNorm (``eps``) to the rows first (pre-LN).

    Raises:
        RuntimeError: from ``torch.bmm`` when the shapes above do not hold.
    """
    return _RetrievedProduct.apply(a, values, index, mode, normalize, eps)


class RelPartialLearnableMultiHeadAttn(nn.Module):
    """Transformer-XL relative attention (release ``attn_type=0``), optionally over retrieved segments.

    Parameter names follow the Transformer-XL release so that weights convert 1:1:
    ``qkv_net`` (W_q, W_{k,E}, W_v stacked, no bias), ``r_net`` (W_{k,R}), ``o_net``,
    ``layer_norm``; ``r_w_bias`` (u) and ``r_r_bias`` (v) when ``untie_r``.

    Args:
        n_head, d_model, d_head: heads H, model width d, head width d_h.
        dropout: on the output projection; dropatt: on the attention probabilities.
        pre_lnorm: LayerNorm before attention (on memory and segment) instead of after.
        untie_r: own u, v per layer instead of the model's shared pair.
        locked: locked (variational) dropout on the output instead of elementwise.
        sdpa: attention without retrieved rows through ``F.scaled_dot_product_attention``
            (``model.sdpa``): (q + u).k is its product, the position term its additive mask.
    """

    def __init__(
        self,
        n_head: int,
        d_model: int,
        d_head: int,
        dropout: float,
        dropatt: float = 0.0,
        pre_lnorm: bool = False,
        layer_norm_eps: float = 1e-5,
        untie_r: bool = False,
        locked: bool = False,
        sdpa: bool = False,
    ):
        super().__init__()
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.sdpa = sdpa
        self.qkv_net = nn.Linear(d_model, 3 * n_head * d_head, bias=False)
        self.r_net = nn.Linear(d_model, n_head * d_head, bias=False)
        self.o_net = nn.Linear(n_head * d_head, d_model, bias=False)
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.drop = make_dropout(dropout, locked)
        self.dropatt = nn.Dropout(dropatt)
        self.scale = 1.0 / math.sqrt(d_head)
        self.pre_lnorm = pre_lnorm
        if untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(n_head, d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(n_head, d_head))

    def forward(
        self,
        h: Tensor,
        pos_emb: Tensor,
        *,
        r_w_bias: Tensor | None,
        r_r_bias: Tensor | None,
        attn_mask: Tensor,
        mem: Tensor | None = None,
        cache: CacheContext | None = None,
        layer: int = 0,
        real_pos: RealPositions | None = None,
        mem_kv: Tensor | None = None,
        kv_out: list[Tensor] | None = None,
    ) -> Tensor:
        """One attention sub-layer (residual and LayerNorm included).

        Args:
            h: [B, L, d] current segment H_t (layer input).
            pos_emb: [C+M+L, d] sinusoid embeddings of distances C+M+L-1 ... 0, where C is
                the number of retrieved rows per token (0 without cache, or with
                ``cache.pos=real``) and M the memory length.
            r_w_bias, r_r_bias: [H, d_h] u and v (ignored when the layer owns its own).
            attn_mask: bool, True = masked; [L, M+L] or broadcastable [B', 1, L, M+L],
                over the memory and current segment only (retrieved rows are all visible).
            mem: [B, M, d] short-term memory S at this layer (gradient-stopped), or None.
            cache: the retrieved segments (CRTN main pass), or None.
            layer: index of this layer's input in ``cache.values``.
            real_pos: position terms of retrieved rows for ``cache.pos=real``.
            mem_kv: [B, M, 2 H d_h] keys and values of ``mem`` from :meth:`project_memory`,
                when computed once for several passes over the same memory (CRTN).
            kv_out: a list that receives the keys and values of [memory; segment], [B, M+L, 2 H d_h]
                (evaluation keeps them for the next steps, ``evalkv.py``), or None.

        Returns:
            [B, L, d] the sub-layer output.
        """
        if hasattr(self, "r_w_bias"):
            r_w_bias, r_r_bias = self.r_w_bias, self.r_r_bias
        B, L, _ = h.shape
        H, dh = self.n_head, self.d_head
        if mem_kv is None and mem is not None and mem.shape[1] > 0:
            mem_kv = self.project_memory(mem)
        # queries only for the current segment; keys and values for memory and segment
        x = self.layer_norm(h) if self.pre_lnorm else h
        w_q, w_kv = self.qkv_net.weight.split([H * dh, 2 * H * dh])
        q = F.linear(x, w_q).view(B, L, H, dh)
        kv = F.linear(x, w_kv)
        if mem_kv is not None:
            kv = torch.cat([mem_kv, kv], 1)
        if kv_out is not None:
            kv_out.append(kv)
        K = kv.shape[1]
        k, v = kv.view(B, K, 2, H, dh).unbind(2)
        r_head_k = self.r_net(pos_emb).view(-1, H, dh)  # [R, H, dh]

        rw_q = q + r_w_bias  # [B, L, H, dh]
        rr_q = q + r_r_bias
        if self.sdpa and cache is None:
            drop = self.dropatt.p if self.training else 0.0
            attn_vec = sdpa_attention((rw_q, rr_q), k, v, r_head_k=r_head_k, mask=attn_mask, dropout=drop)
            return self._output(h, attn_vec)
        ac = torch.matmul(rw_q.transpose(1, 2), k.permute(0, 2, 3, 1))  # [B, H, L, K]
        bd = torch.matmul(rr_q.transpose(1, 2), r_head_k.permute(1, 2, 0))  # [B, H, L, R]
        bd = rel_shift(bd)
        C = bd.shape[-1] - K  # retrieved rows covered by pos_emb (pos=concat)
        score = ac + bd[..., C:]
        score = score.masked_fill(attn_mask, float("-inf"))

        if cache is None:
            prob = self.dropatt(torch.softmax(score * self.scale, dim=-1))
            attn_vec = torch.matmul(prob, v.transpose(1, 2))  # [B, H, L, dh]
            attn_vec = attn_vec.transpose(1, 2).reshape(B, L, H * dh)
        else:
            attn_vec = self._attend_with_cache(
                score, bd[..., :C], q=(rw_q, rr_q), v=v, cache=cache, layer=layer, real_pos=real_pos
            )

        return self._output(h, attn_vec)

    def _output(self, h: Tensor, attn_vec: Tensor) -> Tensor:
        """Output projection, dropout, residual and (post-LN) LayerNorm: attn_vec [B, L, H d_h] -> [B, L, d]."""
        attn_out = self.drop(self.o_net(attn_vec))
        if self.pre_lnorm:
            return h + attn_out
        return self.layer_norm(h + attn_out)

    def project_memory(self, mem: Tensor) -> Tensor:
        """Keys and values of memory rows, W_{k,E} and W_v of (LayerNorm'ed) ``mem`` [B, M, d] -> [B, M, 2 H d_h]."""
        x = self.layer_norm(mem) if self.pre_lnorm else mem
        return F.linear(x, self.qkv_net.weight[self.n_head * self.d_head :])

    def _attend_with_cache(
        self,
        score: Tensor,
        bd_cache: Tensor,
        *,
        q: tuple[Tensor, Tensor],
        v: Tensor,
        cache: CacheContext,
        layer: int,
        real_pos: RealPositions | None,
    ) -> Tensor:
        """Joint softmax over [retrieved rows; memory; segment] without projecting retrieved rows.

        score: [B, H, L, M+L] memory/segment scores; bd_cache: [B, H, L, C] position scores
        of the retrieved rows (``pos=concat``); q = (rw_q, rr_q): [B, L, H, d_h] q+u, q+v;
        v: [B, M+L, H, d_h]. Returns [B, L, H d_h].
        """
        rw_q, rr_q = q
        B, L = rw_q.shape[:2]
        H, dh = self.n_head, self.d_head
        index = cache.index.reshape(B * L, cache.k)
        C = cache.k * cache.seg_len
        kv = None if cache.kv is None else cache.kv[layer - cache.first_layer]  # [2, B*N, H, Ls, dh]
        if kv is not None:  # evaluation: projected keys kept (evalkv.py)
            ac_c = kv_scores(rw_q.reshape(B * L, H, dh), kv, index)
        else:
            ac_c = self._folded_scores(rw_q, cache.values[layer - cache.first_layer], index)
        ac_c = ac_c.view(B, L, H, C).transpose(1, 2)
        if real_pos is not None:
            bd_c = real_pos.bd(rr_q, self.r_net.weight)  # [B, H, L, C]
        else:
            bd_c = bd_cache
        score_c = ac_c + bd_c
        prob = torch.softmax(torch.cat([score_c, score], -1) * self.scale, dim=-1)
        prob = self.dropatt(prob)
        prob_c, prob_m = prob.split([C, score.shape[-1]], dim=-1)
        out = torch.matmul(prob_m, v.transpose(1, 2)).transpose(1, 2)  # [B, L, H, dh]
        # value term: mix retrieved rows per head (scaled by alpha), then project with W_v
        prob_c = prob_c.transpose(1, 2)  # [B, L, H, C]
        if cache.weighted:
            seg = cache.seg_len
            prob_c = (prob_c.view(B, L, H, cache.k, seg) * cache.alpha[:, :, None, :, None]).view(B, L, H, C)
        prob_c = prob_c.reshape(B * L, H, C)
        if kv is not None:
            mixed = kv_mix(prob_c, kv, index)  # [B*L, H, dh]
        else:
            mixed = self._folded_mix(prob_c, cache.values[layer - cache.first_layer], index)
        out = out + mixed.view(B, L, H, dh)
        return out.reshape(B, L, H * dh)

    def _folded_scores(self, rw_q: Tensor, values: Tensor, index: Tensor) -> Tensor:
        """(q_j + u).W_{k,E} z with the query folded into model space: rw_q [B, L, H, d_h],
        values [B*N, Ls, d], index [B*L, k] -> [B*L, H, k*Ls]."""
        B, L, H, dh = rw_q.shape
        w_k = self.qkv_net.weight.view(3, H, dh, self.d_model)[1]
        q_model = torch.einsum("blhe,hed->blhd", rw_q, w_k).reshape(B * L, H, self.d_model)
        if self.pre_lnorm:  # LN(z) = g * n(z) + b, n parameter-free: (g q).n(z) + q.b
            g, b, eps = self.layer_norm.weight, self.layer_norm.bias, self.layer_norm.eps
            return (
                retrieved_product(q_model * g, values, index, mode="scores", normalize=True, eps=eps)
                + (q_model @ b)[..., None]
            )
        return retrieved_product(q_model, values, index, "scores")

    def _folded_mix(self, prob_c: Tensor, values: Tensor, index: Tensor) -> Tensor:
        """W_v (sum_r p_r z_r): mix the rows per head first, then project: prob_c [T, H, k*Ls],
        values [B*N, Ls, d], index [T, k] -> [T, H, d_h]."""
        H, dh = self.n_head, self.d_head
        w_v = self.qkv_net.weight.view(3, H, dh, self.d_model)[2]
        if self.pre_lnorm:
            g, b, eps = self.layer_norm.weight, self.layer_norm.bias, self.layer_norm.eps
            mix = (
                retrieved_product(prob_c, values, index, mode="mix", normalize=True, eps=eps) * g
                + prob_c.sum(-1, keepdim=True) * b
            )
        else:
            mix = retrieved_product(prob_c, values, index, "mix")  # [T, H, d]
        return torch.einsum("nhd,hed->nhe", mix, w_v)


class RealPositions:
    """Position term of retrieved rows at their true stream distance (``cache.pos=real``, SPEC §3).

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
        pos_emb: the model's :class:`PositionalEmbedding`.
        age: [B, L, k] long, distance of each retrieved segment's first row (``Selection.age``).
        seg_len: Ls, rows per retrieved segment; q_len: L, tokens in the segment.
        clamp_len: -1 for none.
        dtype: compute dtype.
    """

    def __init__(
        self,
        pos_emb: PositionalEmbedding,
        age: Tensor,
        seg_len: int,
        q_len: int,
        clamp_len: int,
        dtype: torch.dtype,
    ):
        self.pos_emb = pos_emb
        self.age = age  # [B, L, k] long
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

    def bd(self, rr_q: Tensor, r_weight: Tensor) -> Tensor:
        """(q_j + v).W_{k,R} R_{dist} for every retrieved row: rr_q [B, L, H, dh] -> [B, H, L, k*Ls]."""
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


class PositionwiseFF(nn.Module):
    """Position-wise feed-forward sub-layer, ReLU(x W1 + b1) W2 + b2, residual and LayerNorm.

    Names follow the Transformer-XL release (``CoreNet``, ``layer_norm``). x: [..., d] -> [..., d].
    ``dropout`` applies after the ReLU and after W2 (``model.dropfor``, default ``model.dropout``),
    locked over time with ``locked``.
    """

    def __init__(
        self,
        d_model: int,
        d_inner: int,
        dropout: float,
        pre_lnorm: bool = False,
        layer_norm_eps: float = 1e-5,
        locked: bool = False,
    ):
        super().__init__()
        self.CoreNet = nn.Sequential(
            nn.Linear(d_model, d_inner),
            nn.ReLU(inplace=True),
            make_dropout(dropout, locked),
            nn.Linear(d_inner, d_model),
            make_dropout(dropout, locked),
        )
        self.layer_norm = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.pre_lnorm = pre_lnorm

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_lnorm:
            return x + self.CoreNet(self.layer_norm(x))
        return self.layer_norm(x + self.CoreNet(x))


class RelPartialLearnableDecoderLayer(nn.Module):
    """One Transformer-XL layer: relative attention then feed-forward (SPEC §2).

    ``dropout`` applies to the attention output and inside the feed-forward unless
    ``dropatt_out`` / ``dropfor`` set their own rates (the CRTN authors' recipe); ``locked``
    makes them variational (one mask per sequence, shared over time).
    """

    def __init__(
        self,
        *,
        n_head: int,
        d_model: int,
        d_head: int,
        d_inner: int,
        dropout: float,
        dropatt: float = 0.0,
        pre_lnorm: bool = False,
        layer_norm_eps: float = 1e-5,
        untie_r: bool = False,
        dropfor: float | None = None,
        dropatt_out: float | None = None,
        locked: bool = False,
        sdpa: bool = False,
    ):
        super().__init__()
        self.dec_attn = RelPartialLearnableMultiHeadAttn(
            n_head,
            d_model,
            d_head,
            dropout=dropout if dropatt_out is None else dropatt_out,
            dropatt=dropatt,
            pre_lnorm=pre_lnorm,
            layer_norm_eps=layer_norm_eps,
            untie_r=untie_r,
            locked=locked,
            sdpa=sdpa,
        )
        self.pos_ff = PositionwiseFF(
            d_model,
            d_inner,
            dropout if dropfor is None else dropfor,
            pre_lnorm=pre_lnorm,
            layer_norm_eps=layer_norm_eps,
            locked=locked,
        )

    def forward(self, h: Tensor, pos_emb: Tensor, **attn: Any) -> Tensor:
        """h [B, L, d] -> [B, L, d]; ``attn``: the keyword arguments of
        :meth:`RelPartialLearnableMultiHeadAttn.forward`."""
        return self.pos_ff(self.dec_attn(h, pos_emb, **attn))
