"""How a CRTN step finds the cached segments its retrieving layers attend to (docs/method.md §3).

A step (``crtn.py``) runs the layers below retrieval, asks a :class:`Retriever` what the
retrieving layers read, runs them over [selected segments; memory; current segment], and renews
the cache. Three retrievers serve the query strategies:

| retriever      | ``query=``                   | selects                                                  |
|----------------|------------------------------|----------------------------------------------------------|
| :class:`QueryPass`    | every strategy but ``gate`` | once per step, before the retrieving layers: the query pass (R_cur), the strategy's queries, top-k of the cache (§3 steps 1-2) |
| :class:`InAttention`  | ``gate``                    | inside each retrieving layer, with its own attention queries (§3, "Selection inside attention"; ``gate.py``) |
| :class:`Lookup`       | ``lookup``                  | once per step, by the tokens: the row after the most recent occurrence of the longest n-gram ending at each token (§3, "Lookup of the preceding tokens"; ``lookup.py``) |

Either hands the layers a :class:`Found`: the :class:`crtn.model.retrieved.CacheContext` the
attention reads (None while the cache is empty) and, for ``cache.pos=real`` or ``match``, the
position terms of the rows it may read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from crtn.model.cache import SegmentCache, Selection
from crtn.model.evalkv import StepKV
from crtn.model.gate import Gate
from crtn.model.lookup import NO_QUERY, NO_ROW, ending_keys, longest
from crtn.model.query import QueryInputs
from crtn.model.retrieved import CacheContext, MatchPositions, RealPositions, RetrievedPositions

if TYPE_CHECKING:  # the model imports this module
    from crtn.model.crtn import CRTN, CRTNState


@dataclass
class Found:
    """What a retriever hands the retrieving layers for one step.

    Attributes:
        context: the cache rows the retrieving layers read (None: nothing to read this step).
        positions: position terms of those rows for ``cache.pos=real`` or ``match``, else None.
        r_cur: [B, L, d] the query pass's R_cur, carried to the next step as R_prev, or None.
        selection: the query pass's or the lookup's selection [B, L, k], or None (a gate's is
            read from :attr:`context` once the layers ran: :meth:`reported`).
        ends: [n_len, B, H + L] long, a lookup's keys of the n-grams ending at every position of
            the stream's last H tokens and the segment (:func:`crtn.model.lookup.ending_keys`),
            from which the renewal keys the new slot's rows; None for the other retrievers.
    """

    context: CacheContext | None = None
    positions: RetrievedPositions | None = None
    r_cur: Tensor | None = None
    selection: Selection | None = None
    ends: Tensor | None = None

    def reported(self) -> Selection | None:
        """The step's selection for ``LMOutput.selection``: the query pass's, or the top retrieving
        layer's of a gate (every head's slots, [B, L, G*k]); None while the cache is empty."""
        gate = None if self.context is None else self.context.gate
        if gate is not None and gate.selections:
            return _reported(gate.selections[-1])
        return self.selection

    def layer_selections(self) -> tuple[Selection, ...]:
        """A gate's selection at each retrieving layer, bottom first, each as :meth:`reported`
        gives the top one's; empty without a gate (``LMOutput.layer_selections``)."""
        gate = None if self.context is None else self.context.gate
        return () if gate is None else tuple(_reported(s) for s in gate.selections)


class Retriever(Protocol):
    """Finds what the retrieving layers of one CRTN step read (module docstring)."""

    def find(
        self, model: CRTN, tokens: Tensor, state: CRTNState, *, below: list[Tensor] | None, kv: StepKV
    ) -> Found:
        """The rows the retrieving layers read this step.

        Args:
            model: the CRTN whose step this is (its layers, summary, query strategy and spec).
            tokens: [B, L] the segment.
            state: the streams' state before the segment (its cache committed).
            below: the states [B, L, d] at layers 0..r of the layers below the first retrieving
                one (``cache.layers``), or None when every layer retrieves.
            kv: the memory's keys and values of this step (shared by every pass over it).
        """
        ...


def seg_len(model: CRTN, cache: SegmentCache) -> int:
    """Ls, rows per cached segment: the cache's, or ``tgt_len`` before the first slot."""
    return cache.seg_len or model.tgt_len


