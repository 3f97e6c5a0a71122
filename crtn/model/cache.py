"""The key-value cache of past segments and top-k retrieval (docs/method.md §3).

Per batch row the cache holds N slots. Slot i stores one past segment of Ls tokens:
its hidden states at every layer 0..n (the value V_i; with ``cache.layers`` only the layers
the model stores: the retrieving layers' inputs, after the key layer's where it lies below
them, ``CRTN._renew``), its key k_i = summary(key layer of V_i) and the stream position of
its first token.
All of it is gradient-stopped.

Storage is a ring: ``values`` is allocated once, [n+1, B*N, Ls, d] (zeros until a slot is
filled), and renewal writes one slot in place, so a step costs O(B (n+1) Ls d) whatever N
is (no copy of the cache). Rows of a batch advance in lockstep, so slots 0..n_valid-1 are the filled ones
in every row and empty slots are simply never scored.

Selection (docs/method.md §3 step 2): s_{j,i} = <q_j, k_i> / sqrt(d_key) over the valid slots;
the k best slots per
token (equal scores: the most recent slot first), re-ordered by stream position (oldest first). With fewer than k valid slots,
all valid slots are taken. The weights alpha (``cache.alpha_norm``):

- ``all``: softmax over all valid slots, alpha = softmax(s)[top-k] (the CRTN paper's
  topk(softmax(Q Keys^T)), the CRTN paper's equation); sums to at most 1 and shrinks as
  N grows;
- ``topk``: softmax over the k selected scores, alpha = softmax(s_topk); sums to 1;
- ``original``: the authors' code (xyz961014/longterm, ``CRTN/layers/transformer.py``):
  p = softmax(s) over all valid slots, then alpha = k softmax(p_topk), a softmax
  over *probabilities*; sums to k and stays within [2/(1+e), 2e/(1+e)] for k = 2.

The ``faiss`` backend finds the top-k with one faiss index per batch row and then
recomputes the k scores in torch, so gradients reach the query exactly as with the
``torch`` backend. It sees the k best scores only, so it computes exactly what ``torch``
computes for ``alpha_norm=topk`` alone; ``all`` and ``original`` need every slot's score and
are refused with faiss (:func:`resolve_cache`).

Renewal (docs/method.md §3 step 5): first in, first out; a new segment replaces the oldest slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from crtn.errors import ConfigError, check_choice
from crtn.model.faiss_index import FaissRows
from crtn.model.lookup import LookupIndex
from crtn.model.rowmatch import LeadIn
from crtn.model.spec import CacheSpec
from crtn.model.summary import Summary

#: the options of the ``cache`` config node that this module implements
ALPHA_NORMS = ("all", "topk", "original")
POS_MODES = ("concat", "real", "match")  # used by the attention (retrieved.py)
BACKENDS = ("torch", "faiss")
FAISS_INDEXES = ("flat", "hnsw")


def alpha_is_one(alpha_norm: str, top_k: int) -> bool:
    """Whether alpha is 1 whatever the scores: one slot per token (``top_k`` 1) with ``topk`` (a
    softmax over one score) or ``original`` (k times it); docs/method.md §3 step 2 and the
    module docstring. The values are then unweighted and the scores reach the loss only through
    the argmax, so they get no gradient and the query pass needs none. Pure, no errors."""
    return top_k == 1 and alpha_norm in ("topk", "original")


_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
CACHE_DTYPES = tuple(_DTYPES)


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a ``cache.dtype`` or ``cache.product_dtype`` value (None stays None).

    Raises:
        KeyError: a name not in :data:`CACHE_DTYPES` (:func:`resolve_cache` refuses it first).
    """
    return None if name is None else _DTYPES[name]


