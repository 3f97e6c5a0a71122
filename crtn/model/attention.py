"""Relative multi-head attention of Transformer-XL (Dai et al. 2019, section 3.3, eq. A_rel;
docs/method.md §2), with retrieved cache segments (``retrieved.py``).

Transformer-XL layer n for segment tau:

    h~ = [SG(m) o h]                                   memory, then the current segment
    q, k, v = h W_q, h~ W_{k,E}, h~ W_v
    A[i, j] = q_i.k_j + q_i.W_{k,R} R_{i-j} + u.k_j + v.W_{k,R} R_{i-j}
            = (q_i + u).k_j  +  (q_i + v).(W_{k,R} R_{i-j})        ("AC" + "BD")
    a = Masked-Softmax(A / sqrt(d_head)) v

The position term "BD" is computed once per distance and moved into place by the relative shift
(:func:`rel_shift`). ``model.flex`` computes the same function through FlexAttention with
BD as its score_mod (``flex.py``, the GPU path). For CRTN (docs/method.md §3 step 3)
every query token also attends to the rows of its retrieved segments:
:func:`crtn.model.retrieved.attend_with_cache`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from crtn.model import flex as flex_path
from crtn.model.dropout import make_dropout
from crtn.model.retrieved import CacheContext, RetrievedPositions, attend_with_cache


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
        flex: attention without retrieved rows through FlexAttention (``model.flex``, ``flex.py``):
            (q + u).k is its product, the position term its score_mod, the mask a BlockMask.

    Raises:
        ValueError: ``flex`` with ``dropatt > 0`` (FlexAttention has no attention dropout).
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
        flex: bool = False,
    ):
        super().__init__()
        if flex and dropatt > 0:
            raise ValueError(f"flex=True has no attention dropout, but dropatt={dropatt}")
        self.n_head, self.d_model, self.d_head = n_head, d_model, d_head
        self.flex = flex
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
        positions: RetrievedPositions | None = None,
        mem_kv: Tensor | None = None,
        kv_out: list[Tensor] | None = None,
        flex_mask: flex_path.BlockMask | None = None,
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
            positions: position terms of retrieved rows for ``cache.pos=real`` or ``match``
                (:mod:`crtn.model.retrieved`); None: those of the concatenated context alone.
            mem_kv: [B, M, 2 H d_h] keys and values of ``mem`` from :meth:`project_memory`,
                when computed once for several passes over the same memory (CRTN).
            kv_out: a list that receives the keys and values of [memory; segment], [B, M+L, 2 H d_h]
                (evaluation keeps them for the next steps, ``evalkv.py``), or None.
            flex_mask: ``attn_mask`` as a FlexAttention BlockMask (:func:`crtn.model.flex.block_mask`);
                with ``flex`` and no ``cache`` the layer attends through FlexAttention; None: eager.

        Returns:
            [B, L, d] the sub-layer output.
        """
        if hasattr(self, "r_w_bias"):
            r_w_bias, r_r_bias = self.r_w_bias, self.r_r_bias
        B, L, _ = h.shape
        H, dh = self.n_head, self.d_head
        q, k, v = self._qkv(h, mem, mem_kv=mem_kv, kv_out=kv_out)
        K = k.shape[1]
        r_head_k = self.r_net(pos_emb).view(-1, H, dh)  # [R, H, dh]

        rw_q = q + r_w_bias  # [B, L, H, dh]
        rr_q = q + r_r_bias
        if self.flex and cache is None and flex_mask is not None:
            attn_vec = flex_path.rel_attention((rw_q, rr_q), k, v, r_head_k=r_head_k, mask=flex_mask)
            return self._output(h, attn_vec)
        ac = torch.matmul(rw_q.transpose(1, 2), k.permute(0, 2, 3, 1))  # [B, H, L, K]
        # one product per head over all B L queries: a batched matmul over [B, H] would expand the
        # position keys [R, H, dh] to a copy per batch row and keep it for the backward pass
        bd = torch.einsum("blhd,rhd->bhlr", rr_q, r_head_k)  # [B, H, L, R]
        bd = rel_shift(bd)
        C = bd.shape[-1] - K  # retrieved rows covered by pos_emb (pos=concat)
        score = ac + bd[..., C:]
        score = score.masked_fill(attn_mask, float("-inf"))

        if cache is None:
            prob = self.dropatt(torch.softmax(score * self.scale, dim=-1))
            attn_vec = torch.matmul(prob, v.transpose(1, 2))  # [B, H, L, dh]
            attn_vec = attn_vec.transpose(1, 2).reshape(B, L, H * dh)
        else:
            if cache.gate is not None:  # selection inside attention: this layer's own top-k
                lead = self._lead_queries(mem, rw_q, r_w_bias, n=cache.gate.summary.query_lead_rows)
                sel, folded = cache.gate.select(self, layer, rw_q, lead)
                cache = cache.selected(sel, folded)
                positions = None if positions is None else positions.for_age(cache.age)
            attn_vec = attend_with_cache(
                self, score, bd[..., :C], q=(rw_q, rr_q), v=v, cache=cache, layer=layer, positions=positions
            )

        return self._output(h, attn_vec)

    def _lead_queries(self, mem: Tensor | None, rw_q: Tensor, r_w_bias: Tensor, *, n: int) -> Tensor | None:
        """q + u of the n positions before the segment (the memory's last n rows; zeros where the
        memory is shorter, as before a stream's first segment): [B, n, H, d_h], for a gate's
        n-gram match (``rw_q`` [B, L, H, d_h] the segment's own); None when n is 0."""
        if n == 0:
            return None
        H, dh = self.n_head, self.d_head
        if mem is None or mem.shape[1] == 0:
            return rw_q.new_zeros(rw_q.shape[0], n, H, dh)
        rows = mem[:, max(0, mem.shape[1] - n) :]
        x = self.layer_norm(rows) if self.pre_lnorm else rows
        q = F.linear(x, self.qkv_net.weight[: H * dh]).view(*rows.shape[:2], H, dh) + r_w_bias
        return F.pad(q, (0, 0, 0, 0, n - rows.shape[1], 0))

    def _qkv(
        self, h: Tensor, mem: Tensor | None, *, mem_kv: Tensor | None, kv_out: list[Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Queries of the current segment, keys and values of [memory; segment] (arguments as in
        :meth:`forward`): q [B, L, H, d_h], k and v [B, M+L, H, d_h]."""
        B, L, _ = h.shape
        H, dh = self.n_head, self.d_head
        if mem_kv is None and mem is not None and mem.shape[1] > 0:
            mem_kv = self.project_memory(mem)
        x = self.layer_norm(h) if self.pre_lnorm else h
        w_q, w_kv = self.qkv_net.weight.split([H * dh, 2 * H * dh])
        q = F.linear(x, w_q).view(B, L, H, dh)
        kv = F.linear(x, w_kv)
        if mem_kv is not None:
            kv = torch.cat([mem_kv, kv], 1)
        if kv_out is not None:
            kv_out.append(kv)
        k, v = kv.view(B, kv.shape[1], 2, H, dh).unbind(2)
        return q, k, v

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
    """One Transformer-XL layer: relative attention then feed-forward (docs/method.md §2).

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
        flex: bool = False,
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
            flex=flex,
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
