#!/usr/bin/env python
"""Where a CRTN checkpoint trained on the passage-recall corpus (docs/method.md §4) loses repeat tokens.

    python tools/recall_diagnosis.py CHECKPOINT [--split valid] [--batch-size 16]

Runs the checkpoint over a split of its synthetic corpus exactly as ``crtn-eval`` does
(``batch_size`` streams, segments of ``tgt_len``, memory and cache carried over) and, for
every scored repeat token (copy label > ``repeat_skip``), asks: is the copy source of the
next token inside one of the k segments selected for this token (a *hit*), and was the
argmax prediction right? It prints the hit rate and accuracy by the token's position in
its copy, by copy distance (in 32-token bins), by the position j in the segment (8-token
bins), by the source's row in its cached segment ((j + 1 - distance) mod tgt_len: row 0 is
where a match on the row before falls in the previous slot, docs/results.md "Retrieval that
scales"), and the accuracy given a hit by the weight alpha of the segment that holds the
source (0.2-wide bins), plus the accuracy on misses.

``--shift S`` runs the checkpoint with every retrieved row presented S positions farther from
the query than ``cache.pos=concat`` places it (S < 0: nearer; at most the memory length), the
memory and segment unchanged (:func:`shifted_distances`): whether a copy depends on the
distance at which the source row is seen or only on its content (docs/results.md, "The cache
in bfloat16").

Raises SystemExit with one line when the checkpoint is not a crtn model on synthetic data.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
from collections.abc import Iterator

import torch
from torch import Tensor


def retrieved_columns(y: Tensor, c: int, extra: int, shift: int) -> Tensor:
    """The position scores of [retrieved rows; memory; segment] with the retrieved rows moved.

    ``y`` [..., L, R]: :func:`crtn.model.attention.rel_shift` of the scores against a distance
    table extended by ``extra`` >= max(shift, 0) distances, R = extra + c + M + L (c retrieved
    rows, M memory rows). Column j of ``y`` is at distance R - L + i - j from query i, so
    retrieved row r (distance c + M + i - r under ``cache.pos=concat``, docs/method.md §3 step 3)
    moved by ``shift`` is column r + extra - shift, and key p of [memory; segment] column
    extra + c + p. Returns [..., L, c + M + L].
    """
    return torch.cat([y[..., extra - shift : extra - shift + c], y[..., extra + c :]], -1)


@contextlib.contextmanager
def shifted_distances(shift: int) -> Iterator[None]:
    """Inside, every pass with retrieved rows (``cache.pos=concat``) scores them ``shift``
    positions farther from the query (:func:`retrieved_columns`); restored on exit.

    Raises:
        ValueError: (inside, at a pass) ``-shift`` beyond the memory length, where the moved
            rows would overlap the memory's distances.
    """
    if shift == 0:
        yield
        return
    import crtn.model.attention as attention
    from crtn.model.transformer import TransformerLM

    core, table, rel_shift = TransformerLM.core, TransformerLM._position_embeddings, attention.rel_shift
    extra, rows, signature = max(shift, 0), {"c": 0}, inspect.signature(core)

    def core_(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        cache, mem = bound.get("cache"), bound.get("mem")
        kept = bound.get("positions") is None or bound["positions"].concat  # rows in the concatenated context
        rows["c"] = cache.k * cache.seg_len if cache is not None and kept else 0
        m = 0 if mem is None else mem.shape[2]
        if rows["c"] and -shift > m:
            raise ValueError(f"shift {shift} moves retrieved rows past the memory's {m} rows")
        try:
            return core(self, *args, **kwargs)
        finally:
            rows["c"] = 0

    def table_(self, K, positions, dtype, device):
        return table(self, K + extra if rows["c"] else K, positions, dtype, device)

    def rel_shift_(x):
        y = rel_shift(x)
        return retrieved_columns(y, rows["c"], extra, shift) if rows["c"] else y

    TransformerLM.core, TransformerLM._position_embeddings, attention.rel_shift = core_, table_, rel_shift_
    try:
        yield
    finally:
        TransformerLM.core, TransformerLM._position_embeddings, attention.rel_shift = core, table, rel_shift


def diagnose(checkpoint: str, split: str, batch_size: int, shift: int = 0) -> dict[str, dict]:
    """Hit and accuracy counts over the scored repeat tokens of one split (see the module doc),
    the retrieved rows moved ``shift`` positions farther (:func:`shifted_distances`; 0: as the
    model places them).

    Returns:
        ``{"copy position" | "distance // 32" | "j // 8" | "source row" | "offset j - source row":
        {bin: [hits, correct, tokens]},
        "alpha": {bin 0..4: [correct, tokens]} (hits only, alpha in [bin/5, (bin+1)/5)),
        "misses": {"all": [correct, tokens]}, "copy hits": tokens for which a selected slot
        holds the same text (the source or any other copy of the same original)}``; counts
        are tokens, distances in tokens.

    Raises:
        SystemExit: the checkpoint is not a crtn model trained on ``data=synthetic``.
        CheckpointError: unreadable checkpoint.
        ValueError: ``-shift`` beyond the memory length.
    """
    from crtn.checkpoint import checkpoint_spec, load_checkpoint, restore_model

    ckpt = load_checkpoint(checkpoint)
    cfg = checkpoint_spec(ckpt)
    if cfg.model.name != "crtn" or cfg.data.name != "synthetic":
        sys.exit(
            f"{checkpoint}: needs a crtn model trained on data=synthetic, not {cfg.model.name} on {cfg.data.name}"
        )
    corpus, model = restore_model(ckpt, cfg, checkpoint)
    L = model.tgt_len
    it = corpus.iterator(split, batch_size, L)
    labels, gaps = corpus.labels[split].long(), corpus.repeat_gap[split].long()
    skip = corpus.info.get("repeat_skip", 0)
    n = it.stream_len

    gap_list = gaps.tolist()

    def original(i: int) -> int:
        """Split index where the text of token i was first drawn: copies followed back one by one."""
        while gap_list[i] > 0:
            i -= gap_list[i]
        return i

    cols: dict[str, list[Tensor]] = {k: [] for k in ("label", "gap", "j", "hit", "ok", "alpha", "chain")}
    state = None
    with torch.no_grad(), shifted_distances(shift):
        for batch in it:
            out = model(batch.input, batch.target, state)
            state = out.state
            B, T = batch.input.shape  # T < L in a split's last segment
            t0 = batch.index * L
            j = torch.arange(T).expand(B, T)
            g = torch.arange(B)[:, None] * n + t0 + j + 1  # [B, T] split index of each target
            lab, gap = labels[g], gaps[g]
            ok = model.crit.log_prob(out.hidden).argmax(-1) == batch.target
            if out.selection is None:  # empty cache (first segment): nothing retrieved
                hit, alpha = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T)
            else:
                src = t0 + j + 1 - gap  # [B, T] stream position of the target's copy source
                start = t0 - out.selection.age  # [B, T, k] first stream position of each selected slot
                inside = (start <= src[..., None]) & (src[..., None] < start + L)  # a slot holds L positions
                hit, alpha = inside.any(-1), (out.selection.alpha * inside).sum(-1)
            chain = hit.clone()  # the same text (the source or another copy of it) in a selected slot
            if out.selection is not None:
                for b, t in zip(*torch.nonzero(~hit & (lab > skip), as_tuple=True), strict=True):
                    if b * n + int(src[b, t]) < 0:
                        continue
                    want = original(b * n + int(src[b, t]))
                    rows = (b * n + s + r for s in start[b, t].tolist() for r in range(L))
                    chain[b, t] = any(original(i) == want for i in rows)
            m = lab > skip
            for k, v in zip(cols, (lab, gap, j, hit, ok, alpha, chain), strict=True):
                cols[k].append(v[m])
    c = {k: torch.cat(v) for k, v in cols.items()}
    hit, ok = c["hit"], c["ok"]

    def table(bins: Tensor, *flags: Tensor) -> dict[int, list[int]]:
        """{bin: [count of each flag, tokens]} over the bins that occur."""
        rows = [torch.bincount(bins, weights=f.double()) for f in flags] + [torch.bincount(bins)]
        return {b: [int(r[b]) for r in rows] for b in bins.unique().tolist()}

    row = (c["j"] + 1 - c["gap"]) % L  # the source's row in its slot
    tables = {
        "copy position": table(c["label"], hit, ok),
        "distance // 32": table(c["gap"] // 32, hit, ok),
        "j // 8": table(c["j"] // 8, hit, ok),
        "source row": table(row, hit, ok),
        # j - row lies in -(L-1)..L-1: binned shifted by L-1
        "offset j - source row": {b - (L - 1): v for b, v in table(c["j"] - row + L - 1, hit, ok).items()},
    }
    abin = (c["alpha"][hit] * 5).long().clamp(max=4)
    by_alpha = {b: [int(ok[hit][abin == b].sum()), int((abin == b).sum())] for b in range(5)}
    misses = {"all": [int(ok[~hit].sum()), int((~hit).sum())]}
    return {**tables, "alpha": by_alpha, "misses": misses, "copy hits": int(c["chain"].sum())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--shift", type=int, default=0, help="retrieved rows this many positions farther")
    a = ap.parse_args()
    t = diagnose(a.checkpoint, a.split, a.batch_size, a.shift)
    hits = sum(r[0] for r in t["j // 8"].values())
    total = sum(r[2] for r in t["j // 8"].values())
    print(f"{a.split}: {total:,} scored repeat tokens, source in a selected segment for {hits / total:.3f}")
    print(
        f"the same text (the source or another copy of it) in a selected segment for {t['copy hits'] / total:.3f}"
    )
    for key in ("copy position", "distance // 32", "j // 8", "source row", "offset j - source row"):
        print(f"by {key}:")
        for b, (h, ok, n) in sorted(t[key].items()):
            print(f"  {b:>4}  hit {h / n:.3f}  acc {ok / n:.3f}  ({n:,} tokens)")
    ok_hit = sum(ok for ok, _ in t["alpha"].values())
    print(f"accuracy given a hit {ok_hit / max(hits, 1):.3f}, by alpha of the segment holding the source:")
    for b, (ok, n) in sorted(t["alpha"].items()):
        if n:
            print(f"  {b / 5:.1f}-{(b + 1) / 5:.1f}  acc {ok / n:.3f}  ({n:,} tokens)")
    ok, n = t["misses"]["all"]
    print(f"accuracy on misses {ok / max(n, 1):.3f} ({n:,} tokens)")


if __name__ == "__main__":
    main()
