"""How exactly a token's own n-gram scores in training at ``cache.key_layer=0`` (docs/method.md
§3, "Keys and queries at layer 0"), on a trained checkpoint.

A checkpoint with keys and queries at layer 0, ``token_max``, ``summary.ngram`` w, shift 1 and
cosine scores, in train mode (dropout on): B streams read segments X, Y, Z, X of a split (with
``mem_len`` = ``tgt_len`` X has entered slot 0 when it comes again), and the tool prints the
mean score of X's tokens j = w-1 .. L-2 (whose n-gram and following row lie inside X) against
slot 0, over several draws of segments, twice on the same weights: with the stored layer-0
state before dropout (the model's behaviour; 1 exactly) and after it (dropout masks of the query
pass and of the pass that stored the slot independent; about 1 - p).

    python tools/keylayer0_selfscore.py RUN/checkpoints/best.pt [split] [draws]

Needs the checkpoint's corpus (``CRTN_DATA`` or its ``data.root``). Prints one line per behaviour.
"""

from __future__ import annotations

import sys

import torch

from crtn.checkpoint import checkpoint_spec, load_checkpoint
from crtn.data import load_corpus
from crtn.model import build_model

STREAMS = 16


def own_scores(model, split: torch.Tensor, draws: int) -> torch.Tensor:
    """Scores [draws, B, L-w] of X's tokens j = w-1..L-2 against X's own slot (slot 0)."""
    L, w = model.tgt_len, model.summary.ngram
    out, seen = [], []
    score = model.summary.score
    model.summary.score = lambda *a, **k: seen.append(score(*a, **k)) or seen[-1]
    for _ in range(draws):
        start = torch.randint(0, len(split) - 3 * L, (STREAMS,))
        x, y, z = (torch.stack([split[s + i * L : s + (i + 1) * L] for s in start]) for i in range(3))
        state = None
        with torch.no_grad():
            for seg in (x, y, z, x):
                state = model(seg, None, state).state
        out.append(seen[-1][:, w - 1 : L - 1, 0])
    del model.summary.score
    return torch.stack(out)


def main(argv: list[str]) -> None:
    ckpt = load_checkpoint(argv[0])
    split_name = argv[1] if len(argv) > 1 else "valid"
    draws = int(argv[2]) if len(argv) > 2 else 5
    run = checkpoint_spec(ckpt)
    corpus = load_corpus(run.data)
    model = build_model(run, len(corpus.vocab))
    model.load_state_dict(ckpt["model"])
    c, s = run.cache, run.summary
    if c.key_layer != 0 or s.name != "token_max" or not s.cosine or model.mem_len != model.tgt_len:
        sys.exit("needs cache.key_layer=0, summary=token_max, summary.cosine=true and mem_len = tgt_len")
    model.train()
    for clean in (True, False):
        model.clean_layer0 = clean
        torch.manual_seed(0)
        got = own_scores(model, corpus.splits[split_name], draws)
        name = "before dropout" if clean else "after dropout "
        print(
            f"layer 0 {name}: own {s.ngram}-gram score in train mode, mean {got.mean().item():.4f}, "
            f"min {got.min().item():.4f}, max {got.max().item():.4f} ({got.numel():,} tokens)"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