class QueryPass:
    """The CRTN paper's retrieval (docs/method.md §3 steps 1-2): a query pass over X_t gives R_cur,
    the query strategy builds each token's query from it (with its summary), and the cache selects
    the top-k slots and their weights alpha. With ``cache.layers`` R_cur is the key layer's state
    from the shared lower layers, ``below[key_layer]`` (no separate pass): by default the input of
    the first retrieving layer, ``below[-1]``.

    Gradients reach the query only through alpha (keys are gradient-stopped), so the pass needs
    none unless the values are alpha-weighted. ``query.detach`` stops them at R_cur: the query
    pass gets none, the query's own weights (``summary.proj*``, ``query.seq_linear``,
    ``query.proj``) still train.
    """

    def find(
        self, model: CRTN, tokens: Tensor, state: CRTNState, *, below: list[Tensor] | None, kv: StepKV
    ) -> Found:
        cache = state.cache
        assert cache is not None
        if cache.n_valid == 0 and not model.needs_r_prev:
            return Found()
        seg = seg_len(model, cache)
        r_cur, selection = self._select(model, tokens, state, below=below, kv=kv, seg=seg)
        if selection is None:
            return Found(r_cur=r_cur)
        context = CacheContext(
            cache.values,
            selection.flat_index,
            selection.alpha,
            weighted=model.weighted,
            age=selection.age,
            first_layer=model.value_base,
            product_dtype=model.product_dtype,
        )
        return Found(context, _positions(model, selection, seg=seg, q_len=tokens.shape[1]), r_cur, selection)

    def _select(
        self,
        model: CRTN,
        tokens: Tensor,
        state: CRTNState,
        *,
        below: list[Tensor] | None,
        kv: StepKV,
        seg: int,
    ) -> tuple[Tensor | None, Selection | None]:
        """R_cur (layer ``key_layer`` of the query pass) and, with a non-empty cache, the selection."""
        cache = state.cache
        assert cache is not None
        nv, qs = cache.n_valid, model.query
        grad = torch.is_grad_enabled() and nv > 0 and model.weighted
        r_cur, selection = None, None
        with torch.set_grad_enabled(grad):
            qmem = _query_memory(model, state, seg)
            shared = None if below is None else below[model.key_layer]
            if shared is not None:
                r_cur = shared.detach() if model.detach else shared
            with torch.set_grad_enabled(grad and not model.detach):
                if qs.needs_query_pass and shared is None:
                    mem_kv = kv.mem if qmem is state.mem else None
                    r_cur = model._core_top(tokens, qmem, None, mem_kv=mem_kv)  # R_cur, [B, L, d]
            if nv > 0:
                fast = qs.fast_scores(model.summary, r_cur) if cache.backend == "torch" else None
                q = None
                if fast is None:  # build the queries; the fast path scores keys directly
                    inputs = _query_inputs(model, tokens, state, seg=seg, qmem=qmem, r_cur=r_cur)
                    q = qs(model.summary, inputs)
                c = model.spec.cache
                selection = cache.select(
                    q,
                    top_k=c.top_k,
                    alpha_norm=c.alpha_norm,
                    t0=state.pos,
                    score_fn=fast,
                    best_row=model.pos_mode == "match",
                )
        return r_cur, selection


def _positions(model: CRTN, selection: Selection, *, seg: int, q_len: int) -> RetrievedPositions | None:
    """The position terms of a query pass's selection (``cache.pos``, docs/method.md §3,
    "Positions of retrieved rows"): at the rows' stream distances (``real``), aligned on each
    slot's best-matching row at c = m + L + Ls (``match``), or None (``concat``: the
    concatenated context's term alone)."""
    if model.pos_mode == "real":
        return RealPositions(
            model.pos_emb,
            selection.age,
            seg_len=seg,
            q_len=q_len,
            clamp_len=model.clamp_len,
            dtype=model.dtype,
        )
    if model.pos_mode == "match":
        assert selection.row is not None
        return MatchPositions(
            model.pos_emb,
            selection.row,
            seg_len=seg,
            offset=model.mem_len + model.tgt_len + seg,
            clamp_len=model.clamp_len,
            dtype=model.dtype,
        )
    return None


class InAttention:
    """Selection inside attention (``query=gate``; docs/method.md §3, "Selection inside attention"):
    no query pass; every retrieving layer selects its own segments with its attention queries
    (:class:`crtn.model.gate.Gate`), so the context carries the gate and every filled slot's
    position terms, from which each layer takes those of its selection."""

    def find(
        self, model: CRTN, tokens: Tensor, state: CRTNState, *, below: list[Tensor] | None, kv: StepKV
    ) -> Found:
        cache = state.cache
        assert cache is not None
        if cache.n_valid == 0:
            return Found()
        c = model.spec.cache
        gate = Gate(
            cache,
            model.summary,
            top_k=c.top_k,
            alpha_norm=c.alpha_norm,
            detach=model.detach,
            first_layer=model.retrieve_from,
            t0=state.pos,
            product_dtype=model.product_dtype,
        )
        context = CacheContext(
            cache.values,
            None,
            None,
            weighted=model.weighted,
            first_layer=model.value_base,
            gate=gate,
            gate_k=min(c.top_k, cache.n_valid),
            product_dtype=model.product_dtype,
        )
        positions = None
        if model.pos_mode == "real":  # cache.pos=match is refused with a gate (CRTN.resolve)
            assert cache.pos is not None
            L = tokens.shape[1]
            every = (state.pos - cache.pos[:, None, : cache.n_valid]).expand(-1, L, -1)  # [B, L, n_valid]
            positions = RealPositions(
                model.pos_emb,
                every,
                seg_len=seg_len(model, cache),
                q_len=L,
                clamp_len=model.clamp_len,
                dtype=model.dtype,
            )
        return Found(context, positions)


