"""token_max's chunked row match (``crtn/model/rowmatch.py``; docs/method.md §3, "Summaries")
against the same formula as one unchunked autograd graph, its implementation before the chunks:
the row match alone and the training step of ``model=crtn query=token`` at two cache sizes, both
in one process, alternating (docs/results.md, "Performance").

    python tools/bench_row_match.py                          # CPU, batch 16, N = 32 and 1,024
    python tools/bench_row_match.py --device cuda --batch 64
    python tools/bench_row_match.py --smoke                  # tiny sizes, seconds
    python tools/bench_row_match.py --sections product       # the product alone, float32 and bfloat16

``score``: one call of the row match and its backward w.r.t. the queries (w = 4, s = 1, the
defaults) on random rows of the bench's sizes (L 64, d 256). ``step``: crtn-bench's training step
(forward, backward, clip, Adam; memory and cache full, the slots beyond the first 64 random) of
the row match's model (``model=crtn query=token``) at N = 32 and the large N, each with the
chunked and the unchunked row match, and Transformer-XL whose memory covers the range at N = 32 (m + N L): the N-scaling ratio
(step at the large N over step at N = 32) and the range ratio (tokens/s over that
Transformer-XL's) of each implementation. Peak memory on a GPU (``--device cuda``) only.
``product`` (not in the default sections): the product that dominates the match at large N, in
float32 and in bfloat16, batched and one batch row at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crtn.app_config import BenchSpec  # noqa: E402
from crtn.bench.cases import Stepper, make_case, model_cfg, sync  # noqa: E402
from crtn.model import summary as summary_module  # noqa: E402
from crtn.model.rowmatch import _chunk_slots, ngram_row_scores  # noqa: E402

#: the n-gram length and row shift the match is timed with (the defaults of ``summary.ngram`` and ``summary.shift``)
W, SHIFT = summary_module.DEFAULT_NGRAM, summary_module.DEFAULT_SHIFT


def unchunked_row_scores(query, rows, lead, *, ngram: int, shift: int):
    """The row match as one autograd graph over every slot: the products of all slots [G, w-1+L,
    n, w-1+s+Ls], their w shifted diagonals summed, the max over rows (torch.amax)."""
    G, N, Ls, d = rows.shape
    scores = torch.bmm(query, rows.reshape(G, N * Ls, d).transpose(1, 2)).view(G, -1, N, Ls)
    w, n_lead = ngram, ngram - 1 + shift
    if n_lead > 0:
        before = torch.einsum("bqd,bnrd->bqnr", query, lead.to(query.dtype))
        scores = torch.cat([before, scores], -1)
        Lq = scores.shape[1] - w + 1
        scores = sum(scores[:, w - 1 - a : w - 1 - a + Lq, :, w - 1 - a : w - 1 - a + Ls] for a in range(w))
        scores = scores * (1.0 / w)
    return scores.amax(-1)


IMPLEMENTATIONS = {"chunked": ngram_row_scores, "unchunked": unchunked_row_scores}


def timed(fn, device: torch.device) -> tuple[float, int | None]:
    """Seconds ``fn()`` takes, and on a GPU the peak memory it allocates beyond what was alive."""
    sync(device)
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t = time.perf_counter()
    fn()
    sync(device)
    peak = torch.cuda.max_memory_allocated(device) - base if device.type == "cuda" else None
    return time.perf_counter() - t, peak


def bench_score(s: BenchSpec, slots: list[int], rounds: int, device: torch.device) -> list[dict]:
    """The row match alone, forward and backward, both implementations alternating."""
    out = []
    B, L, d, w, sh = s.batch, s.tgt_len, s.d_model, W, SHIFT
    for n in slots:
        g = torch.Generator(device=device).manual_seed(0)
        rows = torch.randn(B, n, L, d, generator=g, device=device)
        lead = torch.randn(B, n, w - 1 + sh, d, generator=g, device=device)
        query = torch.randn(B, w - 1 + L, d, generator=g, device=device, requires_grad=True)
        weight = torch.randn(B, L, n, generator=g, device=device)
        times: dict[str, list[float]] = {k: [] for k in IMPLEMENTATIONS}
        peaks: dict[str, int | None] = {}
        for r in range(rounds + 1):  # the first round warms up
            for name, fn in IMPLEMENTATIONS.items():

                def step(fn=fn, x=(query, rows, lead, weight)):
                    (fn(*x[:3], ngram=w, shift=sh) * x[3]).sum().backward()

                t, peaks[name] = timed(step, device)
                if r > 0:
                    times[name].append(t)
        row = {"n_slot": n}
        for name in IMPLEMENTATIONS:
            row[f"{name}_ms"] = 1000 * statistics.median(times[name])
            row[f"{name}_peak_mb"] = None if peaks[name] is None else peaks[name] / 2**20
        row["speedup"] = row["unchunked_ms"] / row["chunked_ms"]
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def _per_row_mm(query, rows_t):
    """query [G, Lq, d] times rows_t [G, d, R], one 2-D product per batch row."""
    return torch.stack([torch.mm(q, r) for q, r in zip(query, rows_t, strict=True)])


def _chunked(fn, query, rows_t, n: int, step: int) -> None:
    """``fn``'s product of the queries with n slots' rows, ``step`` slots at a time (as the match
    takes them, :func:`crtn.model.rowmatch._chunk_slots`); rows_t [G, d, n Ls]."""
    cols = rows_t.shape[2] // n
    for i0 in range(0, n, step):
        fn(query, rows_t[:, :, i0 * cols : min(n, i0 + step) * cols])


PRODUCTS = {  # (dtype of queries and rows, the product)
    "float32 bmm": (torch.float32, torch.bmm),
    "bfloat16 bmm": (torch.bfloat16, torch.bmm),
    "bfloat16 mm per batch row": (torch.bfloat16, _per_row_mm),
}


def bench_product(s: BenchSpec, slots: list[int], rounds: int, device: torch.device) -> list[dict]:
    """The row match's product alone, queries [B, w-1+L, d] against every row of every slot
    [B, N L, d] in the match's chunks of slots, in float32 and in bfloat16 (the rows already in
    bfloat16, as a cache of ``cache.dtype=bfloat16`` holds them), alternating; multiply-adds per
    second of each."""
    out = []
    B, L, d = s.batch, s.tgt_len, s.d_model
    for n in slots:
        g = torch.Generator(device=device).manual_seed(0)
        query = torch.randn(B, W - 1 + L, d, generator=g, device=device)
        rows = torch.randn(B, n * L, d, generator=g, device=device)
        inputs = {dt: (query.to(dt), rows.to(dt).transpose(1, 2)) for dt in (torch.float32, torch.bfloat16)}
        slots = rows.view(B, n, L, d)
        step = _chunk_slots(query, slots, slots[:, :, : W - 1 + SHIFT])  # a view of the lead-in's shape
        times: dict[str, list[float]] = {k: [] for k in PRODUCTS}
        for r in range(rounds + 1):
            for name, (dt, fn) in PRODUCTS.items():
                q, rt = inputs[dt]
                t, _ = timed(lambda fn=fn, q=q, rt=rt, n=n, k=step: _chunked(fn, q, rt, n, k), device)
                if r > 0:
                    times[name].append(t)
        row: dict = {"n_slot": n}
        for name in PRODUCTS:
            sec = statistics.median(times[name])
            row[f"{name} ms"] = 1000 * sec
            row[f"{name} GMAC/s"] = B * (W - 1 + L) * n * L * d / sec / 1e9
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def bench_step(s: BenchSpec, large: int, rounds: int, device: torch.device) -> dict:
    """Training steps of the row match's model at N = s.n_slot and ``large`` with both row matches, and
    Transformer-XL over the range at N = s.n_slot; one case per model, the implementation swapped
    between steps of the same case."""
    L = s.tgt_len
    stepper = Stepper(device, amp=False)
    cases = {
        n: make_case(
            f"crtn n_slot={n}",
            model_cfg(s, "crtn", L, **{"query.strategy": "token", "cache.n_slot": n}),
            s,
            device=device,
        )
        for n in (s.n_slot, large)
    }
    rng = L + s.n_slot * L
    txl = make_case(f"txl(mem_len={rng})", model_cfg(s, "txl", rng), s, device=device)
    for c in [*cases.values(), txl]:
        stepper.fill(c)
        stepper(c)
    times: dict[str, list[float]] = {}
    peaks: dict[str, int | None] = {}
    for _ in range(rounds):
        for n, c in cases.items():
            for name, fn in IMPLEMENTATIONS.items():
                summary_module.ngram_row_scores = fn
                key = f"{name} n_slot={n}"
                t, peaks[key] = timed(lambda c=c: stepper(c), device)
                times.setdefault(key, []).append(t)
        t, peaks[txl.name] = timed(lambda: stepper(txl), device)
        times.setdefault(txl.name, []).append(t)
    summary_module.ngram_row_scores = ngram_row_scores
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = s.batch * L
    out: dict = {"step_ms": {k: 1000 * v for k, v in med.items()}, "peak_step_mb": {}}
    out["peak_step_mb"] = {k: None if v is None else v / 2**20 for k, v in peaks.items()}
    for name in IMPLEMENTATIONS:
        small, big = med[f"{name} n_slot={s.n_slot}"], med[f"{name} n_slot={large}"]
        out[f"{name}_n_scaling"] = big / small
        out[f"{name}_range_ratio"] = (tokens / small) / (tokens / med[txl.name])
    print(json.dumps(out, indent=1), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=None, help="streams (default: bench.batch, 16)")
    p.add_argument("--large", type=int, default=None, help="the large N (default: bench.n_slot_large)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sections", default="score,step")
    p.add_argument("--smoke", action="store_true", help="tiny sizes")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    a = p.parse_args()
    s = BenchSpec()
    if a.smoke:
        s = replace(s, batch=2, d_model=32, n_head=2, d_head=16, d_inner=64, tgt_len=8, n_slot=4, n_layer=2)
    if a.batch:
        s = replace(s, batch=a.batch)
    large = a.large or (80 if a.smoke else s.n_slot_large)
    device = torch.device(a.device)
    res: dict = {"device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device)}
    res.update(batch=s.batch, threads=torch.get_num_threads(), torch=torch.__version__)
    if "score" in a.sections:
        res["score"] = bench_score(s, [s.n_slot, large], a.rounds, device)
    if "product" in a.sections:
        res["product"] = bench_product(s, [s.n_slot, large], a.rounds, device)
    if "step" in a.sections:
        res["step"] = bench_step(s, large, a.rounds, device)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