def resolve_cache(spec: CacheSpec, summary: type[Summary], *, gate: bool = False) -> CacheSpec:
    """Check the cache's own options (docs/method.md §3 steps 2 and 5, "Retrieval backends") and
    fill ``cache.pos`` None: ``match`` where token_max scores the slots for a query strategy,
    else ``concat`` (``cache.layers`` and ``cache.key_layer`` belong to the model,
    :meth:`crtn.model.crtn.CRTN.resolve`).

    Args:
        spec: the ``cache`` group; summary: the class of the model's summary (faiss needs one key
            per slot; ``pos=match`` token_max's best rows).
        gate: whether the slots are selected inside attention (``query=gate``), which has no
            best row shared by the layers.

    Raises:
        ConfigError: one line naming the key: negative sizes, an unknown option, faiss with
            ``alpha_norm`` other than topk, or with a summary whose keys are several rows,
            ``pos=match`` with a summary other than token_max (it places rows by token_max's best
            match) or with ``query=gate``.
    """
    if spec.n_slot < 0 or spec.top_k < 0:
        raise ConfigError(f"cache.n_slot={spec.n_slot} and cache.top_k={spec.top_k} must be >= 0")
    check_choice("cache.alpha_norm", spec.alpha_norm, ALPHA_NORMS)
    if spec.pos is None:
        spec = replace(spec, pos="match" if summary.name == "token_max" and not gate else "concat")
    check_choice("cache.pos", spec.pos, POS_MODES)
    check_choice("cache.backend", spec.backend, BACKENDS)
    check_choice("cache.faiss_index", spec.faiss_index, FAISS_INDEXES)
    for key in ("dtype", "product_dtype"):
        if getattr(spec, key) is not None:
            check_choice(f"cache.{key}", getattr(spec, key), CACHE_DTYPES)
    if spec.pos == "match" and summary.name != "token_max":
        raise ConfigError(
            f"cache.pos=match places retrieved rows by token_max's best-matching row: it needs "
            f"summary=token_max, not summary={summary.name}"
        )
    if spec.pos == "match" and gate:
        raise ConfigError(
            "cache.pos=match places rows by the query pass's best match, and query=gate has "
            "none (each layer selects inside attention): use cache.pos=concat or real"
        )
    if spec.backend == "faiss":
        if spec.alpha_norm != "topk":
            raise ConfigError(
                f"cache.alpha_norm={spec.alpha_norm} needs every slot's score, but cache.backend=faiss "
                "scores only the k it retrieves: use cache.alpha_norm=topk with faiss, or cache.backend=torch"
            )
        if summary.row_keys:
            raise ConfigError(
                f"cache.backend=faiss does not support summary={summary.name} (one key per slot needed)"
            )
    return spec


@dataclass
class Selection:
    """The result of top-k retrieval for one segment.

    Attributes:
        slot: [B, L, k] slot index (0..N-1) per token, ordered oldest first.
        flat_index: [B, L, k] ``b * N + slot``, rows of ``SegmentCache.values[layer]``.
        alpha: [B, L, k] retrieval weights (differentiable w.r.t. the query).
        age: [B, L, k] tokens from the current segment's first token back to the first
            token of the selected segment (a multiple of Ls).
        row: [B, L, k] long, the row r* of each selected slot that attains its score (token_max's
            best match, 0..Ls-1; ``cache.pos=match``), or None where not asked for.
        found: [B, L, k] bool, whether the token retrieves the slot at all (a lookup retrieves
            nothing where no n-gram occurs: ``lookup.py``; its entries there are slot 0 at alpha
            0), or None: every token retrieves its k slots.
    """

    slot: Tensor
    flat_index: Tensor
    alpha: Tensor
    age: Tensor
    row: Tensor | None = None
    found: Tensor | None = None

    def starts(self, t0: int) -> Tensor:
        """[B, L, k] long, the stream position of each selected slot's first token, ``t0 - age``
        (``t0``: the current segment's first position), and -2^40, a position no slot holds,
        where the token retrieves nothing (:attr:`found`)."""
        pos = t0 - self.age
        return pos if self.found is None else pos.masked_fill(~self.found, -(1 << 40))


