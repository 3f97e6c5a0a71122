"""Loss by distance to the previous occurrence of the target (Rae & Razavi 2020, "Do Transformers
Need Deep Long-Range Memory?"; Sun et al. 2021, "Do Long-Range Language Models Actually Use
Long-Range Context?"; docs/method.md §5).

For every evaluated target token ``x_p`` (position ``p`` of a split; the model predicts it from
``x_{<p}``) two distances are measured *inside the target's stream* (evaluation cuts a split into
``B`` contiguous streams, :class:`crtn.data.StreamIterator`; memory and cache never cross a
stream's start, docs/method.md §4):

(a) ``symbol``: ``p - q`` for the nearest ``q < p`` with ``x_q = x_p``;
(b) ``ngram``: for the longest ``n <= 4`` such that the n-gram ``x_{p-n+1..p}`` occurred before,
    the distance end to end, ``p - q`` with ``x_{q-n+1..q} = x_{p-n+1..p}``. Both n-grams must lie
    wholly inside the stream (``q - n + 1 >= s`` and ``p - n + 1 >= s``, ``s`` the stream's start).

Without such an occurrence the token is a *first occurrence*. The nearest previous occurrence in
the whole split is also the nearest in the stream when it lies inside the stream, so the
per-split arrays of :func:`previous_occurrences` (computed once, independent of ``B``, cached
beside the corpus cache by :func:`split_occurrences`) and the stream start are enough.

Buckets (:data:`BUCKETS`): ``first``, ``1-31``, ``32-127``, ``128-511``, ``512-2047``,
``2048-8191``, ``>=8192`` tokens. Per bucket :func:`bucket_summary` reports the token count, the
mean NLL (nats) and the bucket's share of the summed NLL, and marks the bucket against the
model's reach :func:`model_reach`: ``R = dependency_range(m, N, L) + L = m + N·L + L`` (N = 0
without a cache), the largest distance at which a target's previous occurrence can still be
attended to directly, in one layer (the last position of a segment reaches ``R``, the first
only ``R - L + 1``). A bucket ``[lo, hi]`` is ``within`` when ``hi <= R``, ``beyond`` when
``lo > R`` (no target of the bucket can see its previous occurrence in one layer), else
``partly``. Models without a cache also get ``layer_reach``, the same marks against
``n_layer·m + L``, how far the recurrence carries information through the layers
(Dai et al. 2019, section 3.2).

In :func:`crtn.evaluate.evaluate`, :class:`DistanceBuckets` turns the arrays into one bucket
code per stream position once per evaluation, on the device; each segment then costs a slice
and two ``index_add_`` (no host synchronisation).
"""

from __future__ import annotations

import hashlib
import logging
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from crtn.model import dependency_range
from crtn.utils import atomic_write

log = logging.getLogger(__name__)

#: Longest n-gram matched by the ``ngram`` analysis.
MAX_NGRAM = 4
#: Lower edges of the distance buckets after the first one (tokens).
BUCKET_EDGES = (32, 128, 512, 2048, 8192)
#: Bucket names: first occurrence, then distances [1, 31], [32, 127], ..., [8192, inf).
BUCKETS = ("first", "1-31", "32-127", "128-511", "512-2047", "2048-8191", ">=8192")
#: (lo, hi) of each bucket in tokens, inclusive; None for the first-occurrence bucket's and the last's hi.
BUCKET_RANGES = ((None, None), (1, 31), (32, 127), (128, 511), (512, 2047), (2048, 8191), (8192, None))
#: Bump when the cached arrays' meaning or format changes.
CACHE_VERSION = 1


