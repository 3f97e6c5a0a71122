"""Transformer-XL (``txl``) and the vanilla Transformer (``vanilla``) (docs/method.md §2).

Batch-first throughout: tokens [B, L] -> per-token NLL [B, L] (nats) and a new
:class:`State` that carries the recurrence to the next segment of the same streams.

- ``vanilla``: relative-position Transformer, each segment sees only itself (mem_len 0).
- ``txl``: plus the short-term memory S of the last ``mem_len`` positions at every
  layer, gradient-stopped (Dai et al. 2019, segment-level recurrence).

CRTN (``crtn.py``) is a subclass that adds the key-value cache of past segments; the
layers here already accept retrieved segments (``core(cache=...)``), so all three
models run the same code.

Hidden states are kept at layers 0..n: layer 0 is the (dropped-out) embedding, layer
i the output of layer i, as in the Transformer-XL release's ``hids``. CRTN with keys and
queries at layer 0 (``cache.key_layer=0``) keeps the embedding before dropout as layer 0
(``clean_layer0``; docs/method.md §3, "Keys and queries at layer 0").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor, nn

from crtn.errors import ConfigError
from crtn.model.adaptive import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, tie_adaptive_weights
from crtn.model.attention import PositionalEmbedding, RelPartialLearnableDecoderLayer
from crtn.model.cache import SegmentCache, Selection
from crtn.model.dropout import make_dropout, word_dropout
from crtn.model.evalkv import StepKV
from crtn.model.flex import block_mask, check_options
from crtn.model.retrieved import CacheContext, RetrievedPositions
from crtn.model.spec import MEM_LEN_DEFAULT, Spec


@dataclass
class State:
    """What a batch of streams carries from one segment to the next (Transformer-XL).

    Attributes:
        mem: [n+1, B, M, d] short-term memory S (M <= mem_len), gradient-stopped, or None.
        pos: stream position of the next segment's first token (tokens consumed so far).
        mem_kv: per layer 0..n-1, [B, M, 2 H d_h] the memory's projected keys and values, kept at
            evaluation (``crtn/model/evalkv.py``), or None (saved, so that a restored state
            continues bit for bit).

    CRTN's state (``crtn.py``) adds the cache and what its query strategies carry.
    """

    mem: Tensor | None = None
    pos: int = 0
    mem_kv: list[Tensor] | None = None

    @property
    def cache(self) -> SegmentCache | None:
        """The key-value cache of past segments; None for models without one."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """Tensors and counters needed to continue exactly (for checkpoints)."""
        return {"mem": self.mem, "pos": self.pos, "mem_kv": self.mem_kv}

    def nbytes(self) -> int:
        """Bytes held by the state's hidden-state tensors (memory; CRTN: also R_prev and the cache)."""
        return tensor_nbytes(self.mem, *(self.mem_kv or ()))