class SegmentCache:
    """N cached segments per batch row, renewed first-in first-out (docs/method.md §3 step 5).

    Args:
        n_slot: N, slots per row.
        batch_size: B.
        summary: the model's summary: how keys are made, stored and scored.
        key_layer: the stored layer whose states keys are views of (-1: the last, the top).
        dtype: storage dtype of the values (float32, float16, bfloat16, float64); None
            stores them in the dtype of the inserted states.
        backend: ``torch`` (exact scores on the model's device) or ``faiss``.
        faiss_index: for ``faiss``: ``flat`` (exact) or ``hnsw`` (approximate).
    """

    def __init__(
        self,
        n_slot: int,
        batch_size: int,
        summary: Summary,
        key_layer: int = -1,
        dtype: str | torch.dtype | None = None,
        backend: str = "torch",
        faiss_index: str = "flat",
    ):
        assert n_slot > 0, "a cache has at least one slot (CacheSpec.enabled)"
        self.n_slot, self.batch_size = n_slot, batch_size
        self.summary = summary
        self.key_layer = key_layer
        self.dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype  # None: that of the states
        self.backend, self.faiss_index = backend, faiss_index
        self.values: Tensor | None = None  # [n+1, B*N, Ls, d]
        self.keys: Tensor | None = (
            None  # [B, N, d_key] (a gate's [B, N, n_ret, d]); None: views of the values
        )
        self.pos: Tensor | None = None  # [B, N] long, stream position of each slot's first token
        self.newest: Tensor | None = None  # [B] slot written last
        # the rows' token keys, sorted, for query=lookup (lookup.py); None for the other strategies
        self.index: LookupIndex | None = None
        self.n_insert = 0
        self._faiss: FaissRows | None = None
        self._pending: tuple | None = None
        self.select_seconds = 0.0  # wall time spent in select() (host time; faiss syncs anyway)

    # ------------------------------------------------------------------ storage
    @property
    def n_valid(self) -> int:
        """Filled slots per row (the same in every row): slots 0..n_valid-1."""
        return min(self.n_insert, self.n_slot)

    @property
    def seg_len(self) -> int:
        return 0 if self.values is None else self.values.shape[2]

    def layer_values(self, layer: int) -> Tensor:
        """States of every slot at ``layer``: [B, N, Ls, d] (a view)."""
        assert self.values is not None
        return self.values[layer].view(self.batch_size, self.n_slot, self.seg_len, -1)

    def valid_keys(self) -> Tensor:
        """Keys of the filled slots: [B, n_valid, d_key] ([B, n_valid, Ls, d] for token_max, a view)."""
        assert self.values is not None
        nv = self.n_valid
        if self.summary.key_is_view:
            return self.summary.key(self.layer_values(self.key_layer % self.values.shape[0])[:, :nv])
        assert self.keys is not None
        return self.keys[:, :nv]

    def _lead_in(self, n: int) -> LeadIn:
        """The n rows before each filled slot: the last n rows of the slot whose segment
        ends where this one starts (stream position pos - Ls), zeros where no slot does; named
        by that slot (:class:`crtn.model.rowmatch.LeadIn`, whose ``rows`` gathers them from
        the filled slots' rows [B, n_valid, Ls, d]).

        Args:
            n: rows wanted (<= Ls).
        """
        assert self.pos is not None
        pos = self.pos[:, : self.n_valid]
        sorted_pos, order = pos.sort(1)
        want = pos - self.seg_len
        i = torch.searchsorted(sorted_pos, want).clamp(max=pos.shape[1] - 1)
        found = sorted_pos.gather(1, i) == want  # [B, nv]
        return LeadIn(pred=order.gather(1, i), found=found, n=n)

    def newest_states(self) -> Tensor:
        """States of the slot written last in each row (segment X_{t-1} when mem_len=0): [n+1, B, Ls, d]."""
        assert self.values is not None and self.newest is not None and self.n_insert > 0
        rows = torch.arange(self.batch_size, device=self.values.device) * self.n_slot + self.newest
        return self.values.index_select(1, rows)

    def insert(self, states: Tensor, key: Tensor | None, pos: int, row_keys: Tensor | None = None) -> None:
        """Stage one new segment per row; it enters the cache at the next :meth:`commit`.

        Renewal writes the ring buffer in place. Deferring the write to the start of
        the next step keeps the keys and values that this step's backward pass needs
        intact; the model commits before it reads the cache.

        Args:
            states: [n+1, B, Ls, d] hidden states of the segment at layers 0..n (detached), or
                at the layers the model stores (module docstring).
            key: [B, d_key] its key ([B, n_ret, d] block keys for selection inside attention,
                ``gate.py``), or None when the summary's key is a view of the top layer
                (``summary.key_is_view``).
            pos: stream position of the segment's first token (the same in every row).
            row_keys: [n_len, B, Ls] long, the token keys of its rows for ``query=lookup``
                (:func:`crtn.model.lookup.ending_keys`), entered in :attr:`index`; else None.
        """
        self.commit()
        self._pending = (states, key, pos, row_keys)

    def commit(self) -> None:
        """Write the staged segment (if any) into its slot, replacing the oldest (FIFO)."""
        if self._pending is None:
            return
        states, key, pos, row_keys = self._pending
        self._pending = None
        n_layers, B, Ls, d = states.shape
        dev = states.device
        if self.values is None:
            self.dtype = self.dtype or states.dtype
            # zeros, not empty: a slot not yet filled is never read, but the ring is saved whole
            # in checkpoints, which should not carry uninitialised memory
            self.values = torch.zeros(n_layers, B * self.n_slot, Ls, d, dtype=self.dtype, device=dev)
            self.pos = torch.full((B, self.n_slot), -1, dtype=torch.long, device=dev)
            self.newest = torch.zeros(B, dtype=torch.long, device=dev)
            if key is not None:  # one key per slot: [B, d_key] (a gate's: [B, n_ret, d])
                self.keys = torch.zeros(B, self.n_slot, *key.shape[1:], dtype=states.dtype, device=dev)
        assert self.pos is not None
        if Ls != self.seg_len:
            raise ValueError(f"segment of {Ls} rows cannot enter a cache of {self.seg_len}-row slots")
        slot = torch.full((B,), self.n_insert % self.n_slot, dtype=torch.long, device=dev)
        rows = torch.arange(B, device=dev) * self.n_slot + slot
        self.values.index_copy_(1, rows, states.to(self.dtype))
        b = torch.arange(B, device=dev)
        if self.keys is not None:
            assert key is not None
            self.keys[b, slot] = key.to(self.keys.dtype)
        self.pos[b, slot] = pos
        self.newest = slot
        if row_keys is not None:
            self.index = self.index or LookupIndex()
            self.index.renew(row_keys, self.n_insert % self.n_slot, evict=self.n_insert >= self.n_slot)
        self.n_insert += 1
        if self.backend == "faiss":
            if self._faiss is None:
                self._faiss = FaissRows(B, self.n_slot, self.faiss_index)
            self._faiss.add(self._flat_keys(b, slot))

    def _flat_keys(self, b: Tensor, slot: Tensor) -> np.ndarray:
        keys = self.valid_keys() if self.summary.key_is_view else self.keys
        assert keys is not None
        return keys[b, slot].reshape(self.batch_size, -1).float().cpu().numpy()

    # ---------------------------------------------------------------- retrieval
    def select(
        self,
        query: Tensor | None,
        *,
        top_k: int,
        alpha_norm: str,
        t0: int,
        score_fn: Callable[[Tensor], Tensor] | None = None,
        best_row: bool = False,
    ) -> Selection:
        """Top-k slots and weights for every token (docs/method.md §3 step 2).

        Args:
            query: [B, L, d_key] queries (``token_max``: [B, L, d]), scored by the cache's summary.
            top_k: k; ``min(k, n_valid)`` slots are taken.
            alpha_norm: ``all``, ``topk`` or ``original`` (module docstring); the faiss
                backend computes ``topk`` only (:func:`resolve_cache` refuses the others).
            t0: stream position of the current segment's first token.
            score_fn: keys [B, n_valid, ...] -> scores [B, L, n_valid], replacing
                ``summary.score(query, keys)`` for the torch backend (a strategy's fast path);
                ``query`` may then be None.
            best_row: also give each selected slot's best-matching row (:attr:`Selection.row`;
                a summary whose keys are rows, scored by the torch backend without ``score_fn``:
                :func:`resolve_cache` allows ``cache.pos=match`` with token_max alone).

        Returns:
            a :class:`Selection`.

        Raises:
            ValueError: if the cache is empty.
        """
        t_start = time.perf_counter()
        nv = self.n_valid
        if nv == 0:
            raise ValueError("select() on an empty cache")
        k = min(top_k, nv)
        if self.backend == "faiss":
            assert self._faiss is not None and query is not None
            if alpha_norm != "topk":
                raise ValueError(f"alpha_norm={alpha_norm}: the faiss backend computes alpha_norm=topk only")
            B, L = query.shape[:2]
            q_np = query.detach().reshape(B, L, -1).float().cpu().numpy()
            slot = torch.from_numpy(self._faiss.search(q_np, k, self.n_insert)).to(query.device)
            keys = self.valid_keys()
            picked = keys[torch.arange(B, device=query.device)[:, None, None], slot]  # [B, L, k, ...]
            alpha = torch.softmax(self.summary.score_selected(query, picked), -1)
            self.select_seconds += time.perf_counter() - t_start
        else:
            keys = self.valid_keys()
            rows = None
            if score_fn is not None:
                scores = score_fn(keys)  # [B, L, nv]
            else:
                # token_max's n-gram match: the rows before each slot too
                lead = self._lead_in(self.summary.lead_rows) if self.summary.lead_rows > 0 else None
                if best_row:  # token_max (resolve_cache): the scores and the rows that attain them
                    scores, rows = self.summary.score(query, keys, lead=lead, best_row=True, top_k=k)
                elif lead is not None:
                    scores = self.summary.score(query, keys, lead=lead)
                else:
                    scores = self.summary.score(query, keys)
            self.select_seconds += time.perf_counter() - t_start
            return self.choose(scores, top_k=top_k, alpha_norm=alpha_norm, t0=t0, rows=rows)
        return self._chosen(slot, alpha, t0=t0)

    def choose(
        self, scores: Tensor, *, top_k: int, alpha_norm: str, t0: int, rows: Tensor | None = None
    ) -> Selection:
        """Top-k slots and their weights from given scores (docs/method.md §3 step 2).

        Args:
            scores: [B, ..., n_valid] scores of the filled slots: [B, L] tokens for
                a query strategy, [B, L, G] tokens and head groups for selection inside attention.
            top_k, alpha_norm, t0: as in :meth:`select`.
            rows: the scores' shape, long: the row of each slot that attains its score, or None
                (:attr:`Selection.row` is then None).

        Returns:
            a :class:`Selection` whose tensors have the scores' leading shape and k last.
        """
        t_start = time.perf_counter()
        k = min(top_k, scores.shape[-1])
        top_s, slot = self._top(scores, k)
        if alpha_norm == "all":
            alpha = torch.softmax(scores, -1).gather(-1, slot)
        elif alpha_norm == "original":
            alpha = k * torch.softmax(torch.softmax(scores, -1).gather(-1, slot), -1)
        else:
            alpha = torch.softmax(top_s, -1)
        self.select_seconds += time.perf_counter() - t_start
        return self._chosen(slot, alpha, t0=t0, row=None if rows is None else rows.gather(-1, slot))

    def at_rows(self, where: Tensor, found: Tensor, *, t0: int) -> Selection:
        """The selection of one cached row per token, [B, L] long ``slot * Ls + row`` (a lookup's,
        :meth:`crtn.model.lookup.LookupIndex.find`), where ``found`` [B, L] bool (elsewhere slot 0,
        row 0), at alpha 1 where found and 0 elsewhere (:attr:`Selection.found`); ``t0`` the
        current segment's first stream position."""
        seg = self.seg_len
        slot = where.div(seg, rounding_mode="floor")[..., None]
        alpha = found[..., None].float()
        chosen = self._chosen(slot, alpha, t0=t0, row=(where % seg)[..., None])
        return replace(chosen, found=found[..., None])

    def _top(self, scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The k largest scores of [B, ..., n_valid] and their slots; equal scores go to the most
        recent slot (a stable sort over the slots ordered newest first), so a selection never
        depends on where a slot sits in the ring."""
        assert self.pos is not None
        B, nv = scores.shape[0], scores.shape[-1]
        newest_first = self.pos[:, :nv].argsort(1, descending=True)  # [B, nv]
        order = newest_first.view(B, *[1] * (scores.dim() - 2), nv).expand(scores.shape)
        ordered = scores.gather(-1, order)
        if k == 1:  # the first maximum in that order (torch.max returns the first): no sort of N
            top, idx = ordered.max(-1, keepdim=True)
            return top, order.gather(-1, idx)
        ranked, idx = ordered.sort(dim=-1, descending=True, stable=True)
        return ranked[..., :k], order.gather(-1, idx[..., :k])

    def _chosen(self, slot: Tensor, alpha: Tensor, *, t0: int, row: Tensor | None = None) -> Selection:
        """The selection of ``slot`` [B, ..., k] with weights ``alpha`` (and best rows ``row``, if
        any), ordered by stream position (oldest first)."""
        assert self.pos is not None
        B = slot.shape[0]
        pos = self.pos.gather(1, slot.reshape(B, -1)).view(slot.shape)
        order = pos.argsort(-1)
        slot, pos, alpha = slot.gather(-1, order), pos.gather(-1, order), alpha.gather(-1, order)
        row = None if row is None else row.gather(-1, order)
        rows = torch.arange(B, device=slot.device) * self.n_slot
        flat = slot + rows.view(B, *[1] * (slot.dim() - 1))
        return Selection(slot=slot, flat_index=flat, alpha=alpha, age=t0 - pos, row=row)

    # ------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly (faiss indexes are rebuilt from the keys)."""
        self.commit()
        return {
            "n_slot": self.n_slot,
            "batch_size": self.batch_size,
            "n_insert": self.n_insert,
            "values": self.values,
            "keys": self.keys,
            "pos": self.pos,
            "newest": self.newest,
            "lookup": None if self.index is None else self.index.state_dict(),
            "key_view": self.summary.name if self.summary.key_is_view and self.values is not None else None,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; raises ValueError if N or B differ."""
        if sd["n_slot"] != self.n_slot or sd["batch_size"] != self.batch_size:
            raise ValueError(
                f"cache state has n_slot={sd['n_slot']}, batch {sd['batch_size']}; "
                f"expected n_slot={self.n_slot}, batch {self.batch_size}"
            )
        self.n_insert = sd["n_insert"]
        self.values, self.keys, self.pos = sd["values"], sd["keys"], sd["pos"]
        self.newest = sd["newest"]
        self.index = None
        if sd.get("lookup") is not None:
            self.index = LookupIndex()
            self.index.load_state_dict(sd["lookup"])
        if self.values is not None and self.dtype is not None and self.values.dtype != self.dtype:
            self.values = self.values.to(self.dtype)
        self._faiss = None
        if self.backend == "faiss" and self.n_insert > 0:
            self._rebuild_faiss()

    def _rebuild_faiss(self) -> None:
        """Re-create the faiss indexes from the stored keys, oldest first."""
        assert self.pos is not None
        self._faiss = FaissRows(self.batch_size, self.n_slot, self.faiss_index)
        nv = self.n_valid
        order = self.pos[:, :nv].argsort(1)  # FIFO: the same order in every row
        b = torch.arange(self.batch_size, device=order.device)
        self._faiss.first_seq = self.n_insert - nv
        for i in range(nv):
            self._faiss.add(self._flat_keys(b, order[:, i]), count=False)
        self._faiss.n_seq = self.n_insert

    def to(self, device: torch.device | str) -> SegmentCache:
        """Move the stored tensors to ``device`` (in place); returns self."""
        for name in ("values", "keys", "pos", "newest"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device))
        if self.index is not None:
            self.index.load_state_dict({k: v.to(device) for k, v in self.index.state_dict().items()})
        return self
