"""The cache-based recurrent transformer network, CRTN (docs/method.md §3): Transformer-XL plus a
key-value cache of the ``n_slot`` most recent segments that left the short-term memory.

One step for segment X_t (:meth:`CRTN.forward`; docs/method.md §3):

1. the layers below retrieval (``cache.layers``: the lower n - layers layers, run once; none
   in the paper's model, where every layer retrieves);
2. a retriever selects the cached segments (``retriever.py``): the paper's query pass (a pass
   over X_t gives R_cur, the query strategy q_j for every token j, the cache the top-k segments
   and weights alpha, ``cache.py``), or selection inside attention (``query=gate``: each
   retrieving layer selects with its own queries, ``gate.py``);
3. the retrieving layers: Transformer-XL attention over [selected segments; S; X_t], values of
   the selected segments scaled by alpha (``attention.py``, ``retrieved.py``); at evaluation the
   layers keep the memory's projected keys and values (``evalkv.py``);
4. logits / NLL from the top layer;
5. renewal: [S; H_t] at every layer; the oldest L positions that no longer fit in S
   become a new slot, replacing the oldest (FIFO).

Dependency range m + N L tokens (:func:`dependency_range`) for the attention cost of
about m + (k+1) L. With ``n_slot = 0`` or ``top_k = 0`` the model is exactly
Transformer-XL.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from crtn.errors import ConfigError, check_choice
from crtn.model.cache import SegmentCache, alpha_is_one, resolve_cache, torch_dtype
from crtn.model.evalkv import StepKV
from crtn.model.gate import block_keys
from crtn.model.lookup import match_lengths
from crtn.model.query import STRATEGIES
from crtn.model.retriever import IN_ATTENTION, LOOKUP, QUERY_PASS, Found, Retriever, seg_len
from crtn.model.spec import CacheSpec, ModelSpec, Spec
from crtn.model.summary import SUMMARIES
from crtn.model.transformer import LMOutput, State, TransformerLM, tensor_nbytes, to_device


def dependency_range(mem_len: int, n_slot: int, tgt_len: int) -> int:
    """CRTN's dependency range in tokens, m + N L (docs/method.md §3); Transformer-XL's is m (N = 0)."""
    return int(mem_len) + int(n_slot) * int(tgt_len)


@dataclass
class CRTNState(State):
    """A CRTN stream's state: Transformer-XL's plus the cache and the query strategies' inputs.

    Attributes:
        cache: the key-value cache (``n_slot > 0`` and ``top_k > 0``), updated in place.
        r_prev: [B, L, d] query-pass top layer of the previous segment, or None.
        prev_tokens: [B, L] the previous segment's tokens, or None.
        history: [B, H] long, the stream's last H = m + ``query.max_match`` tokens before the
            segment (-1 before the stream's start), which ``query=lookup`` matches (``lookup.py``);
            None for the other strategies.
    """

    cache: SegmentCache | None = None  # type: ignore[assignment]  # a field here, None in State
    r_prev: Tensor | None = None
    prev_tokens: Tensor | None = None
    history: Tensor | None = None

    def state_dict(self) -> dict[str, Any]:
        """Tensors and counters needed to continue exactly (for checkpoints)."""
        return {
            **super().state_dict(),
            "r_prev": self.r_prev,
            "prev_tokens": self.prev_tokens,
            "history": self.history,
            "cache": None if self.cache is None else self.cache.state_dict(),
        }

    def nbytes(self) -> int:
        cache = self.cache
        stored = (None, None) if cache is None else (cache.values, cache.keys)
        return super().nbytes() + tensor_nbytes(self.r_prev, *stored)


class CRTN(TransformerLM):
    """Transformer-XL with a key-value cache of past segments (``model=crtn``, docs/method.md §3).

    Args:
        n_token: vocabulary size.
        spec: a resolved :class:`crtn.model.spec.Spec` (:meth:`resolve`): ``spec.model`` as for
            Transformer-XL; ``spec.cache``, ``spec.query`` and ``spec.summary`` the cache and
            its retrieval.

    Modules beyond Transformer-XL: ``summary`` (keys and window queries, ``summary.py``)
    and ``query`` (the strategy, ``query.py``); their parameter names (``summary.proj``,
    ``query.seq_linear``) are stable across versions.
    """

    has_cache = True

    def __init__(self, n_token: int, spec: Spec):
        super().__init__(n_token, spec)
        m, c = spec.model, spec.cache
        # retrieval in the upper cache.layers layers only (all: the paper's model): the layers
        # below run once, shared by the query and the main pass (docs/method.md §3)
        self.retrieve_from = m.n_layer - c.layers
        # the hidden layer (0: embeddings .. n: top) of keys and queries; None for query=gate
        self.key_layer = c.key_layer
        # a key layer below the first retrieving layer's input is stored in each slot ahead of the
        # retrieving layers' inputs (docs/method.md §3, "Retrieval in the upper layers only"), so
        # retrieving layer i reads the cache's stored layer i - value_base
        self.key_apart = c.enabled and c.key_layer is not None and c.key_layer < self.retrieve_from
        self.value_base = self.retrieve_from - int(self.key_apart)
        # where the key layer lies among the layers a slot stores (-1: the top; _renew)
        self.key_index = (
            0 if self.key_apart else -1 if c.key_layer is None else c.key_layer - self.retrieve_from
        )
        # keys and queries at layer 0 are the embeddings before dropout, so that in training a
        # token's own n-gram matches its cached copy exactly (docs/method.md §3, "Keys and
        # queries at layer 0"); layer 0 still reads the dropped-out embedding
        self.clean_layer0 = self.key_layer == 0 and c.enabled
        self.summary = SUMMARIES[spec.summary.name].from_spec(spec.summary, m)
        self.query = STRATEGIES[spec.query.strategy].from_spec(spec.query, m, d_key=self.summary.d_query)
        # alpha of 1 (one slot, topk or original) scales nothing: the values are unweighted and the
        # selection needs no gradient (cache.alpha_is_one), so the summary's and query's weights
        # get none (they could not learn: the scores reach the loss only through the argmax)
        self.weighted = c.weighted and not alpha_is_one(c.alpha_norm, c.top_k)
        self.pos_mode, self.detach = c.pos, spec.query.detach  # cache.pos: the retrieved rows' positions
        # dtype of the retrieved attention's products (cache.product_dtype; None: as stored)
        self.product_dtype = torch_dtype(c.product_dtype)
        # R_prev is kept for the strategies that read it and for the summaries' query lead-in (a gate
        # takes its lead-in queries from each layer's memory)
        self.needs_r_prev = not (self.query.in_attention or self.query.by_lookup) and (
            self.query.needs_r_prev or self.summary.query_lead_rows > 0
        )
        # query=lookup: the n-gram lengths each token looks up and the tokens kept before the
        # segment for them (lookup.py; CRTNState.history)
        self.match_lengths = (
            match_lengths(spec.summary.ngram, spec.query.max_match) if self.query.by_lookup else ()
        )
        self.history_len = self.mem_len + spec.query.max_match if self.query.by_lookup else 0
        # initialised after the Transformer-XL parameters, in registration order
        self.init_parameters(
            (n, p) for n, p in self.named_parameters() if n.split(".")[0] in ("summary", "query")
        )

    @property
    def n_slot(self) -> int:
        """N, cached segments per stream (``cache.n_slot``)."""
        return self.spec.cache.n_slot

    @property
    def top_k(self) -> int:
        """k, segments retrieved per token (``cache.top_k``)."""
        return self.spec.cache.top_k

    @classmethod
    def resolve(cls, spec: Spec) -> Spec:
        """Transformer-XL's resolution (:meth:`TransformerLM.resolve`), then the cache's
        (:func:`crtn.model.cache.resolve_cache`), the strategy's (pairing, the options it reads),
        the summary's (``ngram``, ``shift``, ``d_key``..., the options it reads), the summary
        options the strategy leaves unused (:meth:`crtn.model.query.QueryStrategy.check_summary`)
        and the model's own: ``mem_len`` a multiple of ``tgt_len`` (renewal, docs/method.md §3
        step 5), ``cache.layers`` (None: all) and ``cache.key_layer`` (None: the top, or the input
        of the first retrieving layer).

        Raises:
            ConfigError: one line naming the offending key and value.
        """
        spec = super().resolve(spec)
        m = spec.model
        if m.mem_len % m.tgt_len != 0:
            raise ConfigError(
                f"model.mem_len={m.mem_len} must be a multiple of model.tgt_len={m.tgt_len} "
                f"for model={m.name} (docs/method.md §3, renewal)"
            )
        check_choice("query.strategy", spec.query.strategy, STRATEGIES)
        check_choice("summary.name", spec.summary.name, SUMMARIES)
        summary_cls = SUMMARIES[spec.summary.name]
        strategy_cls = STRATEGIES[spec.query.strategy]
        gate, lookup = strategy_cls.in_attention, strategy_cls.by_lookup
        cache = resolve_cache(spec.cache, summary_cls, gate=gate)
        query = strategy_cls.resolve(spec.query, spec.summary.name)
        summary = summary_cls.resolve(spec.summary, m)
        strategy_cls.check_summary(summary)  # options of the summary the strategy leaves unused
        if gate or lookup:
            q = spec.query.strategy
            if cache.key_layer is not None:  # never filled here: resolving again accepts None
                raise ConfigError(
                    f"cache.key_layer={cache.key_layer} applies to the query strategies that score states, not "
                    f"query={q} (it selects without a key layer; cache.layers chooses the retrieving layers)"
                )
            if cache.backend == "faiss":
                raise ConfigError(f"cache.backend=faiss does not support query={q} (use cache.backend=torch)")
        if lookup and cache.top_k != 1:
            raise ConfigError(
                f"cache.top_k={cache.top_k}: query=lookup retrieves one row per token (set cache.top_k=1)"
            )
        if lookup and cache.alpha_norm == "all":
            raise ConfigError(
                "cache.alpha_norm=all is a softmax over scores query=lookup does not compute (its alpha is 1: use topk)"
            )
        if lookup and query.max_match < summary.ngram:
            raise ConfigError(
                f"query.max_match={query.max_match} must be >= summary.ngram={summary.ngram} (the shortest "
                "n-gram query=lookup looks up)"
            )
        layers = _resolve_layers(cache, m, gate=gate or lookup)
        return replace(spec, cache=layers, query=query, summary=summary)

    def init_state(self, batch_size: int, device: torch.device | str | None = None) -> CRTNState:
        """A fresh state (empty memory and cache) for ``batch_size`` streams; no cache when
        ``cache.n_slot`` or ``cache.top_k`` is 0 (the model is then Transformer-XL)."""
        c = self.spec.cache
        if not c.enabled:
            return CRTNState()
        cache = SegmentCache(
            c.n_slot,
            batch_size,
            self.summary,
            key_layer=self.key_index,
            dtype=c.dtype,
            backend=c.backend,
            faiss_index=c.faiss_index,
        )
        return CRTNState(cache=cache)

    def load_state(self, sd: dict[str, Any], batch_size: int, device: torch.device | str) -> CRTNState:
        """Rebuild a :class:`CRTNState` from :meth:`CRTNState.state_dict` on ``device``."""
        state = super().load_state(sd, batch_size, device)
        state.r_prev, state.prev_tokens, state.history = (
            to_device(sd.get("r_prev"), device),
            to_device(sd.get("prev_tokens"), device),
            to_device(sd.get("history"), device),
        )
        if state.cache is not None and sd.get("cache") is not None:
            state.cache.load_state_dict(sd["cache"])
            state.cache.to(device)
        return state

    # -------------------------------------------------------------------- step
    @property
    def retriever(self) -> Retriever:
        """What selects the cached segments (``retriever.py``): selection inside attention for
        ``query=gate``, the lookup of the preceding tokens for ``query=lookup``, else the query
        pass of the strategy."""
        if self.query.by_lookup:
            return LOOKUP
        return IN_ATTENTION if self.query.in_attention else QUERY_PASS

    def forward(
        self, tokens: Tensor, target: Tensor | None = None, state: State | None = None, update: bool = True
    ) -> LMOutput:
        """One CRTN step over a segment of every stream (module docstring, steps 1-5): the layers
        below retrieval, the retriever's selection, the retrieving layers over [selected segments;
        memory; segment], renewal.

        Args and returns as :meth:`TransformerLM.forward`; ``update=False`` also leaves the
        cache untouched (no renewal). ``LMOutput.selection`` holds the retrieval of this step
        (None while the cache is empty).
        """
        if state is None:
            state = self.init_state(tokens.shape[0], tokens.device)
        if state.cache is None:  # n_slot = 0 or top_k = 0: Transformer-XL
            return super().forward(tokens, target, state, update)
        state.cache.commit()
        kv = self.step_kv(state, share=True)  # the memory's keys and values, shared by every pass
        below = self._below(tokens, state, kv)
        found = self.retriever.find(self, tokens, state, below=below, kv=kv)
        hids, out = self._retrieving(tokens, state, kv=kv, below=below, found=found)
        nll = None if target is None else self.crit(out, target)
        if update:
            state = self._renew(state, tokens, hids, kv=kv, found=found)
        return LMOutput(
            nll, out, state, selection=found.reported(), layer_selections=found.layer_selections()
        )

    def _below(self, tokens: Tensor, state: CRTNState, kv: StepKV) -> list[Tensor] | None:
        """The layers below the first retrieving one (``cache.layers``), run once for the retriever
        and the retrieving layers: the states [B, L, d] at layers 0..r; None when every layer
        retrieves (r = 0: the retrieving pass embeds the tokens itself)."""
        r = self.retrieve_from
        if r == 0:
            return None
        return self.core(tokens, state.mem, mem_kv=kv.mem, layers=(0, r), kv_out=kv.out)[0]

    def _retrieving(
        self, tokens: Tensor, state: CRTNState, *, kv: StepKV, below: list[Tensor] | None, found: Found
    ) -> tuple[list[Tensor], Tensor]:
        """Steps 3-4: the retrieving layers over [selected segments; S; X_t] (``found``), on top of
        ``below``. Returns the states [B, L, d] at layers 0..n and the top layer's output."""
        upper, out = self.core(
            tokens,
            state.mem,
            cache=found.context,
            positions=found.positions,
            mem_kv=kv.mem,
            layers=(self.retrieve_from, self.n_layer),
            h=None if below is None else below[-1],
            kv_out=kv.out,
        )
        return (upper if below is None else below + upper[1:]), out

    def _renew(
        self, state: CRTNState, tokens: Tensor, hids: list[Tensor], *, kv: StepKV, found: Found
    ) -> CRTNState:
        """Step 5: [S; H_t]; the oldest L positions that leave S become a new slot (with a
        lookup's keys of its rows). Returns the state after the segment (the cache renewed in
        place; the query pass's R_cur, ``found.r_cur``, becomes R_prev)."""
        cache, r_cur = state.cache, found.r_cur
        assert cache is not None
        L, seg = tokens.shape[1], seg_len(self, cache)
        cat, new_mem = self._append(state.mem, hids)
        over = cat.shape[2] - self.mem_len
        if over > 0 and over == seg and L == seg:
            r = self.retrieve_from
            # every layer's states (paper); with cache.layers only those the retrieving layers read,
            # after the key layer's when that lies below them
            slot_states = cat[:, :, :over] if r == 0 else cat[r : self.n_layer, :, :over]
            if self.key_apart:
                k = self.key_layer
                slot_states = torch.cat([cat[k : k + 1, :, :over], slot_states])
            cache.insert(
                slot_states,
                self.slot_key(slot_states),
                state.pos - (cat.shape[2] - L),
                row_keys=self._row_keys(found.ends, first=self.history_len - (cat.shape[2] - L), seg=seg),
            )
        return CRTNState(
            mem=new_mem,
            mem_kv=kv.next_memory(self.mem_len),
            pos=state.pos + L,
            cache=cache,
            r_prev=None if r_cur is None else r_cur.detach(),
            prev_tokens=tokens if L == seg else None,
            history=None if found.ends is None else self.token_window(tokens, state)[:, L:],
        )

    def token_window(self, tokens: Tensor, state: CRTNState) -> Tensor:
        """[B, H + L] long: the H = :attr:`history_len` tokens before the segment (-1 before the
        stream's start; ``CRTNState.history``) and the segment ``tokens`` [B, L] (``query=lookup``)."""
        history = state.history
        if history is None:
            history = torch.full(
                (tokens.shape[0], self.history_len), -1, dtype=torch.long, device=tokens.device
            )
        return torch.cat([history, tokens.long()], 1)

    def _row_keys(self, ends: Tensor | None, *, first: int, seg: int) -> Tensor | None:
        """A lookup's keys of the rows of the slot that starts at column ``first`` of
        :meth:`token_window`: row r keyed by the n-grams ending ``summary.shift`` positions before
        it (docs/method.md §3, "Lookup of the preceding tokens"), [n_len, B, seg]; None without a
        lookup (``ends`` None)."""
        if ends is None:
            return None
        start = first - self.summary.shift
        return ends[..., start : start + seg]

    def slot_key(self, stored: Tensor) -> Tensor | None:
        """The key of a new slot from the states the cache stores of it, [n_stored, B, Ls, d]
        (layers 0..n, or with ``cache.layers`` the retrieving layers' inputs, after the key
        layer's where it lies below them): the summary of
        the key layer [B, d_key]; for a gate the block keys of every retrieving layer's input
        [B, n_ret, d] (``gate.py``); None when the key is a view of the stored states."""
        if self.query.in_attention:
            first = self.layers[self.retrieve_from].dec_attn
            n_ret = self.n_layer - self.retrieve_from
            return block_keys(stored[:n_ret], self.summary, first.pre_lnorm, first.layer_norm.eps)
        return self.summary.stored_key(stored[self.key_index])

    def _core_top(
        self,
        tokens: Tensor,
        mem: Tensor | None,
        extra_mask: Tensor | None,
        mem_kv: list[Tensor] | None = None,
    ) -> Tensor:
        """Layer ``key_layer`` (the top by default) of a query pass without cache: R_cur, and the
        ``fixed_length`` strategies' own passes. Layers above it are not run."""
        return self.core(tokens, mem, extra_mask=extra_mask, mem_kv=mem_kv, layers=(0, self.key_layer))[0][-1]

    @torch.no_grad()
    def _core_top_detached(
        self,
        tokens: Tensor,
        mem: Tensor | None,
        extra_mask: Tensor | None,
        mem_kv: list[Tensor] | None = None,
    ) -> Tensor:
        """:meth:`_core_top` without gradient (``query.detach``)."""
        return self._core_top(tokens, mem, extra_mask, mem_kv=mem_kv)

    @torch.no_grad()
    def _memory_kv_detached(self, mem: Tensor | None) -> list[Tensor] | None:
        """:meth:`memory_kv` without gradient (``query.detach``)."""
        return self.memory_kv(mem)


