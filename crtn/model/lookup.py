"""Retrieval by an exact lookup of the preceding tokens (``query=lookup``; docs/method.md §3,
"Lookup of the preceding tokens").

token_max's n-gram match (``rowmatch.py``) scores every row of every slot for every token, so its
cost grows with N Ls per token. When the match is on the tokens themselves it needs no product:
token j's query is the tokens that end at it, x_{j-w+1..j}, and a cached row r is keyed by the w
tokens before it, x_{r-w..r-1} (``summary.shift`` 1; with shift 0 by x_{r-w+1..r}), so a key
equal to the query marks a row whose predecessors repeat the query's: with shift 1 the row is
the token that followed the earlier occurrence, the one a copy predicts (an induction head's
lookup, Olsson et al. 2022; an infini-gram's, Liu et al. 2024).

Each token looks up the lengths w = ``summary.ngram``, twice that, ... below
``query.max_match``, and ``query.max_match`` (:func:`match_lengths`), and takes the longest that
occurs, at its most recent occurrence; a token none of whose lengths occurs retrieves nothing
(its retrieved rows are masked out of the attention: ``CacheContext.retrieves``). The rows of
one length are kept sorted by key in a :class:`LookupIndex` renewed with the cache, so a step
costs O(L log(N Ls)) for the lookups and O(N Ls) of memory traffic for the renewal, with no
product and no per-token pass over the cache.

Keys are a hash of the tokens (:func:`ending_keys`), so two different n-grams share a key with
probability about 2^-47 per pair (a multiplicative hash modulo 2^64 with odd random
multipliers, its top bit cleared); tests compare the lookup with a token-by-token loop.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

#: key of a row whose w tokens reach before its stream's start, and of such a query: never equal
NO_ROW, NO_QUERY = -1, -2
_TOP_BIT_CLEAR = (1 << 63) - 1


def match_lengths(ngram: int, max_match: int) -> tuple[int, ...]:
    """The n-gram lengths a token looks up, shortest first: ``ngram``, 2 ``ngram``, ... below
    ``max_match``, then ``max_match``. Pure; ``max_match >= ngram >= 1`` (checked by
    :meth:`crtn.model.query.Lookup.resolve`)."""
    out, w = [], ngram
    while w < max_match:
        out.append(w)
        w *= 2
    return (*out, max_match)


@functools.cache
def _multipliers(n: int, device: torch.device) -> Tensor:
    """n odd 63-bit multipliers, the same in every process (a fixed seed); made once per length
    and device, not every step."""
    gen = torch.Generator().manual_seed(0x1F0C4)
    return (torch.randint(0, 1 << 61, (n,), generator=gen) * 2 + 1).to(device)


@functools.cache
def _columns(lengths: tuple[int, ...], device: torch.device) -> Tensor:
    """The window columns w - 1 of the lengths w, made once per lengths and device (not copied to
    the device every step)."""
    return torch.tensor([w - 1 for w in lengths], device=device)


def ending_keys(tokens: Tensor, lengths: tuple[int, ...]) -> Tensor:
    """The key of the w tokens ending at every position, for each length w.

    The hash of x_{p-w+1..p} is sum_{a<w} x_{p-a} m_a modulo 2^64 (odd multipliers m_a,
    :func:`_multipliers`), computed for every w at once as a running sum over the window of the
    max(lengths) tokens ending at p: a dozen tensor operations per step whatever the lengths,
    where a loop over the offsets a would issue several per offset (on a GPU, each a kernel
    launch). Sums wrap modulo 2^64 in any order, so the keys do not depend on how the sum runs.

    Args:
        tokens: [B, S] long, token ids >= 0, or -1 where the token is unknown (before the stream's
            start).
        lengths: the lengths w, each in 1..S.

    Returns:
        [n_len, B, S] long: at [i, b, p] a hash >= 0 of x_{p-w+1..p} (w = ``lengths[i]``), or
        :data:`NO_ROW` where one of those tokens is unknown or lies before the first column.
    """
    W = max(lengths)
    mult = _multipliers(W, tokens.device)
    back = F.pad(tokens, (W - 1, 0), value=-1).unfold(1, W, 1).flip(-1)  # [B, S, W]: x_{p-a} at a
    acc = (back * mult).cumsum(-1)  # [B, S, W]: the hash of length a + 1, wrapped modulo 2^64
    known = (back < 0).cumsum(-1) == 0  # no unknown token among x_{p-a..p}
    pick = _columns(lengths, tokens.device)
    keys = torch.where(known[..., pick], acc[..., pick] & _TOP_BIT_CLEAR, NO_ROW)
    return keys.permute(2, 0, 1).contiguous()


class LookupIndex:
    """The cached rows' keys, per length and stream, sorted by key and, among equal keys, by
    stream position (oldest first), renewed first-in first-out with the cache.

    Attributes:
        keys: [n_len, B, R] long, R = filled slots x Ls, sorted along the last axis.
        where: [n_len, B, R] long, the row of each key: ``slot * Ls + row`` in the ring of
            :class:`crtn.model.cache.SegmentCache`.
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.where: Tensor | None = None

    def renew(self, keys: Tensor, slot: int, evict: bool) -> None:
        """Enter one slot's row keys, [n_len, B, Ls] (those of ring slot ``slot``, stream positions
        ascending), after removing the rows of the slot it replaces where ``evict``. Costs one
        merge, O(R) memory traffic, and no host sync (every size is known without reading the
        device): the evicted slot's Ls rows per stream are dropped by a running count of the kept
        ones; the new keys, sorted (stable), go after every equal older key (``searchsorted``
        right) and each older key after the new keys below it (``searchsorted`` left)."""
        n, B, Ls = keys.shape
        new_k, order = keys.sort(dim=-1, stable=True)
        new_w = order + slot * Ls
        if self.keys is None or self.where is None:
            self.keys, self.where = new_k, new_w
            return
        old_k, old_w = self.keys, self.where
        if evict:
            old_k, old_w = _drop_slot(old_k, old_w, slot, Ls)
        R = old_k.shape[-1]
        dest_new = torch.searchsorted(old_k, new_k, right=True) + torch.arange(Ls, device=keys.device)
        dest_old = torch.searchsorted(new_k, old_k) + torch.arange(R, device=keys.device)
        self.keys, self.where = (
            old.new_empty(n, B, R + Ls).scatter_(-1, dest_new, new).scatter_(-1, dest_old, old)
            for new, old in ((new_k, old_k), (new_w, old_w))
        )

    @classmethod
    def of_slots(cls, row_keys: Tensor, oldest_first: Tensor) -> LookupIndex:
        """The index of a whole cache at once (one sort, not N merges): ``row_keys`` [n_len, B, N,
        Ls] of the ring's slots, ``oldest_first`` [N] long the ring slots in stream order."""
        n, B, N, Ls = row_keys.shape
        ordered = row_keys[:, :, oldest_first].reshape(n, B, N * Ls)
        where = (oldest_first[:, None] * Ls + torch.arange(Ls, device=row_keys.device)).reshape(-1)
        index = cls()
        index.keys, order = ordered.sort(dim=-1, stable=True)
        index.where = where[order]
        return index

    def find(self, queries: Tensor) -> tuple[Tensor, Tensor]:
        """The most recent row whose key equals each query, per length.

        Args:
            queries: [n_len, B, L] long keys (:func:`ending_keys`; :data:`NO_QUERY` for none).

        Returns:
            (hit [n_len, B, L] bool, where [n_len, B, L] long: ``slot * Ls + row`` of the most
            recent equal key; 0 where there is none).
        """
        assert self.keys is not None and self.where is not None
        i = torch.searchsorted(self.keys, queries, right=True) - 1
        j = i.clamp(min=0)
        hit = (i >= 0) & (self.keys.gather(-1, j) == queries)
        return hit, torch.where(hit, self.where.gather(-1, j), 0)

    def state_dict(self) -> dict[str, Any]:
        """The index as saved with the cache (:meth:`crtn.model.cache.SegmentCache.state_dict`):
        ``{"keys", "where"}``, each [n_len, B, R] long, or None before the first renewal. The
        tensors are the index's own, not copies."""
        return {"keys": self.keys, "where": self.where}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output, so that a run continues from a checkpoint with the
        same lookups as without the stop.

        Raises:
            KeyError: ``sd`` lacks ``keys`` or ``where``.
        """
        self.keys, self.where = sd["keys"], sd["where"]


def _drop_slot(keys: Tensor, where: Tensor, slot: int, Ls: int) -> tuple[Tensor, Tensor]:
    """``keys`` and ``where`` [n_len, B, R] without the Ls entries per stream of ring slot
    ``slot``, the others in their order: each kept entry goes to the count of kept entries before
    it, each dropped one to a spare last column that is cut off ([n_len, B, R - Ls] each,
    contiguous, as ``searchsorted`` wants them)."""
    R = keys.shape[-1]
    keep = where.div(Ls, rounding_mode="floor") != slot
    dest = torch.where(keep, keep.cumsum(-1) - 1, R - Ls)
    kept_keys, kept_where = (
        t.new_empty(*t.shape[:-1], R - Ls + 1).scatter_(-1, dest, t)[..., : R - Ls].contiguous()
        for t in (keys, where)
    )
    return kept_keys, kept_where


def longest(hit: Tensor, where: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per token the longest length that occurs (:meth:`LookupIndex.find`'s ``hit``, ``where``,
    lengths shortest first): (found [B, L] bool, where [B, L] long, length index [B, L] long,
    -1 where none occurs)."""
    n = hit.shape[0]
    rank = torch.arange(1, n + 1, device=hit.device).view(n, 1, 1)
    best = (hit * rank).amax(0) - 1  # [B, L], the longest hit's index, -1: none
    pick = best.clamp(min=0)[None]
    return best >= 0, where.gather(0, pick)[0], best