# ====================================================================== per-split arrays
def _previous_equal(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each i, the largest j < i with ``keys[j] == keys[i]`` (-1 if none), and the dense rank of
    ``keys[i]`` among the distinct keys; one stable argsort, O(n log n)."""
    n = len(keys)
    order = np.argsort(keys, kind="stable")  # equal keys stay in position order
    ordered = keys[order]
    same = ordered[1:] == ordered[:-1]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[1:][same]] = order[:-1][same]
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.cumsum(np.concatenate(([0], ~same)))
    return prev, rank


def previous_occurrences(ids: np.ndarray | torch.Tensor, max_n: int = MAX_NGRAM) -> np.ndarray:
    """Where each n-gram ending at each position occurred last before, in the whole split.

    Args:
        ids: [N] integer symbol ids of one split.
        max_n: longest n-gram.

    Returns:
        [max_n, N], int32 (int64 from 2^31 tokens on): ``prev[n-1, p]`` = the largest end position ``q < p`` with
        ``x_{q-n+1..q} = x_{p-n+1..p}``, or -1 when there is none or ``p < n-1``. Row 0 is the
        previous occurrence of the symbol itself. n-grams are identified without overflow by
        ``rank_{n-1}[p-1] * V + x_p`` (the dense rank of the (n-1)-gram ending at ``p-1``).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n_tok = len(ids)
    prev = np.full((max_n, n_tok), -1, dtype=np.int64)
    if n_tok == 0:
        return prev.astype(_dtype(0))
    base = int(ids.max()) + 1
    prev[0], rank = _previous_equal(ids)
    for n in range(2, max_n + 1):
        if n_tok < n:
            break
        # n-grams end at positions n-1 .. N-1; rank covers (n-1)-grams ending at n-2 .. N-1
        keys = rank[:-1] * base + ids[n - 1 :]
        p_prev, rank = _previous_equal(keys)
        prev[n - 1, n - 1 :] = np.where(p_prev >= 0, p_prev + n - 1, -1)
    return prev.astype(_dtype(n_tok))


def _dtype(n_tok: int) -> type:
    """Positions of a split of ``n_tok`` tokens: int32 while they fit (half the cache file)."""
    return np.int32 if n_tok < 2**31 else np.int64


def _valid(prev: Any, ids: np.ndarray) -> bool:
    """Whether a loaded array can be the :func:`previous_occurrences` of ``ids`` (shape, range, symbols)."""
    n_tok = len(ids)
    if not isinstance(prev, np.ndarray) or prev.shape != (MAX_NGRAM, n_tok) or prev.dtype != _dtype(n_tok):
        return False
    pos = np.arange(n_tok)
    if not ((prev >= -1) & (prev < pos)).all():
        return False
    for row in prev:  # the n-gram's last symbol must match
        hit = row >= 0
        if not (ids[row[hit]] == ids[hit]).all():
            return False
    return True


def _cache_key(ids: np.ndarray) -> str:
    digest = hashlib.sha256(f"prev-occurrences v{CACHE_VERSION} n{MAX_NGRAM}\n".encode())
    digest.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return digest.hexdigest()[:20]


def cached_previous_occurrences(ids: np.ndarray, folder: Path) -> np.ndarray:
    """:func:`previous_occurrences` of ``ids``, read from or written to ``folder``.

    The file ``prevocc-<key>.npy`` is keyed by the split's content (sha256 of the ids), so any
    corpus, split or encoding gets its own. As the corpus cache (:mod:`crtn.data.corpus`): built
    once under a :class:`filelock.FileLock`, written atomically (:func:`crtn.utils.atomic_write`);
    an unreadable or inconsistent file is rebuilt; a folder that cannot be written only costs the
    cache (a warning), never the evaluation.
    """
    path = folder / f"prevocc-{_cache_key(ids)}.npy"
    prev = _load(path, ids)
    if prev is not None:
        return prev
    try:
        with FileLock(str(path.with_suffix(".lock"))):
            prev = _load(path, ids)  # another process may have built it while we waited
            if prev is None:
                prev = previous_occurrences(ids)
                atomic_write(path, lambda f: np.save(f, prev, allow_pickle=False), mode=None)
                log.info("cached the previous occurrences of %d tokens in %s", len(ids), path)
    except OSError as e:
        warnings.warn(
            f"cannot cache {str(path)!r} ({e.strerror or e}); computed without a cache", stacklevel=2
        )
        prev = previous_occurrences(ids) if prev is None else prev
    return prev


def _load(path: Path, ids: np.ndarray) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        prev = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError):
        return None
    return prev if _valid(prev, ids) else None