def tensor_nbytes(*tensors: Tensor | None) -> int:
    """Bytes held by ``tensors`` (None entries count 0): ``numel * element_size`` summed."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class LMOutput:
    """Result of :meth:`TransformerLM.forward`.

    Attributes:
        nll: [B, L] negative log-likelihood of ``target`` in nats, or None without target.
        hidden: [B, L, d] top-layer output (after the final dropout); ``crit.log_prob(hidden)``
            gives the full next-token distribution.
        state: the state after this segment.
        selection: the retrieval of this step (crtn with a non-empty cache), else None: the query
            pass's, or with selection inside attention (``query=gate``) the top retrieving
            layer's.
        layer_selections: with selection inside attention, each retrieving layer's own
            selection, bottom first ([B, L, G*k] each: every head's slots); empty otherwise,
            where one selection serves every layer.
    """

    nll: Tensor | None
    hidden: Tensor
    state: State
    selection: Selection | None = None
    layer_selections: tuple[Selection, ...] = ()


class TransformerLM(nn.Module):
    """Transformer-XL language model (``model=txl``; docs/method.md §2), the base of every model here.

    Parameter names follow the Transformer-XL release (``word_emb``, ``layers.i.dec_attn``,
    ``layers.i.pos_ff``, ``r_w_bias``, ``r_r_bias``, ``crit``) so that weights convert 1:1.
    Subclasses state their capabilities: ``has_memory`` (the short-term memory S) and
    ``has_cache`` (a key-value cache of past segments, :class:`crtn.model.crtn.CRTN`).

    Args:
        n_token: vocabulary size.
        spec: a resolved :class:`crtn.model.spec.Spec` (:func:`crtn.model.resolve_spec`); the model
            reads ``spec.model``, models with a cache the other groups too.
    """

    has_memory = True
    has_cache = False
    #: keep projected keys and values of memory (and cache) rows at evaluation (evalkv.py);
    #: exact, so on by default; False re-projects them every step (the training path)
    eval_kv = True
    #: whether the stored layer-0 state (hids[0]: memory, cache slots, a query pass at layer 0) is
    #: the embedding before dropout; CRTN sets it for keys and queries at layer 0 (``crtn.py``)
    clean_layer0 = False

    def __init__(self, n_token: int, spec: Spec):
        super().__init__()
        model = spec.model
        self.spec = spec
        self.name = model.name
        self.n_token, self.n_layer = n_token, model.n_layer
        self.d_model, self.n_head, self.d_head = model.d_model, model.n_head, model.d_head
        self.d_embed = d_embed = model.d_embed
        self.tgt_len, self.mem_len = model.tgt_len, model.mem_len
        self.clamp_len, self.same_length = model.clamp_len, model.same_length
        self.flex = model.flex  # attention without retrieved rows through FlexAttention (flex.py)
        self.init_std, self.proj_init_std = model.init_std, model.proj_init_std

        cutoffs = list(model.cutoffs)
        self.word_emb = AdaptiveEmbedding(
            n_token, d_embed, model.d_model, cutoffs=cutoffs, div_val=model.div_val
        )
        # dropout on the top-layer output; on the word and position embeddings (dropinp); word
        # dropout (dropemb); locked: one mask per sequence (the CRTN authors' recipe)
        self.drop = make_dropout(model.dropout, model.locked_dropout)
        self.drop_inp = make_dropout(model.dropinp, model.locked_dropout)
        self.dropemb = model.dropemb
        self.pos_emb = PositionalEmbedding(model.d_model)
        self.untie_r = model.untie_r
        if not model.untie_r:
            self.r_w_bias = nn.Parameter(torch.zeros(model.n_head, model.d_head))
            self.r_r_bias = nn.Parameter(torch.zeros(model.n_head, model.d_head))
        self.layers = nn.ModuleList(
            RelPartialLearnableDecoderLayer(
                n_head=model.n_head,
                d_model=model.d_model,
                d_head=model.d_head,
                d_inner=model.d_inner,
                dropout=model.dropout,
                dropatt=model.dropatt,
                pre_lnorm=model.pre_lnorm,
                layer_norm_eps=model.layer_norm_eps,
                untie_r=model.untie_r,
                dropfor=model.dropfor,
                dropatt_out=model.dropatt_out,
                locked=model.locked_dropout,
                flex=model.flex,
            )
            for _ in range(model.n_layer)
        )
        self.crit = ProjectedAdaptiveLogSoftmax(
            n_token, d_embed, model.d_model, cutoffs=cutoffs, div_val=model.div_val
        )
        self.tie_projs = list(model.tie_projs)
        self.tie_weight = model.tie_weight
        self.div_val = model.div_val
        self.reset_parameters()
        tie_adaptive_weights(
            self.word_emb,
            self.crit,
            tie_weight=model.tie_weight,
            tie_projs=self.tie_projs,
            d_model=model.d_model,
            d_embed=d_embed,
            div_val=model.div_val,
        )

    # ----------------------------------------------------------------- options
    @classmethod
    def resolve(cls, spec: Spec) -> Spec:
        """``spec`` with the Transformer's derived defaults filled and its rules checked
        (docs/method.md §1-2): ``d_embed`` (d_model), ``mem_len`` (``tgt_len``; 0 for a model
        without memory), ``dropinp``/``dropfor``/``dropatt_out`` (``dropout``), ``tie_projs``
        (``[False] + [True] * len(cutoffs)``). Subclasses with a cache resolve its groups too.

        Raises:
            ConfigError: a size that is not positive, a rate outside [0, 1), bad cutoffs or tie_projs;
                ``model.same_length`` with no memory (``mem_len`` 0, or a model without memory:
                every query would attend no position, docs/method.md §2);
                ``model.flex`` with ``model.dropatt > 0``
                (:func:`crtn.model.flex.check_options`).
        """
        m = spec.model
        check_options(m)
        for key in ("n_layer", "n_head", "d_model", "d_head", "d_inner", "tgt_len"):
            if getattr(m, key) <= 0:
                raise ConfigError(f"model.{key}={getattr(m, key)} must be > 0")
        mem_len = m.tgt_len if m.mem_len == MEM_LEN_DEFAULT else m.mem_len
        if mem_len < 0:
            raise ConfigError(f"model.mem_len={mem_len} must be >= 0")
        if m.same_length:  # each query attends its mem_len latest positions, itself included
            if not cls.has_memory:
                raise ConfigError(
                    f"model.same_length=true masks every position of every query of model={m.name}, "
                    "which has no memory (use model.same_length=false)"
                )
            if mem_len == 0:
                raise ConfigError(
                    "model.same_length=true with model.mem_len=0 masks every position of every query "
                    "(each attends its mem_len latest positions): use model.same_length=false or a memory"
                )
        if m.d_embed is not None and m.d_embed <= 0:
            raise ConfigError(f"model.d_embed={m.d_embed} must be > 0")
        for key in ("dropout", "dropatt", "dropemb", "dropinp", "dropfor", "dropatt_out"):
            value = getattr(m, key)
            if value is not None and not 0.0 <= value < 1.0:
                raise ConfigError(f"model.{key}={value} must be in [0, 1)")
        if m.div_val < 1:
            raise ConfigError(f"model.div_val={m.div_val} must be >= 1")
        if list(m.cutoffs) != sorted(set(m.cutoffs)) or any(c <= 0 for c in m.cutoffs):
            raise ConfigError(f"model.cutoffs={list(m.cutoffs)} must be increasing positive integers")
        if m.tie_projs is not None and len(m.tie_projs) != len(m.cutoffs) + 1:
            raise ConfigError(
                f"model.tie_projs has {len(m.tie_projs)} entries; expected len(model.cutoffs)+1 "
                f"= {len(m.cutoffs) + 1}"
            )
        filled = replace(
            m,
            d_embed=m.d_model if m.d_embed is None else m.d_embed,
            mem_len=mem_len if cls.has_memory else 0,
            dropinp=m.dropout if m.dropinp is None else m.dropinp,
            dropfor=m.dropout if m.dropfor is None else m.dropfor,
            dropatt_out=m.dropout if m.dropatt_out is None else m.dropatt_out,
            tie_projs=[False] + [True] * len(m.cutoffs) if m.tie_projs is None else m.tie_projs,
        )
        return replace(spec, model=filled)

    # ----------------------------------------------------------------- set-up
    def reset_parameters(self) -> None:
        """Transformer-XL's initialisation of every parameter (:meth:`init_parameters`)."""
        self.init_parameters(self.named_parameters())

    def init_parameters(self, named: Iterable[tuple[str, nn.Parameter]]) -> None:
        """Transformer-XL's initialisation: N(0, init_std) weights, N(1, init_std) LayerNorm
        gains, zero biases, N(0, proj_init_std) adaptive projections, drawn in the given order."""
        std, pstd = self.init_std, self.proj_init_std
        for name, p in named:
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

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> State:
        """A fresh state (empty memory) for ``batch_size`` streams."""
        return State()

    def load_state(self, sd: dict[str, Any], batch_size: int, device: torch.device | str) -> State:
        """Rebuild a :class:`State` from :meth:`State.state_dict` on ``device``."""
        state = self.init_state(batch_size, device)
        state.mem, state.pos = to_device(sd["mem"], device), sd["pos"]
        kept = sd.get("mem_kv")
        state.mem_kv = None if kept is None else [t.to(device) for t in kept]
        return state

    def compile_layers(self, **options: Any) -> TransformerLM:
        """``torch.compile`` every decoder layer in place (``train.compile``); returns the model.

        Layers, not the whole model: the step has Python control flow around the cache
        (retrieval, renewal) that would break the graph, while a layer is one graph per input
        shape (recompiled while the memory fills). ``options`` go to ``torch.compile`` (e.g.
        ``backend``).
        """
        for layer in self.layers:
            layer.compile(**options)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype of the model's parameters."""
        return self.layers[0].dec_attn.r_net.weight.dtype

    # ------------------------------------------------------------------ passes
    def _attn_mask(self, L: int, M: int, device: torch.device) -> Tensor:
        """Causal mask over [memory; segment], True = masked: [L, M+L] (release semantics)."""
        K = M + L
        ones = torch.ones(L, K, dtype=torch.bool, device=device)
        mask = torch.triu(ones, diagonal=1 + M)
        shift = self._same_length_shift(L, M)
        if shift is not None:
            mask = mask | torch.tril(ones, -shift)
        return mask

    def _same_length_shift(self, L: int, M: int) -> int | None:
        """``same_length``: query i sees keys j > i - shift of [memory; segment] (so that each query
        sees as many, the release's ``mask_shift_len``); None without ``same_length``."""
        if not self.same_length:
            return None
        mask_len = M + L - self.mem_len
        return L - mask_len if mask_len > 0 else L

    def core(
        self,
        tokens: Tensor,
        mem: Tensor | None = None,
        cache: CacheContext | None = None,
        positions: RetrievedPositions | None = None,
        extra_mask: Tensor | None = None,
        mem_kv: list[Tensor] | None = None,
        layers: tuple[int, int] | None = None,
        h: Tensor | None = None,
        kv_out: list[Tensor] | None = None,
    ) -> tuple[list[Tensor], Tensor]:
        """Run the layers over one segment.

        Args:
            tokens: [B, L] token ids.
            mem: [n+1, B, M, d] memory (layer i reads mem[i]), or None.
            cache: retrieved segments for the CRTN main pass, or None.
            positions: position terms of retrieved rows for ``cache.pos=real`` or ``match``
                (:mod:`crtn.model.retrieved`); None: those of the concatenated context alone.
            extra_mask: bool [B, 1, 1, M+L], True hides a memory/segment position from
                every query of that sequence (``fixed_length_2``).
            mem_kv: per layer, the keys and values of ``mem`` (:meth:`memory_kv`), shared by
                passes over the same memory.
            layers: (start, end): run only layers start..end-1 (0-based), default all;
                ``h`` [B, L, d] is then the input of layer ``start`` (the embedding is not
                recomputed) unless start is 0.
            kv_out: a list that receives each layer's keys and values of [memory; segment],
                [B, M+L, 2 H d_h] per layer run (evaluation, ``evalkv.py``), or None.

        Returns:
            (hids, out): hids = the states [B, L, d] at the input of layer ``start`` and at the
            output of each layer run (all n+1 by default); out = the last of them, after the
            final dropout when the top layer ran. With ``clean_layer0`` (CRTN,
            ``cache.key_layer=0``) hids[0] is the embedding before dropout, while layer 0 reads the
            dropped-out one (docs/method.md §3, "Keys and queries at layer 0").
        """
        start, end = (0, self.n_layer) if layers is None else layers
        L = tokens.shape[1]
        emb = raw = None
        if h is None:
            raw = self.word_emb(tokens)
            emb = word_dropout(raw, tokens, self.n_token, p=self.dropemb, training=self.training)
        M = 0 if mem is None else mem.shape[2]
        C = _concat_rows(cache, positions)
        mask = self._attn_mask(L, M, tokens.device)
        if extra_mask is not None:
            mask = mask | extra_mask
        flex_mask = None  # model.flex: the same mask as a rule (crtn/model/flex.py)
        if self.flex and cache is None:
            hidden = None if extra_mask is None else extra_mask.reshape(-1, M + L).expand(tokens.shape[0], -1)
            flex_mask = block_mask(
                L, M, shift=self._same_length_shift(L, M), hidden=hidden, device=tokens.device
            )
        dtype = emb.dtype if emb is not None else h.dtype
        pos_emb, positions = self._position_embeddings(C + M + L, positions, dtype, tokens.device)
        if h is None:
            h = self.drop_inp(emb)
        # the stored layer-0 state: the dropped-out embedding, or with clean_layer0 the embedding
        # before (word) dropout, while layer 0 itself reads the dropped-out h
        hids = [raw if self.clean_layer0 and raw is not None else h]
        r_w = None if self.untie_r else self.r_w_bias
        r_r = None if self.untie_r else self.r_r_bias
        for i in range(start, end):
            h = self.layers[i](
                h,
                pos_emb,
                r_w_bias=r_w,
                r_r_bias=r_r,
                attn_mask=mask,
                mem=None if M == 0 else mem[i],
                cache=cache,
                layer=i,
                positions=positions,
                mem_kv=None if mem_kv is None else mem_kv[i],
                kv_out=kv_out,
                flex_mask=flex_mask,
            )
            hids.append(h)
        return hids, self.drop(h) if end == self.n_layer else h

    def _position_embeddings(
        self, K: int, positions: RetrievedPositions | None, dtype: torch.dtype, device: torch.device
    ) -> tuple[Tensor, RetrievedPositions | None]:
        """Sinusoid embeddings of the distances K-1 .. 0 (clamped, dropped out): [K, d].

        With ``cache.pos=real`` or ``match`` in training with dropout, one dropped table of every
        distance up to the farthest position term (:attr:`max_dist`) is drawn and shared with
        ``positions`` (so retrieved rows and memory rows see the same dropout of a distance, as in
        ``concat``).
        """
        if positions is not None and self.training and self.drop_inp.p > 0:
            pos_seq = torch.arange(0, max(K, positions.max_dist + 1), device=device, dtype=torch.float)
            if self.clamp_len > 0:
                pos_seq = pos_seq.clamp(max=self.clamp_len)
            table = self.drop_inp(self.pos_emb(pos_seq, dtype))
            return table[:K].flip(0), positions.with_table(table)
        pos_seq = torch.arange(K - 1, -1, -1.0, device=device)
        if self.clamp_len > 0:
            pos_seq = pos_seq.clamp(max=self.clamp_len)
        return self.drop_inp(self.pos_emb(pos_seq, dtype)), positions

    def keeps_kv(self) -> bool:
        """Whether this step keeps projected keys and values (evaluation without gradient)."""
        return self.eval_kv and not self.training and not torch.is_grad_enabled()

    def step_kv(self, state: State, share: bool = False) -> StepKV:
        """The memory's keys and values for this step (``evalkv.py``): at evaluation those the state
        kept (:meth:`step_memory_kv`), and a list for the layers' new ones; in training none, or with
        ``share`` the memory projected once for several passes over it (:meth:`memory_kv`)."""
        if self.keeps_kv():
            return StepKV(self.step_memory_kv(state), [])
        return StepKV(self.memory_kv(state.mem) if share else None, None)

    def step_memory_kv(self, state: State) -> list[Tensor] | None:
        """The memory's keys and values for this step: those the state kept (evaluation) when they
        match its memory, else projected now (:meth:`memory_kv`)."""
        mem, kept = state.mem, state.mem_kv
        if kept is not None and mem is not None and self.keeps_kv() and kept[0].shape[1] == mem.shape[2]:
            return kept
        return self.memory_kv(mem)

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
            update: False computes the outputs without renewing memory (or cache), e.g.
                generation re-running a partial segment; the returned state is then the given one.

        Returns:
            :class:`LMOutput` with ``nll`` [B, L] in nats when ``target`` is given.
        """
        B, L = tokens.shape
        if state is None:
            state = self.init_state(B, tokens.device)
        kv = self.step_kv(state)
        hids, out = self.core(tokens, state.mem, mem_kv=kv.mem, kv_out=kv.out)
        nll = None if target is None else self.crit(out, target)
        if not update:
            return LMOutput(nll, out, state)
        _, new_mem = self._append(state.mem, hids)
        return LMOutput(nll, out, State(mem=new_mem, pos=state.pos + L, mem_kv=kv.next_memory(self.mem_len)))


class VanillaLM(TransformerLM):
    """The "vanilla" relative-position Transformer (``model=vanilla``): no memory, every
    segment sees only itself (the baseline of the Transformer-XL paper)."""

    has_memory = False


def _concat_rows(cache: CacheContext | None, positions: RetrievedPositions | None) -> int:
    """C, the retrieved rows per token placed in the concatenated context before the memory (their
    position terms from its distances, docs/method.md §3 step 3): all k·Ls of them, except where
    ``positions`` replace those terms (``cache.pos=real``); 0 without a cache."""
    if cache is None or (positions is not None and not positions.concat):
        return 0
    return cache.k * cache.seg_len


def to_device(t: Tensor | None, device: torch.device | str) -> Tensor | None:
    """``t`` on ``device`` (a saved state's tensor); None stays None."""
    return None if t is None else t.to(device)