class Lookup:
    """Selection by an exact lookup of the preceding tokens (``query=lookup``; docs/method.md §3,
    "Lookup of the preceding tokens"; ``lookup.py``): the keys of the n-grams ending at each token
    (of every length :func:`crtn.model.lookup.match_lengths` gives) are looked up in the cache's
    :class:`crtn.model.lookup.LookupIndex`; each token retrieves the slot holding the row after
    the most recent occurrence of its longest match, that row its best row (``cache.pos=match``),
    at alpha 1, and nothing where no length occurs. No query pass, no gradient."""

    def find(
        self, model: CRTN, tokens: Tensor, state: CRTNState, *, below: list[Tensor] | None, kv: StepKV
    ) -> Found:
        cache = state.cache
        assert cache is not None
        ends = ending_keys(model.token_window(tokens, state), model.match_lengths)
        if cache.n_valid == 0:
            return Found(ends=ends)
        assert cache.index is not None
        L = tokens.shape[1]
        queries = ends[..., ends.shape[-1] - L :]
        hit, where = cache.index.find(queries.masked_fill(queries == NO_ROW, NO_QUERY))
        found, where, _ = longest(hit, where)
        selection = cache.at_rows(where, found, t0=state.pos)
        context = CacheContext(
            cache.values,
            selection.flat_index,
            selection.alpha,
            weighted=False,
            age=selection.age,
            first_layer=model.value_base,
            product_dtype=model.product_dtype,
            retrieves=found,
        )
        positions = _positions(model, selection, seg=cache.seg_len, q_len=L)
        return Found(context, positions, selection=selection, ends=ends)


#: the three retrievers, stateless (the step passes the model)
QUERY_PASS, IN_ATTENTION, LOOKUP = QueryPass(), InAttention(), Lookup()


def _query_memory(model: CRTN, state: CRTNState, L: int) -> Tensor | None:
    """Memory of the query pass: S, and at least the stored states of X_{t-1} (docs/method.md §3 step 1)."""
    mem, cache = state.mem, state.cache
    if mem is not None and mem.shape[2] >= L:
        return mem
    if cache is not None and cache.n_insert > 0:
        newest = cache.newest_states().to(model.dtype)
        return newest if mem is None or mem.shape[2] == 0 else torch.cat([newest, mem], 2)
    return mem


def _query_inputs(
    model: CRTN, tokens: Tensor, state: CRTNState, *, seg: int, qmem: Tensor | None, r_cur: Tensor | None
) -> QueryInputs:
    """What the strategy reads; R_prev and X_{t-1} are zeros before the first segment."""
    B = tokens.shape[0]
    r_prev = state.r_prev
    if r_prev is None and model.needs_r_prev:
        r_prev = torch.zeros(B, seg, model.d_model, dtype=model.dtype, device=tokens.device)
    prev_tokens = state.prev_tokens
    if prev_tokens is None and model.query.needs_prev_tokens:
        prev_tokens = torch.zeros(B, seg, dtype=tokens.dtype, device=tokens.device)
    return QueryInputs(
        r_cur=r_cur,
        r_prev=r_prev,
        core=model._core_top_detached if model.detach else model._core_top,
        tokens=tokens,
        prev_tokens=prev_tokens,
        prev_states=None if qmem is None else qmem[:, :, -seg:],
        memory_kv=model._memory_kv_detached if model.detach else model.memory_kv,
    )


def _reported(sel: Selection) -> Selection:
    """A gate's selection [B, L, G, k] as one [B, L, G*k] (the slots any head of the layer read),
    for the retrieval statistics and recall metrics of ``LMOutput``."""
    if sel.slot.dim() == 3:
        return sel
    flat = (sel.slot, sel.flat_index, sel.alpha, sel.age)
    return Selection(*(t.flatten(2) for t in flat))
