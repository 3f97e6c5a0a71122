#!/usr/bin/env python
"""Whether an exact lookup of the preceding tokens would retrieve what the learned row match does.

    python tools/lookup_agreement.py CHECKPOINT [--n-slot N] [--segments S] [--max-len 32]
        [--split valid] [--batch-size 16]

``token_max``'s row match (docs/method.md §3, "Summaries"; :func:`crtn.model.rowmatch.ngram_row_scores`)
reads every row of every slot for every query, so its cost grows with N Ls. A lookup on the
tokens themselves does not: the *longest-suffix match* of query position p is the largest
l <= ``--max-len`` such that the l tokens ending at p, x_{p-l+1..p}, also end at some earlier
position q, with q + 1 inside the cache (the N segments before the memory's m positions; q + 1
is the token that followed the earlier occurrence, the one a copy would predict:
``summary.shift`` 1 keys a row by the rows before it in the same way). Such
a lookup is exact, costs the same at any N with a suffix index, and is what an induction head or
an infinity-gram model reads (Olsson et al. 2022; Liu et al. 2024, "Infini-gram").

The tool runs the checkpoint over a split as ``crtn-eval`` does (``--batch-size`` streams, memory
and cache carried over, the cache at ``--n-slot`` slots, by default the trained number) and, for
each of the ``--segments`` segments once the cache is full, compares with the lookup the slot
and row the model selected (its reported selection: :attr:`crtn.model.crtn.LMOutput.selection`,
``Selection.age`` and ``Selection.row``, the best-matching row, with ``cache.pos=match``).
Per length l of the longest match (:data:`BUCKETS`) it prints the share of the queries, the
share whose selected slot holds the token after one of the longest matches (*slot agrees*), the
share whose selected best row is that token (*row agrees*; empty without ``Selection.row``),
the share whose selected slot is the one of the most recent longest match, the mean loss of the
next token with the cache, with it empty (the same weights, ``eval.n_slot=0``: docs/method.md
§5, "What the cache contributes") and gated (below), and the bucket's share of what the cache removes from the
summed loss: whether the cache's gain lies where a lookup would retrieve the same. A third run
of the same model retrieves only where the longest match is :data:`GATE_LEN` tokens or longer
(the other queries' retrieved rows masked: :func:`retrieving_only`), the gating a lookup
retriever would apply, measured on a trained model without training it again; the last row of
the table gives the three mean losses.

Raises SystemExit with one line when the checkpoint's retrieval is not a query strategy's
selection of one slot per token through ``summary=token_max`` (Transformer-XL, ``query=gate``,
``cache.top_k`` above 1), or places the retrieved rows by ``cache.pos=real`` (whose position
term the gated run cannot mask).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor

#: the shortest longest match at which the gated run retrieves (:func:`retrieving_only`)
GATE_LEN = 4
#: the three runs whose losses are summed: with the cache, with it empty, gated
RUNS = ("with", "empty", "gated")
#: the lengths l of the longest match reported apart: 0 (no earlier occurrence of the token), then
#: [lo, hi) ranges; the last one ends at --max-len inclusive
BUCKETS = ((0, 1), (1, 4), (4, 8), (8, 16), (16, None))


def longest_suffix(
    tokens: Tensor, queries: tuple[int, int], cached: tuple[int, int], max_len: int
) -> tuple[Tensor, Tensor]:
    """Longest-suffix matches of the queries p = first .. first + n_query - 1 of every stream
    against the earlier positions q in [lo - 1, hi - 1), so that q + 1 lies in the cache's
    positions [lo, hi).

    Args:
        tokens: [B, S] long, each stream's tokens from its start (S >= first + n_query).
        queries: (first, n_query), the first query's position and the queries per stream.
        cached: (lo, hi), the cached positions: the oldest cached segment's first position to
            the memory's first (the cache holds the N segments before the memory).
        max_len: the longest match measured.

    Returns:
        (length [B, n_query] long, 0..max_len: the longest l with x_{p-l+1..p} = x_{q-l+1..q} for
        some q (every compared position >= 0), ends [B, n_query, R] bool: which q, from lo - 1 on,
        attain it; all False where the length is 0).

    Raises:
        ValueError: unless 1 <= lo < hi <= first.
    """
    (first, n_query), (lo, hi) = queries, cached
    if not 1 <= lo < hi <= first:
        raise ValueError(
            f"longest_suffix: the cached range [{lo}, {hi}) must start at 1 or later and end by {first}"
        )
    B = tokens.shape[0]
    p = torch.arange(first, first + n_query)
    q = torch.arange(lo - 1, hi - 1)
    run = torch.ones(B, n_query, len(q), dtype=torch.bool)
    length = torch.zeros(B, n_query, len(q), dtype=torch.long)
    for a in range(max_len):
        pa, qa = p - a, q - a
        ok = (pa >= 0)[:, None] & (qa >= 0)[None, :]
        same = tokens[:, pa.clamp(min=0)][:, :, None] == tokens[:, qa.clamp(min=0)][:, None, :]
        run &= same & ok
        length += run
    best = length.amax(-1)
    return best, (length == best[..., None]) & (best[..., None] > 0)


@contextlib.contextmanager
def retrieving_only(where: Tensor) -> Iterator[None]:
    """Inside, the retrieving layers give the retrieved rows of the queries where ``where`` [B, L]
    bool is False a score of -inf (added to their position term of the concatenated context, which
    ``cache.pos`` concat and match keep): those queries attend to the memory and the segment
    alone, as with an empty cache, and the others as before. Restored on exit."""
    import crtn.model.attention as attention

    inner = attention.attend_with_cache

    def gated(attn: object, score: Tensor, bd_cache: Tensor, **kw: object) -> Tensor:
        block = torch.zeros(where.shape, dtype=bd_cache.dtype).masked_fill(~where, float("-inf"))
        return inner(attn, score, bd_cache + block[:, None, :, None], **kw)

    attention.attend_with_cache = gated
    try:
        yield
    finally:
        attention.attend_with_cache = inner


@dataclass
class Agreement:
    """Counts per bucket of the longest match's length (:data:`BUCKETS`): queries, slot agrees,
    row agrees (and queries with a row reported), most recent slot agrees; and the summed loss
    (nats) of the queries' next tokens with the cache, with it empty (``eval.n_slot=0``, the
    same weights: docs/method.md §5, "What the cache contributes") and with retrieval where the
    longest match is :data:`GATE_LEN` or longer only (*gated*, :func:`retrieving_only`)."""

    counts: dict[str, list[int]] = field(default_factory=lambda: {k: [0] * len(BUCKETS) for k in _KEYS})
    nll: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0] * len(BUCKETS) for k in RUNS})

    def add(
        self,
        length: Tensor,
        ends: Tensor,
        chosen: tuple[Tensor, Tensor | None],
        *,
        lo: int,
        seg: int,
        nll: tuple[Tensor, Tensor, Tensor] | None = None,
    ) -> None:
        """One segment's queries: ``length`` and ``ends`` from :func:`longest_suffix` (``lo`` as
        given there), ``chosen`` = (the selected slot's first position [B, L] long, its best row's
        position [B, L] long or None); ``seg``: Ls, positions per slot; ``nll`` = the loss [B, L]
        of each query's next token with the cache, with it empty and gated, or None."""
        start, row = chosen
        after = torch.arange(ends.shape[-1]) + lo  # the token after each q: q + 1
        slot_of = (after - lo) // seg  # [R] which cached segment holds it
        chosen_slot = (start - lo).div(seg, rounding_mode="floor")  # [B, L]
        holds = ends & (slot_of == chosen_slot[..., None])
        newest = torch.where(ends, after, -1).amax(-1)  # the most recent longest match's token
        flags = {
            "slot": holds.any(-1),
            "recent": (newest - lo).div(seg, rounding_mode="floor") == chosen_slot,
            "row": None if row is None else (ends & (after == row[..., None])).any(-1),
        }
        for i, (a, b) in enumerate(BUCKETS):
            sel = (length >= a) if b is None else (length >= a) & (length < b)
            self.counts["queries"][i] += int(sel.sum())
            self.counts["slot"][i] += int((sel & flags["slot"]).sum())
            self.counts["recent"][i] += int((sel & flags["recent"]).sum())
            if flags["row"] is not None:
                self.counts["with_row"][i] += int(sel.sum())
                self.counts["row"][i] += int((sel & flags["row"]).sum())
            for key, x in zip(RUNS, nll or ()):
                self.nll[key][i] += float(x.double()[sel].sum())

    def table(self, max_len: int) -> str:
        """Markdown: per bucket the share of queries, the three agreements, the mean loss with the
        cache and with it empty (nats), and the bucket's share of the cache's gain (the summed
        loss it removes there over the summed loss it removes in all)."""
        c = self.counts
        total = max(1, sum(c["queries"]))
        gain = sum(self.nll["empty"]) - sum(self.nll["with"])
        lines = [
            "| longest match l | queries | slot agrees | row agrees | most recent's slot"
            " | loss with / empty / gated | share of the gain |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for i, (a, b) in enumerate(BUCKETS):
            if a > max_len:
                continue
            name = "0" if b == 1 else f"{a}-{max_len}" if b is None or b > max_len else f"{a}-{b - 1}"
            n = c["queries"][i]

            def share(k: str, of: int, i: int = i) -> str:
                return f"{c[k][i] / of:.3f}" if of else "-"

            row = share("row", c["with_row"][i])
            loss = " / ".join(f"{self.nll[k][i] / n:.3f}" for k in RUNS) if n else "-"
            part = f"{(self.nll['empty'][i] - self.nll['with'][i]) / gain:.3f}" if gain else "-"
            agrees = f"{share('slot', n)} | {row} | {share('recent', n)}"
            lines.append(f"| {name} | {n / total:.3f} | {agrees} | {loss} | {part} |")
        mean = " / ".join(f"{sum(self.nll[k]) / total:.4f}" for k in RUNS)
        lines.append(f"| all | 1 | | | | {mean} | 1 |")
        return "\n".join(lines)


_KEYS = ("queries", "slot", "recent", "row", "with_row")


def measure(
    checkpoint: str, *, n_slot: int | None, segments: int, max_len: int, split: str, batch_size: int
) -> Agreement:
    """Run ``checkpoint`` over ``split`` (module docstring) and count ``segments`` segments once its
    cache is full; the same weights with an empty cache run beside it on the same tokens.

    Raises:
        SystemExit: the checkpoint is not a crtn model selecting one slot per token through
            ``summary=token_max``, or the split ends before a segment is counted.
        CheckpointError: unreadable checkpoint.
    """
    from crtn.checkpoint import checkpoint_spec, load_checkpoint, restore_model

    ckpt = load_checkpoint(checkpoint)
    cfg = checkpoint_spec(ckpt, None if n_slot is None else {"cache": {"n_slot": n_slot}})
    if cfg.model.name != "crtn" or cfg.query.strategy == "gate" or cfg.cache.top_k != 1:
        sys.exit(
            f"{checkpoint}: needs a crtn model whose query pass selects one slot per token (cache.top_k=1)"
        )
    if cfg.summary.name != "token_max" or cfg.cache.pos == "real":
        sys.exit(f"{checkpoint}: needs summary=token_max and cache.pos concat or match")
    corpus, model = restore_model(ckpt, cfg, checkpoint)
    _, empty = restore_model(ckpt, checkpoint_spec(ckpt, {"cache": {"n_slot": 0}}), checkpoint)
    N, L, m = cfg.cache.n_slot, model.tgt_len, cfg.model.mem_len
    tally, states, seen, counted = Agreement(), [None] * 3, [], 0
    with torch.no_grad():
        for i, batch in enumerate(corpus.iterator(split, batch_size, L)):
            if counted == segments:
                break
            seen.append(batch.input)
            t0 = i * L
            lo, hi = max(1, t0 - m - N * L), t0 - m  # the N segments before the memory's m positions
            length, ends = (None, None)
            if lo < hi:
                length, ends = longest_suffix(torch.cat(seen, 1), (t0, L), (lo, hi), max_len)
            where = torch.zeros(batch.input.shape, dtype=torch.bool) if length is None else length >= GATE_LEN
            outs = [model(batch.input, batch.target, states[0]), empty(batch.input, batch.target, states[1])]
            with retrieving_only(where):
                outs.append(model(batch.input, batch.target, states[2]))  # its own states
            states = [o.state for o in outs]
            if t0 - m - N * L < 1:  # the cache not full yet
                continue
            start = t0 - outs[0].selection.age[..., 0]
            row = None if outs[0].selection.row is None else start + outs[0].selection.row[..., 0]
            tally.add(length, ends, (start, row), lo=lo, seg=L, nll=tuple(o.nll for o in outs))
            counted += 1
    if sum(tally.counts["queries"]) == 0:
        sys.exit(f"{checkpoint}: no segment counted in {split} (shorter than the cache's range?)")
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument(
        "--n-slot", type=int, default=None, help="cache slots at evaluation (default: as trained)"
    )
    ap.add_argument("--segments", type=int, default=40, help="segments counted once the cache is full")
    ap.add_argument("--max-len", type=int, default=32, help="the longest match measured")
    ap.add_argument("--split", default="valid")
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args()
    tally = measure(
        a.checkpoint,
        n_slot=a.n_slot,
        segments=a.segments,
        max_len=a.max_len,
        split=a.split,
        batch_size=a.batch_size,
    )
    print(f"{a.checkpoint}: {sum(tally.counts['queries'])} queries")
    print(tally.table(a.max_len))


if __name__ == "__main__":
    main()
