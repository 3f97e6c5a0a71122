"""The cache's faiss backend: one inner-product index per batch row, for a large cache at
evaluation (docs/method.md §3, "Retrieval backends"). :class:`crtn.model.cache.SegmentCache`
keeps the keys and values and asks :class:`FaissRows` for the top-k slots of each query.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

#: HNSW's links per node (M), candidates explored while adding a key (efConstruction) and per
#: search (efSearch): measured at these values in docs/results.md, "Performance"
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 64, 128


class FaissRows:
    """One faiss inner-product index per batch row, for large N at evaluation (docs/method.md §3 backends).

    Slots enter in FIFO order and receive sequence numbers 0, 1, 2, ...; the slot of
    sequence number s is ``s % N``. Entries are never removed from an index (HNSW
    cannot remove): a search is restricted to the live sequence numbers
    [n_insert - N, n_insert) with an ``IDSelectorRange``, and an index is rebuilt from
    the live keys once it holds 2N entries, so ids stay consistent and the work per
    step stays O(1) amortised.

    Args:
        batch_size, n_slot: B rows, N slots per row.
        index: ``flat`` (``IndexFlatIP``, exact) or ``hnsw`` (``IndexHNSWFlat``, approximate).
    """

    def __init__(self, batch_size: int, n_slot: int, index: str = "flat"):
        import faiss  # deferred: only the faiss backend needs it

        self.faiss = faiss
        self.batch_size, self.n_slot, self.index = batch_size, n_slot, index
        self.indexes: list[Any] = []
        self.first_seq = 0  # sequence number of internal id 0
        self.n_seq = 0  # sequence numbers handed out
        self._live: deque[np.ndarray] = deque(maxlen=n_slot)  # live keys, oldest first, for rebuilds

    def _new_index(self, d: int) -> Any:
        faiss = self.faiss
        if self.index == "hnsw":
            index = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
            return index
        return faiss.IndexFlatIP(d)

    def add(self, keys: np.ndarray, count: bool = True) -> None:
        """Add one key per row: keys [B, d_key] float32."""
        keys = np.ascontiguousarray(keys, dtype=np.float32)
        if not self.indexes:
            self.indexes = [self._new_index(keys.shape[1]) for _ in range(self.batch_size)]
        if self.indexes[0].ntotal >= 2 * self.n_slot:
            self._rebuild()
        for b, index in enumerate(self.indexes):
            index.add(keys[b : b + 1])
        self._live.append(keys)
        if count:
            self.n_seq += 1

    def _rebuild(self) -> None:
        live = list(self._live)[1:]  # the oldest is being replaced
        self.first_seq = self.n_seq - len(live)
        self.indexes = [self._new_index(self.indexes[0].d) for _ in range(self.batch_size)]
        for keys in live:
            for b, index in enumerate(self.indexes):
                index.add(keys[b : b + 1])

    def search(self, queries: np.ndarray, k: int, n_insert: int) -> np.ndarray:
        """Top-k live slots per query: queries [B, L, d_key] float32 -> slots [B, L, k] int64."""
        faiss = self.faiss
        lo = max(0, n_insert - self.n_slot) - self.first_seq
        hi = n_insert - self.first_seq
        sel = faiss.IDSelectorRange(lo, hi)
        if self.index == "hnsw":
            params = faiss.SearchParametersHNSW(sel=sel, efSearch=HNSW_EF_SEARCH)
        else:
            params = faiss.SearchParameters(sel=sel)
        B, L, _ = queries.shape
        out = np.empty((B, L, k), dtype=np.int64)
        for b, index in enumerate(self.indexes):
            _, ids = index.search(np.ascontiguousarray(queries[b]), k, params=params)
            if (ids < 0).any():  # approximate search returned fewer than k: pad with the newest slot
                ids = np.where(ids < 0, hi - 1, ids)
            out[b] = (ids + self.first_seq) % self.n_slot
        return out