def _resolve_layers(cache: CacheSpec, model: ModelSpec, gate: bool = False) -> CacheSpec:
    """``cache.layers`` (None: all n; a number: the top min(layers, n) layers, so a model of no
    more layers than that retrieves in every one) and ``cache.key_layer`` (None: the top, or
    with fewer layers the input of the first retrieving one; with fewer layers a key layer at or
    below that input, which the shared lower layers compute before retrieval; left None for
    selection inside attention, ``gate``, where every retrieving layer scores with its own
    input), checked and filled (docs/method.md §3, "Retrieval in the upper layers only").

    Raises:
        ConfigError: layers below 1; fewer layers than n without one segment of memory for the
            shared lower layers; a key layer outside 0..n, or with fewer layers one above the
            first retrieving layer's input.
    """
    n = model.n_layer
    if cache.layers is not None and cache.layers < 1:
        raise ConfigError(f"cache.layers={cache.layers} must be >= 1 (null: every layer)")
    layers = n if cache.layers is None else min(cache.layers, n)
    below = n - layers
    if layers < n:
        if model.mem_len < model.tgt_len:
            raise ConfigError(
                f"cache.layers={layers} needs model.mem_len >= model.tgt_len (the shared lower "
                f"layers' memory); got mem_len={model.mem_len} (cache.layers=null: every layer retrieves)"
            )
        if cache.key_layer is not None and cache.key_layer > below:
            raise ConfigError(
                f"cache.key_layer={cache.key_layer}: with cache.layers={layers} keys and queries come "
                f"from layer {below} (the input of the first retrieving layer) or a layer below it "
                "(leave key_layer null, or cache.layers=null for keys at a higher layer)"
            )
    if cache.key_layer is not None and not 0 <= cache.key_layer <= n:
        raise ConfigError(f"cache.key_layer={cache.key_layer} must be in 0..model.n_layer={n}")
    key_layer = cache.key_layer if cache.key_layer is not None or gate else (below or n)
    return replace(cache, layers=layers, key_layer=key_layer)
