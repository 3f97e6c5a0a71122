"""The standard sections of ``crtn-bench`` at the standard sizes (``bench.*``): strategies, range,
scaling, retrieval. The ``config`` and ``table`` sections are in :mod:`crtn.bench.compare`."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np
import torch

from crtn.bench.cases import (
    Bench,
    fill_cache,
    free,
    make_case,
    model_spec,
    row,
    sync,
    time_cases,
    tokens_per_s,
)
from crtn.config import default_summary
from crtn.model import SegmentCache
from crtn.model.spec import CacheSpec, QuerySpec
from crtn.model.summary import make_summary

#: pairings of the N-scaling rows: ``token`` with one key per slot (``last_state``; the
#: default ``token_max`` scores every row of every slot, B L N L d, and grows with N), and
#: ``last_l`` with ``identity`` (d_key = L d); chosen pairings, not the strategies' defaults.
SCALING_PAIRS = (("token", "last_state"), ("last_l", "identity"))


def strategy_cases(strategies: tuple[str, ...]) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, what the row measures, config overrides) of the crtn rows of the strategies section.

    Every strategy with its default summary (``lookup``: the default model; ``token``: ``token_max``,
    the row match), plus ``token`` with ``last_state`` keys (one key per slot: the cheap scoring
    that the N-scaling rows measure) and the row match with retrieval in the top layer only
    (``cache.layers=1``).
    """
    out = []
    for q in strategies:
        summ = default_summary(q)
        pair = {"query.strategy": q, "summary.name": summ}
        what = "the default model" if q == QuerySpec().strategy else f"strategy {q} with its default summary"
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
                    "the row match, retrieval in the top layer only (cache.layers=1)",
                    {**pair, "cache.layers": 1},
                )
            )
    return out


def bench_strategies(b: Bench) -> dict[str, Any]:
    """crtn (:func:`strategy_cases` of ``bench.strategies``) against txl(mem_len=L), training and
    evaluation (step time ratios; peak memory and matrix-product FLOPs in training)."""
    s = b.s
    L = s.tgt_len
    out: dict[str, Any] = {}
    for mode in ("train", "eval"):
        train = mode == "train"
        cases = [make_case(f"txl(mem_len={L})", model_spec(s, "txl", L), s, device=b.device, train=train)]
        what = {cases[0].name: f"Transformer-XL, memory {L} (the reference)"}
        for name, measures, kw in strategy_cases(s.strategies):
            spec = model_spec(s, "crtn", L, **kw)
            cases.append(make_case(name, spec, s, device=b.device, train=train))
            what[name] = f"{measures}; n_slot={s.n_slot}, top_k={spec.cache.top_k}"
        b.log(f"strategies/{mode}: timing {len(cases)} configurations")
        time_cases(cases, b, measure_step=train)
        out[mode] = [{**row(c, cases[0]), "measures": what[c.name]} for c in cases]
        free(cases)
    return out


def bench_range(b: Bench) -> dict[str, Any]:
    """crtn(n_slot=N), token and last_l with their default summaries, against txl whose memory
    covers the same range, m + N L (tokens/s ratio)."""
    s = b.s
    L, N = s.tgt_len, s.n_slot
    long_mem = L + N * L
    cases = [make_case(f"txl(mem_len={long_mem})", model_spec(s, "txl", long_mem), s, device=b.device)]
    for q in ("token", "last_l"):
        summ = default_summary(q)
        cfg = model_spec(s, "crtn", L, **{"query.strategy": q, "summary.name": summ})
        cases.append(make_case(f"crtn({q}/{summ}, n_slot={N})", cfg, s, device=b.device))
    b.log(f"range: txl(mem_len={long_mem}) against crtn(n_slot={N})")
    time_cases(cases, b)
    rows = [row(c, cases[0]) for c in cases]
    rows[0]["measures"] = f"Transformer-XL whose memory covers crtn's range, m + N L = {long_mem}"
    for r, c in zip(rows[1:], cases[1:]):
        r["measures"] = f"default summary, mem_len={L}, n_slot={N}, top_k={c.model.spec.cache.top_k}"
        r["speedup_vs_txl_same_range"] = tokens_per_s(c) / tokens_per_s(cases[0])
    free(cases)
    return {"range_tokens": long_mem, "rows": rows}


def bench_scaling(b: Bench) -> dict[str, Any]:
    """crtn training step time against n_slot (``bench.slots_scaling``) for :data:`SCALING_PAIRS`."""
    s = b.s
    L = s.tgt_len
    out: dict[str, Any] = {}
    for q, summ in SCALING_PAIRS:
        cases = []
        for n in s.slots_scaling:
            cfg = model_spec(s, "crtn", L, **{"query.strategy": q, "summary.name": summ, "cache.n_slot": n})
            cases.append(make_case(f"crtn({q}/{summ}, n_slot={n})", cfg, s, device=b.device))
        b.log(f"scaling {q}/{summ}: n_slot {list(s.slots_scaling)}")
        time_cases(cases, b, measure_step=False)
        out[f"{q}/{summ}"] = [row(c, cases[0]) for c in cases]
        free(cases)
    return out


