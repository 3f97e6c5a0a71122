#!/usr/bin/env python
"""A tiny Hugging Face Transformer-XL trained on a real corpus, for the convert -> evaluate ->
fine-tune -> generate demo of docs/results.md (transformers 4.35 is needed: the ``test`` extra,
``pip install -e ".[test]"``; later releases removed Transformer-XL).

    python tools/make_hf_demo.py train --data-root ../shared/data --out outputs/demo/hf --steps 1000
    python tools/make_hf_demo.py compare --hf outputs/demo/hf --crtn outputs/demo/converted/model.pt \
        --data-root ../shared/data

``train`` fits a ``TransfoXLLMHeadModel`` (adaptive input/softmax, HF's own code) on Penn
Treebank for ``--steps`` optimizer steps (about a minute on one CPU thread; ``--seconds`` caps
the wall-clock time instead, at the cost of reproducibility), reading the corpus with crtn's loader
(:func:`crtn.data.load_corpus`) so that its ids follow crtn's vocabulary order. Training is
Transformer-XL's: B contiguous streams, segments of ``tgt_len`` tokens, every position
predicts the next token (also across segment boundaries), memory carried over. It then writes
``save_pretrained`` (with ``tgt_len`` in config.json), ``vocab.txt`` (one symbol per line, in
id order) and ``hf_eval.json`` (HF's own perplexity on valid and test, evaluated like
``crtn-eval``: ``eval_batch_size`` streams, the same segments).

``compare`` prints the max |log p_crtn - log p_HF| over the full next-token distributions of
the first 3 test segments (4 streams, with memory): in float64 (HF's attention patched to
stay in float64, see ``tests/test_convert.py``) and in float32 (HF unchanged).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
import textwrap
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

try:
    from transformers import TransfoXLConfig, TransfoXLLMHeadModel
    from transformers.models.transfo_xl import modeling_transfo_xl
except ImportError:  # pragma: no cover
    sys.exit(
        "tools/make_hf_demo.py needs transformers<=4.35 (Transformer-XL was removed later); it is a "
        'test/demo dependency: pip install -e ".[test]"'
    )

from crtn.data import load_corpus


def ptb(root: str):
    return load_corpus({"name": "ptb", "root": root, "dir": "penn"})


def empty_mems(model: TransfoXLLMHeadModel, batch: int, dtype=torch.float32) -> list[torch.Tensor]:
    """Start from an empty memory as the release and crtn do (HF's init_mems gives mem_len zeros)."""
    return [torch.empty(0, batch, model.config.d_model, dtype=dtype) for _ in range(model.config.n_layer)]


def segment_nll(model: TransfoXLLMHeadModel, x: torch.Tensor, y: torch.Tensor, mems):
    """NLL [B*L] of targets y given inputs x with memory. HF's crit shifts hidden/labels by one
    (hidden[:, :-1] predicts labels[:, 1:]); a dummy position on each side undoes the shift, so
    every position predicts its own target, as in the release's training."""
    out = model.transformer(input_ids=x, mems=mems)
    hidden = out.last_hidden_state
    pad_h = torch.cat([hidden, hidden[:, :1]], 1)
    pad_y = torch.cat([y[:, :1], y], 1)
    return model.crit(pad_h, pad_y), out.mems


@torch.no_grad()
def hf_eval(model, corpus, split: str, batch: int, tgt_len: int) -> dict:
    model.eval()
    it = corpus.iterator(split, batch, tgt_len, drop_last=False)
    mems = empty_mems(model, it.local_batch_size)
    total, count = 0.0, 0
    for b in it.iterate(0):
        nll, mems = segment_nll(model, b.input, b.target, mems)
        total += nll.double().sum().item()
        count += nll.numel()
    return {"loss": total / count, "ppl": math.exp(total / count), "tokens": count}


def train(args) -> None:
    torch.manual_seed(args.seed)
    corpus = ptb(args.data_root)
    V = len(corpus.vocab)
    config = TransfoXLConfig(
        vocab_size=V,
        cutoffs=[2000, 6000],
        div_val=2,
        d_model=args.d_model,
        d_embed=args.d_model,
        n_head=4,
        d_head=args.d_model // 4,
        d_inner=2 * args.d_model,
        n_layer=args.n_layer,
        mem_len=args.tgt_len,
        clamp_len=-1,
        same_length=False,
        untie_r=True,
        dropout=0.1,
        dropatt=0.0,
    )
    config.tgt_len = args.tgt_len  # read by crtn-convert (the released wt103 config has it too)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransfoXLLMHeadModel(config)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    it = corpus.iterator("train", args.batch_size, args.tgt_len, drop_last=True)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"HF TransfoXLLMHeadModel: {n_params:,} parameters, PTB vocab {V}, {args.steps} steps")
    model.train()
    mems = empty_mems(model, it.local_batch_size)
    t0, step, loss_sum = time.perf_counter(), 0, 0.0
    batches = it.iterate(0)
    while step < args.steps and (args.seconds is None or time.perf_counter() - t0 < args.seconds):
        b = next(batches, None)
        if b is None:
            batches, mems = it.iterate(0), empty_mems(model, it.local_batch_size)
            continue
        nll, mems = segment_nll(model, b.input, b.target, mems)
        loss = nll.mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        opt.step()
        step += 1
        loss_sum += loss.item()
        if step % args.log_interval == 0:
            print(f"step {step} | train ppl {math.exp(loss_sum / args.log_interval):.1f} | "
                  f"{time.perf_counter() - t0:.0f}s", flush=True)  # fmt: skip
            loss_sum = 0.0
    tokens = step * args.batch_size * args.tgt_len
    print(f"trained {step} steps ({tokens:,} tokens) in {time.perf_counter() - t0:.0f}s")
    out = Path(args.out)
    model.save_pretrained(out)
    (out / "vocab.txt").write_text("\n".join(corpus.vocab.idx2sym) + "\n")
    result = {
        "steps": step,
        "tokens": tokens,
        **{s: hf_eval(model, corpus, s, args.eval_batch_size, args.tgt_len) for s in ("valid", "test")},
    }
    (out / "hf_eval.json").write_text(json.dumps(result, indent=2))
    for s in ("valid", "test"):
        print(
            f"HF's own {s}: ppl {result[s]['ppl']:.2f} (loss {result[s]['loss']:.4f}, {result[s]['tokens']:,} tokens)"
        )
    print(f"wrote {out} (save_pretrained, vocab.txt, hf_eval.json)")


@contextmanager
def hf_float64_attention():
    """HF 4.35's attention without its float32 cast of the masked scores (needed in float64)."""
    cls = modeling_transfo_xl.RelPartialLearnableMultiHeadAttn
    original = cls.forward
    src = textwrap.dedent(inspect.getsource(original)).replace("attn_score.float()", "attn_score")
    namespace: dict = {}
    exec(compile(src, modeling_transfo_xl.__file__, "exec"), modeling_transfo_xl.__dict__, namespace)
    cls.forward = namespace["forward"]
    try:
        yield
    finally:
        cls.forward = original


def compare(args) -> None:
    from crtn.checkpoint import checkpoint_spec, load_checkpoint
    from crtn.model import build_model

    corpus = ptb(args.data_root)
    ckpt = load_checkpoint(args.crtn)
    cfg = checkpoint_spec(ckpt)
    L = cfg.model.tgt_len
    x = corpus.splits["test"][: 4 * 3 * L].view(4, 3 * L)
    for dtype, exact in ((torch.float64, False), (torch.float64, True), (torch.float32, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            hf = TransfoXLLMHeadModel.from_pretrained(args.hf).to(dtype).eval()
        if exact:  # HF stores the sinusoid frequencies as a float32 buffer; crtn computes them in float64
            d = hf.config.d_model
            freq = 1.0 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
            hf.transformer.pos_emb.inv_freq.copy_(freq)
        model = build_model(cfg, len(corpus.vocab))
        model.load_state_dict(ckpt["model"])
        model = model.to(dtype).eval()
        mems, state, worst = empty_mems(hf, 4, dtype), None, 0.0
        patch = hf_float64_attention() if dtype == torch.float64 else _nothing()
        with torch.no_grad(), patch:
            for s in range(0, 3 * L, L):
                ref = hf(input_ids=x[:, s : s + L], mems=mems)
                mems = ref.mems
                out = model(x[:, s : s + L], state=state)
                state = out.state
                worst = max(
                    worst, (model.crit.log_prob(out.hidden) - ref.prediction_scores).abs().max().item()
                )
        how = str(dtype).removeprefix("torch.") + (", HF inv_freq in float64" if exact else "")
        print(f"{how}: max |log p_crtn - log p_HF| over 3 PTB test segments "
              f"x 4 streams x {len(corpus.vocab)} symbols = {worst:.3g}")  # fmt: skip


@contextmanager
def _nothing():
    yield


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train and save a tiny HF Transformer-XL on PTB")
    t.add_argument("--data-root", default="../shared/data")
    t.add_argument("--out", default="outputs/demo/hf")
    t.add_argument("--steps", type=int, default=1000)
    t.add_argument("--seconds", type=float, default=None, help="stop after this wall-clock time")
    t.add_argument("--n-layer", type=int, default=2)
    t.add_argument("--d-model", type=int, default=128)
    t.add_argument("--tgt-len", type=int, default=32)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--eval-batch-size", type=int, default=10)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--log-interval", type=int, default=50)
    t.add_argument("--seed", type=int, default=1111)
    c = sub.add_parser("compare", help="max |dlogp| between HF and the converted crtn model")
    c.add_argument("--hf", default="outputs/demo/hf")
    c.add_argument("--crtn", default="outputs/demo/converted/model.pt")
    c.add_argument("--data-root", default="../shared/data")
    for sp in (t, c):
        sp.add_argument(
            "--threads", type=int, default=1, help="torch intra-op threads (1: fastest for tiny models)"
        )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    train(args) if args.cmd == "train" else compare(args)


if __name__ == "__main__":
    main()
