"""The language model: ``vanilla``, ``txl`` (Transformer-XL) and ``crtn`` on one code path (SPEC §2-3).

Batch-first throughout: tokens [B, L] -> per-token NLL [B, L] (nats) and a new
:class:`State` that carries the recurrence to the next segment of the same streams.

- ``vanilla``: relative-position Transformer, each segment sees only itself (mem_len 0).
- ``txl``: plus the short-term memory S of the last ``mem_len`` positions at every
  layer, gradient-stopped (Dai et al. 2019, segment-level recurrence).
- ``crtn``: plus the key-value cache of the ``n_slot`` most recent segments that left
  S. One step (SPEC §3):

    1. query pass: the Transformer over X_t with S (and at least X_{t-1}) as memory and
       no cache; its top layer R_cur feeds the query strategy -> q_j for every token;
    2. selection: top-k cached segments and weights alpha per token (``cache.py``);
    3. main pass: Transformer-XL attention over [retrieved segments; S; X_t], values of
       retrieved segments scaled by alpha (``attention.py``);
    4. logits / NLL from the main pass;
    5. renewal: [S; H_t] at every layer; the oldest L positions that no longer fit in S
       become a new slot, FIFO.

Hidden states are kept at layers 0..n: layer 0 is the (dropped-out) embedding, layer
i the output of layer i, as in the Transformer-XL release's ``hids``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from crtn.model.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, tie_adaptive_weights
from crtn.model.attention import (
    CacheContext,
    PositionalEmbedding,
    RealPositions,
    RelPartialLearnableDecoderLayer,
)
from crtn.model.cache import SegmentCache, Selection
from crtn.model.query import QueryBuilder
from crtn.model.summary import Summary


@dataclass
class State:
    """What a batch of streams carries from one segment to the next.

    Attributes:
        mem: [n+1, B, M, d] short-term memory S (M <= mem_len), gradient-stopped, or None.
        pos: stream position of the next segment's first token (tokens consumed so far).
        cache: the key-value cache (``crtn`` with ``n_slot > 0``), updated in place.
        r_prev: [B, L, d] query-pass top layer of the previous segment (crtn), or None.
        prev_tokens: [B, L] the previous segment's tokens (crtn, ``fixed_length_1``), or None.
    """

    mem: Tensor | None = None
    pos: int = 0
    cache: SegmentCache | None = None
    r_prev: Tensor | None = None
    prev_tokens: Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        """Tensors and counters needed to continue exactly (for checkpoints)."""
        return {
            "mem": self.mem,
            "pos": self.pos,
            "r_prev": self.r_prev,
            "prev_tokens": self.prev_tokens,
            "cache": None if self.cache is None else self.cache.state_dict(),
        }


@dataclass
class LMOutput:
    """Result of :meth:`TransformerLM.forward`.

    Attributes:
        nll: [B, L] negative log-likelihood of ``target`` in nats, or None without target.
        hidden: [B, L, d] top-layer output (after the final dropout); ``crit.log_prob(hidden)``
            gives the full next-token distribution.
        state: the state after this segment.
        selection: the retrieval of this step (crtn with a non-empty cache), else None.
    """

    nll: Tensor | None
    hidden: Tensor
    state: State
    selection: Selection | None = None


class TransformerLM(nn.Module):
    """Transformer-XL language model with an optional key-value cache of past segments.

    Parameter names follow the Transformer-XL release (``word_emb``, ``layers.i.dec_attn``,
    ``layers.i.pos_ff``, ``r_w_bias``, ``r_r_bias``, ``crit``) so that weights convert 1:1.

    Args:
        n_token: vocabulary size.
        model: a :class:`crtn.config.ModelConfig`-like node.
        cache, query, summary: :class:`~crtn.config.CacheConfig`, ``QueryConfig``,
            ``SummaryConfig`` nodes; required for ``model.name == "crtn"``.
    """

    def __init__(self, n_token: int, model: Any, cache: Any = None, query: Any = None, summary: Any = None):
        super().__init__()
        self.name = model.name
        self.n_token, self.n_layer = n_token, model.n_layer
        self.d_model, self.n_head, self.d_head = model.d_model, model.n_head, model.d_head
        d_embed = model.d_embed or model.d_model
        self.d_embed = d_embed
        self.tgt_len = model.tgt_len
        self.mem_len = 0 if model.name == "vanilla" else model.mem_len
        self.clamp_len, self.same_length = model.clamp_len, model.same_length
        self.init_std, self.proj_init_std = model.init_std, model.proj_init_std

        cutoffs = list(model.cutoffs)
        self.word_emb = AdaptiveEmbedding(n_token, d_embed, model.d_model, cutoffs, model.div_val)
        self.drop = nn.Dropout(model.dropout)
        self.pos_emb = PositionalEmbedding(model.d_model)
        self.untie_r = model.untie_r
        if not model.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(model.n_head, model.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(model.n_head, model.d_head))
        self.layers = nn.ModuleList(
            RelPartialLearnableDecoderLayer(
                model.n_head,
                model.d_model,
                model.d_head,
                model.d_inner,
                model.dropout,
                model.dropatt,
                model.pre_lnorm,
                model.layer_norm_eps,
                model.untie_r,
            )
            for _ in range(model.n_layer)
        )
        self.crit = ProjectedAdaptiveLogSoftmax(n_token, d_embed, model.d_model, cutoffs, model.div_val)
        tie_projs = model.tie_projs
        if tie_projs is None:
            tie_projs = [False] + [True] * len(cutoffs)
        self.tie_projs = list(tie_projs)
        self.tie_weight = model.tie_weight
        self.div_val = model.div_val

        self.n_slot = self.top_k = 0
        if self.name == "crtn":
            self.cache_cfg, self.query_cfg = cache, query
            self.n_slot, self.top_k = cache.n_slot, cache.top_k
            self.summary = Summary(summary.name, model.tgt_len, model.d_model, summary.d_key, summary.tanh)
            self.query = QueryBuilder(query.strategy, model.tgt_len)
        self.reset_parameters()
        tie_adaptive_weights(
            self.word_emb, self.crit, model.tie_weight, self.tie_projs, model.d_model, d_embed, model.div_val
        )

    # ----------------------------------------------------------------- set-up
    def reset_parameters(self) -> None:
        """Transformer-XL's initialisation: N(0, init_std) weights, N(1, init_std) LayerNorm
        gains, zero biases, N(0, proj_init_std) adaptive projections."""
        std, pstd = self.init_std, self.proj_init_std
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if "emb_projs" in name or "out_projs" in name:
                nn.init.normal_(p, 0.0, pstd)
            elif "layer_norm" in name:
                if leaf == "weight":
                    nn.init.normal_(p, 1.0, std)
                else:
                    nn.init.zeros_(p)
            elif leaf == "bias" or leaf == "cluster_bias":
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, 0.0, std)

    def reset_length(
        self,
        tgt_len: int | None = None,
        mem_len: int | None = None,
        clamp_len: int | None = None,
        same_length: bool | None = None,
        n_slot: int | None = None,
        top_k: int | None = None,
    ) -> None:
        """Change lengths for evaluation (SPEC §5); states made before become invalid.

        Raises:
            ValueError: a new tgt_len with a summary or query whose weights depend on L.
        """
        if tgt_len is not None and tgt_len != self.tgt_len and self.name == "crtn":
            if self.summary.name == "linear" or self.query.strategy == "linear":
                raise ValueError(
                    f"eval.tgt_len={tgt_len} differs from the trained tgt_len={self.tgt_len}, but "
                    f"summary={self.summary.name} / query={self.query.strategy} has weights built for it"
                )
        if tgt_len is not None:
            self.tgt_len = tgt_len
            if self.name == "crtn":
                self.summary.seg_len = self.query.seg_len = tgt_len
        if mem_len is not None and self.name != "vanilla":
            self.mem_len = mem_len
        if clamp_len is not None:
            self.clamp_len = clamp_len
        if same_length is not None:
            self.same_length = same_length
        if n_slot is not None and self.name == "crtn":
            self.n_slot = n_slot
        if top_k is not None and self.name == "crtn":
            self.top_k = top_k

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> State:
        """A fresh state (empty memory and cache) for ``batch_size`` streams."""
        cache = None
        if self.name == "crtn" and self.n_slot > 0 and self.top_k > 0:
            c = self.cache_cfg
            cache = SegmentCache(
                self.n_slot,
                batch_size,
                c.renew,
                c.dtype,
                c.backend,
                {
                    "index": c.faiss_index,
                    "hnsw_m": c.hnsw_m,
                    "hnsw_ef_search": c.hnsw_ef_search,
                    "hnsw_ef_construction": c.hnsw_ef_construction,
                },
            )
        return State(cache=cache)

    def load_state(self, sd: dict[str, Any], batch_size: int, device: torch.device | str) -> State:
        """Rebuild a :class:`State` from :meth:`State.state_dict` on ``device``."""
        state = self.init_state(batch_size, device)

        def dev(t):
            return None if t is None else t.to(device)

        state.mem, state.pos = dev(sd["mem"]), sd["pos"]
        state.r_prev, state.prev_tokens = dev(sd["r_prev"]), dev(sd["prev_tokens"])
        if state.cache is not None and sd["cache"] is not None:
            state.cache.load_state_dict(sd["cache"])
            state.cache.to(device)
        return state

    # ------------------------------------------------------------------ passes
    def _attn_mask(self, L: int, M: int, device: torch.device) -> Tensor:
        """Causal mask over [memory; segment], True = masked: [L, M+L] (release semantics)."""
        K = M + L
        ones = torch.ones(L, K, dtype=torch.bool, device=device)
        mask = torch.triu(ones, diagonal=1 + M)
        if self.same_length:
            mask_len = K - self.mem_len
            shift = L - mask_len if mask_len > 0 else L
            mask = mask | torch.tril(ones, -shift)
        return mask

    def core(
        self,
        tokens: Tensor,
        mem: Tensor | None = None,
        cache: CacheContext | None = None,
        real_pos: RealPositions | None = None,
        extra_mask: Tensor | None = None,
        mem_kv: list[Tensor] | None = None,
    ) -> tuple[list[Tensor], Tensor]:
        """Run the layers over one segment.

        Args:
            tokens: [B, L] token ids.
            mem: [n+1, B, M, d] memory (layer i reads mem[i]), or None.
            cache: retrieved segments for the CRTN main pass, or None.
            real_pos: position terms of retrieved rows for ``cache.pos=real``.
            extra_mask: bool [B, 1, 1, M+L], True hides a memory/segment position from
                every query of that sequence (``fixed_length_2``).
            mem_kv: per layer, the keys and values of ``mem`` (:meth:`memory_kv`), shared by
                passes over the same memory.

        Returns:
            (hids, out): hids = n+1 tensors [B, L, d], the states at layers 0..n; out =
            the top layer after the final dropout, [B, L, d].
        """
        B, L = tokens.shape
        emb = self.word_emb(tokens)
        M = 0 if mem is None else mem.shape[2]
        C = cache.k * cache.seg_len if cache is not None and real_pos is None else 0
        mask = self._attn_mask(L, M, tokens.device)
        if extra_mask is not None:
            mask = mask | extra_mask
        pos_seq = torch.arange(C + M + L - 1, -1, -1.0, device=tokens.device)
        if self.clamp_len > 0:
            pos_seq = pos_seq.clamp(max=self.clamp_len)
        pos_emb = self.drop(self.pos_emb(pos_seq, emb.dtype))
        h = self.drop(emb)
        hids = [h]
        r_w = None if self.untie_r else self.r_w_bias
        r_r = None if self.untie_r else self.r_r_bias
        for i, layer in enumerate(self.layers):
            kv = None if mem_kv is None else mem_kv[i]
            h = layer(h, pos_emb, r_w, r_r, mask, None if M == 0 else mem[i], cache, i, real_pos, kv)
            hids.append(h)
        return hids, self.drop(h)

    def memory_kv(self, mem: Tensor | None) -> list[Tensor] | None:
        """Keys and values of the memory at every layer, [B, M, 2 H d_h] each (None without memory).

        CRTN's query pass and main pass attend over the same memory S: projecting it once
        per step and sharing it saves one of the two projections (gradients from both
        passes accumulate into W_{k,E} and W_v as before).
        """
        if mem is None or mem.shape[2] == 0:
            return None
        return [layer.dec_attn.project_memory(mem[i]) for i, layer in enumerate(self.layers)]

    def _append(self, mem: Tensor | None, hids: list[Tensor]) -> tuple[Tensor, Tensor | None]:
        """[S; H_t] at every layer, [n+1, B, M+L, d] (detached), and the new S (last mem_len)."""
        stacked = torch.stack([h.detach() for h in hids])
        cat = stacked if mem is None or mem.shape[2] == 0 else torch.cat([mem, stacked], 2)
        new_mem = cat[:, :, max(0, cat.shape[2] - self.mem_len) :] if self.mem_len > 0 else None
        return cat, new_mem

    def forward(
        self, tokens: Tensor, target: Tensor | None = None, state: State | None = None, update: bool = True
    ) -> LMOutput:
        """Process one segment of every stream.

        Args:
            tokens: [B, L] input ids (L <= tgt_len; a shorter final segment is allowed).
            target: [B, L] next-token ids, or None.
            state: the state after the previous segment; None starts fresh streams.
            update: False computes the outputs without renewing the cache or counting
                slot usage (generation re-runs a partial segment this way); the returned
                state is then the given one.

        Returns:
            :class:`LMOutput` with ``nll`` [B, L] in nats when ``target`` is given.
        """
        B, L = tokens.shape
        if state is None:
            state = self.init_state(B, tokens.device)
        if state.cache is not None:
            return self._forward_crtn(tokens, target, state, update)
        hids, out = self.core(tokens, state.mem)
        nll = None if target is None else self.crit(out, target)
        if not update:
            return LMOutput(nll, out, state)
        _, new_mem = self._append(state.mem, hids)
        return LMOutput(nll, out, State(mem=new_mem, pos=state.pos + L))

    # -------------------------------------------------------------------- CRTN
    def _query_memory(self, state: State, L: int) -> Tensor | None:
        """Memory of the query pass: S, and at least the stored states of X_{t-1} (SPEC §3 step 1)."""
        mem, cache = state.mem, state.cache
        if mem is not None and mem.shape[2] >= L:
            return mem
        if cache is not None and cache.n_insert > 0:
            newest = cache.newest_states().to(self.dtype)
            return newest if mem is None or mem.shape[2] == 0 else torch.cat([newest, mem], 2)
        return mem

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the model's parameters."""
        return self.layers[0].dec_attn.r_net.weight.dtype

    def _core_top(self, tokens: Tensor, mem: Tensor | None, extra_mask: Tensor | None) -> Tensor:
        return self.core(tokens, mem, extra_mask=extra_mask)[0][-1]

    def _forward_crtn(self, tokens: Tensor, target: Tensor | None, state: State, update: bool) -> LMOutput:
        B, L = tokens.shape
        cache = state.cache
        assert cache is not None
        cache.commit()
        t0, nv = state.pos, cache.n_valid
        seg = cache.seg_len if cache.values is not None else self.tgt_len
        qb = self.query
        ctx, real_pos, selection, r_cur = None, None, None, None
        mem_kv = self.memory_kv(state.mem)
        if nv > 0 or qb.needs_r_prev:
            grad = (
                torch.is_grad_enabled() and nv > 0 and self.cache_cfg.weighted and not self.query_cfg.detach
            )
            with torch.set_grad_enabled(grad):
                qmem = self._query_memory(state, seg)
                if qb.needs_query_pass:
                    shared = mem_kv if qmem is state.mem else None
                    r_cur = self.core(tokens, qmem, mem_kv=shared)[0][-1]  # R_cur, [B, L, d]
                if nv > 0:
                    r_prev = state.r_prev
                    if r_prev is None and qb.needs_r_prev:
                        r_prev = torch.zeros(B, seg, self.d_model, dtype=self.dtype, device=tokens.device)
                    prev_tokens = state.prev_tokens
                    if prev_tokens is None:
                        prev_tokens = torch.zeros(B, seg, dtype=tokens.dtype, device=tokens.device)
                    prev_states = None if qmem is None else qmem[:, :, -seg:]
                    fast = qb.fast_scores(self.summary, r_cur) if cache.backend == "torch" else None
                    q = None
                    if fast is None:  # build the queries; the fast path scores keys directly
                        q = qb(self.summary, r_prev, r_cur, self._core_top, tokens, prev_tokens, prev_states)
                    selection = cache.select(
                        q,
                        self.summary,
                        self.top_k,
                        self.cache_cfg.alpha_norm,
                        t0,
                        count=update,
                        score_fn=fast,
                    )
            if selection is not None:
                ctx = CacheContext(
                    cache.values,
                    selection.flat_index,
                    selection.alpha,
                    self.cache_cfg.weighted,
                    selection.age,
                )
                if self.cache_cfg.pos == "real":
                    real_pos = RealPositions(self.pos_emb, selection.age, seg, L, self.clamp_len, self.dtype)
        hids, out = self.core(tokens, state.mem, ctx, real_pos, mem_kv=mem_kv)
        nll = None if target is None else self.crit(out, target)
        if not update:
            return LMOutput(nll, out, state, selection)

        cat, new_mem = self._append(state.mem, hids)
        over = cat.shape[2] - self.mem_len
        if over > 0 and over == seg and L == seg:
            slot_states = cat[:, :, :over]
            key = None
            if self.summary.name not in ("identity", "token_max"):
                with torch.no_grad():
                    key = self.summary.key(slot_states[-1])
            cache.insert(slot_states, key, t0 - (cat.shape[2] - L), self.summary)
        r_prev = None if r_cur is None else r_cur.detach()
        new_state = State(
            mem=new_mem, pos=t0 + L, cache=cache, r_prev=r_prev, prev_tokens=tokens if L == seg else None
        )
        return LMOutput(nll, out, new_state, selection)
