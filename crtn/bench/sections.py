"""The sections of ``crtn-bench``: strategies, range, scaling, retrieval, main_pass."""

from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crtn.bench.cases import (
    Case,
    Sizes,
    Stepper,
    free,
    make_case,
    model_cfg,
    row,
    step_peak,
    sync,
    time_cases,
    timed,
    tokens_per_s,
)
from crtn.config import default_summary
from crtn.model import SegmentCache
from crtn.model.summary import make_summary

#: pairings of the N-scaling rows: ``token`` with one key per slot (``last_state``; the
#: default ``token_max`` scores every row of every slot, B L N L d, and grows with N), and
#: ``last_l`` with ``identity`` (d_key = L d); chosen pairings, not the strategies' defaults.
SCALING_PAIRS = (("token", "last_state"), ("last_l", "identity"))


def strategy_cases(s: Sizes) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, what the row measures, config overrides) of the crtn rows of the strategies section.

    Every strategy with its default summary (``token``: ``token_max``, the default model), plus
    ``token`` with ``last_state`` keys (one key per slot: the cheap scoring that the N-scaling
    rows measure) and the default with retrieval in the top layer only (``cache.layers=1``).
    """
    out = []
    for q in s.strategies:
        summ = default_summary(q)
        pair = {"query.strategy": q, "summary.name": summ}
        what = "default pairing" if q == "token" else f"strategy {q} with its default summary"
        out.append((f"crtn({q}/{summ})", what, pair))
        if q == "token":
            out.append(
                (
                    "crtn(token/last_state)",
                    "one key per slot (not the default): scoring B L N d",
                    {"query.strategy": q, "summary.name": "last_state"},
                )
            )
            out.append(
                (
                    f"crtn(token/{summ}, layers=1)",
                    "default pairing, retrieval in the top layer only (cache.layers=1)",
                    {**pair, "cache.layers": 1},
                )
            )
    return out


def bench_strategies(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """crtn (:func:`strategy_cases`) against txl(mem_len=L), training and evaluation."""
    L = s.tgt_len
    out: dict[str, Any] = {}
    for mode in ("train", "eval"):
        train = mode == "train"
        cases = [make_case(f"txl(mem_len={L})", model_cfg(s, "txl", L), s, device=device, train=train)]
        what = {cases[0].name: f"Transformer-XL, memory {L} (the reference)"}
        for name, measures, kw in strategy_cases(s):
            cases.append(make_case(name, model_cfg(s, "crtn", L, **kw), s, device=device, train=train))
            what[name] = f"{measures}; n_slot={s.n_slot}, top_k={s.top_k}"
        log(f"strategies/{mode}: timing {len(cases)} configurations")
        time_cases(cases, stepper, s, device=device, memory=s.memory and train)
        out[mode] = [{**row(c, cases[0]), "measures": what[c.name]} for c in cases]
        free(cases)
    return out


def bench_range(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """crtn(n_slot=N) against txl whose memory covers the same range, m + N L."""
    L, N = s.tgt_len, s.n_slot
    long_mem = L + N * L
    cases = [make_case(f"txl(mem_len={long_mem})", model_cfg(s, "txl", long_mem), s, device=device)]
    for q in ("token", "last_l"):
        summ = default_summary(q)
        cfg = model_cfg(s, "crtn", L, **{"query.strategy": q, "summary.name": summ})
        cases.append(make_case(f"crtn({q}/{summ}, n_slot={N})", cfg, s, device=device))
    log(f"range: txl(mem_len={long_mem}) against crtn(n_slot={N})")
    time_cases(cases, stepper, s, device=device, memory=s.memory)
    rows = [row(c, cases[0]) for c in cases]
    rows[0]["measures"] = f"Transformer-XL whose memory covers crtn's range, m + N L = {long_mem}"
    for r, c in zip(rows[1:], cases[1:]):
        r["measures"] = f"default summary, mem_len={L}, n_slot={N}, top_k={s.top_k}"
        r["speedup_vs_txl_same_range"] = tokens_per_s(c) / tokens_per_s(cases[0])
    free(cases)
    return {"range_tokens": long_mem, "rows": rows}


def bench_scaling(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """crtn training step time against n_slot (token/last_state and last_l/identity)."""
    L = s.tgt_len
    out: dict[str, Any] = {}
    for q, summ in SCALING_PAIRS:
        cases = []
        for n in s.slots_scaling:
            cfg = model_cfg(s, "crtn", L, **{"query.strategy": q, "summary.name": summ, "cache.n_slot": n})
            cases.append(make_case(f"crtn({q}/{summ}, n_slot={n})", cfg, s, device=device))
        log(f"scaling {q}/{summ}: n_slot {list(s.slots_scaling)}")
        time_cases(cases, stepper, s, device=device, memory=False)
        out[f"{q}/{summ}"] = [row(c, cases[0]) for c in cases]
        free(cases)
    return out


def bench_retrieval(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """Top-k retrieval alone (torch, faiss flat, faiss HNSW), then a faiss evaluation step."""
    d, L, k = s.d_model, s.tgt_len, s.top_k
    summ = make_summary("last_state", L, d)
    rows = []
    rng = np.random.default_rng(0)
    for n in s.keys_retrieval:
        log(f"retrieval: {n:,} keys per row")
        caches = {}
        keys = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32)) / d**0.5
        for name, backend, opts in (
            ("torch", "torch", {}),
            ("faiss-flat", "faiss", {"index": "flat"}),
            ("faiss-hnsw", "faiss", {"index": "hnsw", "hnsw_m": 32, "hnsw_ef_search": 128}),
        ):
            c = SegmentCache(n, 1, summ, backend=backend, faiss_opts=opts)
            # bulk fill (timing insertion is not the point here): one tiny value row per slot
            c.insert(torch.zeros(1, 1, 1, d), keys[:1], 0)
            c.commit()
            c.values = torch.zeros(1, n, 1, d)
            c.keys = keys[None].to(device if backend == "torch" else "cpu").clone()
            c.pos = torch.arange(n)[None] * L
            c.usage = torch.zeros(1, n, dtype=torch.long)
            c.n_insert = n
            if backend == "faiss":
                c._rebuild_faiss()
            caches[name] = c
        q = torch.from_numpy(rng.standard_normal((1, L, d)).astype(np.float32)) / d**0.5
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(s.rounds):
            for name, c in caches.items():
                qq = q.to(device) if name == "torch" else q
                sync(device)
                t = time.perf_counter()
                c.select(qq, top_k=k, alpha_norm="topk", t0=n * L, count=False)
                sync(device)
                times[name].append(time.perf_counter() - t)
        exact = caches["faiss-flat"].select(q, top_k=k, alpha_norm="topk", t0=n * L, count=False).slot
        approx = caches["faiss-hnsw"].select(q, top_k=k, alpha_norm="topk", t0=n * L, count=False).slot
        recall = np.mean([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(exact[0], approx[0])])
        for name in caches:
            rows.append(
                {
                    "keys": n,
                    "backend": name,
                    "ms": 1000 * statistics.median(times[name]),
                    "recall_at_k": recall if name == "faiss-hnsw" else 1.0,
                }
            )
        del caches
    return {"rows": rows, "eval_faiss": bench_eval_faiss(s, device, stepper, log)}


def fill_cache(case: Case) -> None:
    """Fill every slot of a case's cache with random states at consistent past positions.

    Timing does not depend on what the states are, and filling N = 10^4 slots with real
    steps would take longer than the benchmark itself.
    """
    cache, model = case.state.cache, case.model
    cache.commit()
    n, B, L = cache.n_slot, cache.batch_size, cache.seg_len
    g = torch.Generator(device="cpu").manual_seed(2)
    for layer in range(cache.values.shape[0]):
        cache.values[layer].copy_(torch.randn(cache.values[layer].shape, generator=g).to(cache.values.dtype))
    t0 = case.state.pos - model.mem_len
    cache.pos.copy_((t0 - L * (n - torch.arange(n)))[None].expand(B, n))
    cache.n_insert = n
    if cache.keys is not None:
        with torch.no_grad():
            cache.keys.copy_(
                model.summary.key(cache.layer_values(cache.values.shape[0] - 1).to(cache.keys.dtype))
            )
    if cache.backend == "faiss":
        cache._rebuild_faiss()


def bench_eval_faiss(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """Evaluation (batch 1) with the faiss backend and a large cache: share of time in retrieval."""
    L, n = s.tgt_len, s.eval_slots
    out: dict[str, Any] = {"n_slot": n}
    for dtype in ("float32", "float16"):
        # faiss holds one key per slot, so not token_max (token's default): last_state keys
        pair = {"query.strategy": "token", "summary.name": "last_state"}
        cfg = model_cfg(
            s,
            "crtn",
            L,
            **pair,
            **{"cache.n_slot": n, "cache.backend": "faiss", "cache.alpha_norm": "topk", "cache.dtype": dtype},
        )
        case = make_case(
            f"crtn(token/last_state) eval faiss n_slot={n} ({dtype})",
            cfg,
            s,
            device=device,
            train=False,
            batch=1,
        )
        log(f"eval faiss: filling {n:,} slots ({dtype})")
        for _ in range(3):  # real steps: memory full, cache allocated
            stepper(case)
        fill_cache(case)
        cache = case.state.cache
        cache.select_seconds = 0.0
        times = []
        for _ in range(s.rounds):
            t = time.perf_counter()
            stepper(case)
            times.append(time.perf_counter() - t)
        spent = [cache.select_seconds]
        total = sum(times)
        out[dtype] = {
            "step_ms": 1000 * statistics.median(times),
            "retrieval_share": spent[0] / total,
            "cache_mb": case.state.cache.values.numel() * case.state.cache.values.element_size() / 2**20,
        }
        free([case])
    return out


def bench_main_pass(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """The model's main pass against the naive per-token reference of the tests (float32, forward)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from tests.reference import NaiveCRTN
    except ImportError:
        return {"skipped": "tests/reference.py not found (run from a source checkout)"}
    small = dataclasses.replace(s, batch=s.naive_batch, tgt_len=s.naive_len)
    pair = f"token/{default_summary('token')}"
    cfg = model_cfg(
        small, "crtn", small.tgt_len, **{"cache.n_slot": 4, "summary.name": default_summary("token")}
    )
    case = make_case(
        f"crtn({pair}) main pass",
        cfg,
        small,
        device=torch.device("cpu"),
        train=False,
        batch=small.naive_batch,
    )
    model = case.model.eval()
    L = model.tgt_len
    x_all = case.tokens
    refs = [NaiveCRTN(model) for _ in range(x_all.shape[0])]
    state = None
    with torch.no_grad():
        for t in range(6):  # fill the cache in both
            x, y = x_all[:, t * L : (t + 1) * L], x_all[:, t * L + 1 : (t + 1) * L + 1]
            state = model(x, y, state).state
            for b, r in enumerate(refs):
                r.step(x[b], y[b], t * L)
    t = 6
    x, y = x_all[:, t * L : (t + 1) * L], x_all[:, t * L + 1 : (t + 1) * L + 1]
    log("main pass: efficient against the naive per-token reference")

    def fast():
        with torch.no_grad():
            model(x, y, state, update=False)

    def naive():
        with torch.no_grad():
            for b, r in enumerate(refs):
                saved = copy.deepcopy(r.row)
                r.step(x[b], y[b], t * L)
                r.row = saved

    tf = [timed(fast) for _ in range(s.rounds)]
    tn = [timed(naive) for _ in range(max(1, s.rounds // 2))]
    pf = pn = None
    if s.memory:
        pf, pn = step_peak(fast, torch.device("cpu")) / 2**20, step_peak(naive, torch.device("cpu")) / 2**20
    return {
        "pair": pair,
        "batch": x.shape[0],
        "tgt_len": L,
        "efficient_ms": 1000 * statistics.median(tf),
        "naive_ms": 1000 * statistics.median(tn),
        "speedup": statistics.median(tn) / statistics.median(tf),
        "efficient_peak_mb": pf,
        "naive_peak_mb": pn,
    }


SECTIONS = {
    "strategies": bench_strategies,
    "range": bench_range,
    "scaling": bench_scaling,
    "retrieval": bench_retrieval,
    "main_pass": bench_main_pass,
}