def _filled_caches(n: int, keys: torch.Tensor, b: Bench) -> dict[str, SegmentCache]:
    """Caches of one row holding the ``n`` keys ``keys`` [n, d] (torch, faiss flat, faiss HNSW)."""
    d, L = keys.shape[1], b.s.tgt_len
    summ = make_summary("last_state", L, d)
    caches = {}
    for name, backend, index in (
        ("torch", "torch", "flat"),
        ("faiss-flat", "faiss", "flat"),
        ("faiss-hnsw", "faiss", "hnsw"),
    ):
        c = SegmentCache(n, 1, summ, backend=backend, faiss_index=index)
        # bulk fill (timing insertion is not the point here): one tiny value row per slot
        c.insert(torch.zeros(1, 1, 1, d), keys[:1], 0)
        c.commit()
        c.values = torch.zeros(1, n, 1, d)
        c.keys = keys[None].to(b.device if backend == "torch" else "cpu").clone()
        c.pos = torch.arange(n)[None] * L
        c.n_insert = n
        if backend == "faiss":
            c._rebuild_faiss()
        caches[name] = c
    return caches


def bench_retrieval(b: Bench) -> dict[str, Any]:
    """Top-k retrieval alone (torch, faiss flat, faiss HNSW; ``bench.keys_retrieval`` keys, one
    segment of queries), then a faiss evaluation step (:func:`bench_eval_faiss`)."""
    s = b.s
    d, L, k = s.d_model, s.tgt_len, CacheSpec.top_k if s.top_k is None else s.top_k
    rows = []
    rng = np.random.default_rng(0)
    for n in s.keys_retrieval:
        b.log(f"retrieval: {n:,} keys per row")
        keys = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32)) / d**0.5
        caches = _filled_caches(n, keys, b)
        q = torch.from_numpy(rng.standard_normal((1, L, d)).astype(np.float32)) / d**0.5
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(s.rounds):
            for name, c in caches.items():
                qq = q.to(b.device) if name == "torch" else q
                sync(b.device)
                t = time.perf_counter()
                c.select(qq, top_k=k, alpha_norm="topk", t0=n * L)
                sync(b.device)
                times[name].append(time.perf_counter() - t)
        exact = caches["faiss-flat"].select(q, top_k=k, alpha_norm="topk", t0=n * L).slot
        approx = caches["faiss-hnsw"].select(q, top_k=k, alpha_norm="topk", t0=n * L).slot
        recall = np.mean([len(set(a.tolist()) & set(b_.tolist())) / k for a, b_ in zip(exact[0], approx[0])])
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
    return {"rows": rows, "eval_faiss": bench_eval_faiss(b)}


def bench_eval_faiss(b: Bench) -> dict[str, Any]:
    """Evaluation (batch 1) with the faiss backend and ``bench.eval_slots`` slots, float32 and
    float16 cache: step time, share of it in retrieval, cache size."""
    s = b.s
    L, n = s.tgt_len, s.eval_slots
    out: dict[str, Any] = {"n_slot": n}
    for dtype in ("float32", "float16"):
        # faiss holds one key per slot, so not token_max (token's default): last_state keys
        extra = {
            "cache.n_slot": n,
            "cache.backend": "faiss",
            "cache.alpha_norm": "topk",
            "cache.dtype": dtype,
        }
        cfg = model_spec(s, "crtn", L, **{"query.strategy": "token", "summary.name": "last_state"}, **extra)
        name = f"crtn(token/last_state) eval faiss n_slot={n} ({dtype})"
        case = make_case(name, cfg, s, device=b.device, train=False, batch=1)
        b.log(f"eval faiss: filling {n:,} slots ({dtype})")
        for _ in range(3):  # real steps: memory full, cache allocated
            b.stepper(case)
        fill_cache(case)
        cache = case.state.cache
        cache.select_seconds = 0.0
        times = []
        for _ in range(s.rounds):
            sync(b.device)
            t = time.perf_counter()
            b.stepper(case)
            sync(b.device)
            times.append(time.perf_counter() - t)
        out[dtype] = {
            "step_ms": 1000 * statistics.median(times),
            "retrieval_share": cache.select_seconds / sum(times),
            "cache_mb": cache.values.numel() * cache.values.element_size() / 2**20,
        }
        free([case])
    return out
