#!/usr/bin/env python
"""Where a CRTN checkpoint trained on the passage-recall corpus (SPEC §4) loses repeat tokens.

    python tools/recall_diagnosis.py CHECKPOINT [--split valid] [--batch-size 16]

Runs the checkpoint over a split of its synthetic corpus exactly as ``crtn-eval`` does
(``batch_size`` streams, segments of ``tgt_len``, memory and cache carried over) and, for
every scored repeat token (copy label > ``repeat_skip``), asks: is the copy source of the
next token inside one of the k segments selected for this token (a *hit*), and was the
argmax prediction right? It prints the hit rate and accuracy by the token's position in
its copy, by copy distance (in 32-token bins), by the position j in the segment (8-token
bins), and the accuracy given a hit by the weight alpha of the segment that holds the
source (0.2-wide bins), plus the accuracy on misses.

Raises SystemExit with one line when the checkpoint is not a crtn model on synthetic data.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import torch
from omegaconf import OmegaConf


def diagnose(checkpoint: str, split: str, batch_size: int) -> dict[str, dict]:
    """Tables ``{name: {bin: (hits, correct, tokens)}}`` for one split (see the module doc)."""
    from crtn.checkpoint import load_checkpoint
    from crtn.config import TrainAppConfig
    from crtn.data import load_corpus
    from crtn.model import build_model

    ckpt = load_checkpoint(checkpoint)
    cfg = OmegaConf.merge(OmegaConf.structured(TrainAppConfig), ckpt["config"])
    if cfg.model.name != "crtn" or cfg.data.name != "synthetic":
        sys.exit(
            f"{checkpoint}: needs a crtn model trained on data=synthetic, not {cfg.model.name} on {cfg.data.name}"
        )
    corpus = load_corpus(cfg.data)
    model = build_model(cfg, len(corpus.vocab))
    model.load_state_dict(ckpt["model"])
    model.eval()
    L = model.tgt_len
    it = corpus.iterator(split, batch_size, L)
    labels, gaps = corpus.labels[split].long(), corpus.repeat_gap[split].long()
    skip = corpus.info.get("repeat_skip", 0)
    n = it.stream_len
    tables: dict[str, dict] = {
        k: defaultdict(lambda: [0, 0, 0]) for k in ("copy position", "distance // 32", "j // 8")
    }
    by_alpha: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    misses = [0, 0]
    state = None
    with torch.no_grad():
        for batch in it:
            out = model(batch.input, batch.target, state)
            state = out.state
            B, T = batch.input.shape  # T < L in a split's last segment
            t0 = batch.index * L
            j = torch.arange(T)
            g = torch.arange(B)[:, None] * n + t0 + j + 1  # [B, T] split index of each target
            lab, gap = labels[g], gaps[g]
            scored = lab > skip
            ok = model.crit.log_prob(out.hidden).argmax(-1) == batch.target
            if out.selection is None:  # empty cache (first segment): nothing retrieved
                hit = torch.zeros_like(scored)
                alpha = torch.zeros(B, T)
            else:
                src = t0 + j + 1 - gap  # [B, T] stream position of the target's copy source
                start = t0 - out.selection.age  # [B, T, k] first stream position of each selected slot
                inside = (start <= src[..., None]) & (src[..., None] < start + L)  # a slot holds L positions
                hit = inside.any(-1)
                alpha = (out.selection.alpha * inside).sum(-1)
            for key, v in (
                ("copy position", lab),
                ("distance // 32", gap // 32),
                ("j // 8", j.expand(B, T) // 8),
            ):
                for b in v[scored].unique().tolist():
                    m = scored & (v == b)
                    row = tables[key][b]
                    row[0] += int(hit[m].sum())
                    row[1] += int(ok[m].sum())
                    row[2] += int(m.sum())
            abin = (alpha * 5).long().clamp(max=4)
            for b in range(5):
                m = scored & hit & (abin == b)
                by_alpha[b][0] += int(ok[m].sum())
                by_alpha[b][1] += int(m.sum())
            misses[0] += int(ok[scored & ~hit].sum())
            misses[1] += int((scored & ~hit).sum())
    return {**tables, "alpha": dict(by_alpha), "misses": {"all": misses}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--split", default="valid", choices=["train", "valid", "test"])
    ap.add_argument("--batch-size", type=int, default=16)
    a = ap.parse_args()
    t = diagnose(a.checkpoint, a.split, a.batch_size)
    hits = sum(r[0] for r in t["j // 8"].values())
    total = sum(r[2] for r in t["j // 8"].values())
    print(f"{a.split}: {total:,} scored repeat tokens, source in a selected segment for {hits / total:.3f}")
    for key in ("copy position", "distance // 32", "j // 8"):
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