def split_occurrences(corpus: Any, split: str) -> np.ndarray:
    """:func:`previous_occurrences` of ``corpus.splits[split]``, cached in the corpus's cache folder
    (``corpus.info["cache_dir"]``) when it has one, else computed (the synthetic corpus, a corpus
    read without a cache).

    Returns:
        [MAX_NGRAM, N] (see :func:`previous_occurrences`), N the split's length.
    """
    ids = corpus.splits[split].numpy()
    folder = corpus.info.get("cache_dir") if corpus.info.get("cache") in ("loaded", "built") else None
    if folder is None or not Path(folder).is_dir():
        return previous_occurrences(ids)
    return cached_previous_occurrences(ids, Path(folder))


# ====================================================================== per-stream buckets
def _bucket_of(dist: np.ndarray) -> np.ndarray:
    """Bucket index (1..6) of distances >= 1."""
    return 1 + np.searchsorted(np.asarray(BUCKET_EDGES), dist, side="right")


def stream_codes(prev: np.ndarray, n_stream: int, stream_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Bucket codes of every position of the first ``n_stream * stream_len`` tokens of a split cut
    into ``n_stream`` streams of ``stream_len`` (:class:`crtn.data.StreamIterator`).

    Args:
        prev: [max_n, N] from :func:`previous_occurrences`, N >= n_stream * stream_len.

    Returns:
        ``(symbol, ngram)``, uint8 [n_stream, stream_len]: ``symbol`` is the bucket (index into
        :data:`BUCKETS`, 0 = first occurrence) of the distance (a); ``ngram`` is ``bucket *
        (max_n + 1) + n`` for the longest previous n-gram (b), ``n`` = 0 for a first occurrence.
        Only occurrences inside the position's stream count (module docstring).
    """
    max_n = prev.shape[0]
    n_pos = n_stream * stream_len
    pos = np.arange(n_pos, dtype=np.int64)
    start = pos - pos % stream_len
    first = prev[0, :n_pos] < start
    symbol = np.where(first, 0, _bucket_of(pos - prev[0, :n_pos]))
    longest = np.zeros(n_pos, dtype=np.int64)
    for n in range(1, max_n + 1):
        inside = (pos - n + 1 >= start) & (prev[n - 1, :n_pos] - n + 1 >= start)
        longest[inside] = n  # an n-gram that occurred implies its (n-1)-gram suffix did
    dist = pos - prev[np.maximum(longest - 1, 0), pos]
    ngram = np.where(longest == 0, 0, _bucket_of(dist) * (max_n + 1) + longest)
    shape = (n_stream, stream_len)
    return symbol.astype(np.uint8).reshape(shape), ngram.astype(np.uint8).reshape(shape)


def model_reach(model: Any) -> tuple[int, int | None]:
    """(reach, layer_reach) in tokens of a model with its current lengths (module docstring):
    ``dependency_range(m, N, L) + L`` with N the cache slots in use (0 without a cache), and for a
    model without a cache ``n_layer·m + L`` (None with a cache)."""
    cached = model.has_cache and model.spec.cache.enabled
    n_slot = model.n_slot if cached else 0
    reach = dependency_range(model.mem_len, n_slot, model.tgt_len) + model.tgt_len
    layer = None if model.has_cache else model.n_layer * model.mem_len + model.tgt_len
    return reach, layer


def _mark(i: int, reach: int | None) -> str | None:
    lo, hi = BUCKET_RANGES[i]
    if reach is None or lo is None:
        return None
    if hi is not None and hi <= reach:
        return "within"
    return "beyond" if lo > reach else "partly"


def bucket_summary(sums: torch.Tensor, reach: int, layer_reach: int | None = None) -> dict[str, Any]:
    """The JSON of ``distance_buckets`` from the NLL sums and token counts of every code.

    Args:
        sums: float64 [2, 7 + 7·(MAX_NGRAM+1)] (row 0: summed NLL in nats, row 1: tokens): the
            :data:`BUCKETS` of (a), then the codes ``bucket * (MAX_NGRAM+1) + n`` of (b).
        reach, layer_reach: see :func:`model_reach`.

    Returns:
        ``{"reach_tokens", "layer_reach_tokens", "tokens", "loss", "symbol": {bucket: entry},
        "ngram": {bucket: entry}}``; an entry has ``lo``, ``hi`` (tokens, inclusive; None
        unbounded), ``tokens``, ``loss`` (mean NLL, nats; None when empty), ``loss_share`` (of the
        summed NLL), ``reach`` (within / partly / beyond, None for ``first``), ``layer_reach``
        likewise when given, and for (b) ``ngram_tokens``: tokens per longest n-gram length n.
    """
    sums = sums.detach().double().cpu()
    k = len(BUCKETS)
    sym = sums[:, :k]
    ngr = sums[:, k:].reshape(2, k, MAX_NGRAM + 1)
    total_nll, total_n = sym[0].sum().item(), sym[1].sum().item()
    out: dict[str, Any] = {
        "reach_tokens": reach,
        "layer_reach_tokens": layer_reach,
        "tokens": int(total_n),
        "loss": total_nll / total_n if total_n else None,
    }
    for name, per in (("symbol", sym), ("ngram", ngr.sum(-1))):
        table = {}
        for i, label in enumerate(BUCKETS):
            nll, n = per[0, i].item(), per[1, i].item()
            lo, hi = BUCKET_RANGES[i]
            entry: dict[str, Any] = {"lo": lo, "hi": hi, "tokens": int(n), "loss": nll / n if n else None}
            entry["loss_share"] = nll / total_nll if total_nll else None
            entry["reach"] = _mark(i, reach)
            if layer_reach is not None:
                entry["layer_reach"] = _mark(i, layer_reach)
            if name == "ngram":
                entry["ngram_tokens"] = {str(g): int(ngr[1, i, g].item()) for g in range(1, MAX_NGRAM + 1)}
            table[label] = entry
        out[name] = table
    return out


class DistanceBuckets:
    """NLL sums and token counts per distance bucket during one evaluation (module docstring).

    Args:
        corpus: a :class:`crtn.data.Corpus`; split: its split being evaluated.
        it: the evaluation's :class:`crtn.data.StreamIterator` (streams, rank, ``tgt_len``).
        device: where the codes and sums live.
    """

    def __init__(self, corpus: Any, split: str, it: Any, device: torch.device | str):
        prev = split_occurrences(corpus, split)
        symbol, ngram = stream_codes(prev, it.batch_size, it.stream_len)
        rows = slice(it.rank * it.local_batch_size, (it.rank + 1) * it.local_batch_size)
        self.symbol = torch.from_numpy(symbol[rows]).to(device)  # uint8 [B_local, n]
        self.ngram = torch.from_numpy(ngram[rows] + len(BUCKETS)).to(device)  # codes after (a)'s
        self.tgt_len = it.tgt_len
        self.sums = torch.zeros(2, len(BUCKETS) * (MAX_NGRAM + 2), dtype=torch.float64, device=device)

    def add(self, index: int, nll: torch.Tensor) -> None:
        """Add segment ``index``'s per-token NLL [B_local, L'] (targets at stream columns
        ``index·L + 1 ..``)."""
        start = index * self.tgt_len + 1
        cols = slice(start, start + nll.shape[1])
        codes = torch.cat([self.symbol[:, cols].reshape(-1), self.ngram[:, cols].reshape(-1)]).long()
        values = nll.reshape(-1).double().repeat(2)
        self.sums[0].index_add_(0, codes, values)
        self.sums[1].index_add_(0, codes, torch.ones_like(values))

    def summary(self, model: Any, corpus: Any, split: str) -> dict[str, Any]:
        """:func:`bucket_summary` with the model's reach, headed by the corpus, split and model names."""
        reach, layer = model_reach(model)
        head = {"corpus": corpus.name, "split": split, "model": getattr(model, "name", None)}
        return {**head, **bucket_summary(self.sums, reach, layer)}
