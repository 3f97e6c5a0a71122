"""``crtn-bench``: side-by-side speed and memory of CRTN and Transformer-XL (SPEC §3, CRTN paper table 1).

    crtn-bench                      # full benchmark for this machine (CPU, ~10 minutes)
    crtn-bench --device cuda        # the same on a GPU (larger batch, bf16 autocast option)
    crtn-bench --smoke              # tiny sizes, a few seconds, still prints every ratio
    crtn-bench --only scaling,retrieval
    crtn-bench --strategies token,last_l,middle_l,linear   # without the slow fixed_length ones

Method: all configurations of a comparison live in one process; each is first run until
its memory and cache are full (steady state, not the first steps of a run); then the
configurations are timed in alternation, one step each per round, and the median over
rounds is reported, so that drifting machine load affects them alike. Ratios are taken
between configurations of the same comparison. Peak memory is the largest amount of
tensor memory alive during one step (the CUDA allocator's peak on GPU; the profiler's
allocation trace on CPU), plus the size of the step's persistent state.

Sections (default sizes: synthetic data with vocabulary 256, n_layer 4, d_model 256,
n_head 4, d_inner 1024, tgt_len 64, batch 16):

1. ``strategies``: txl(mem_len=64) against crtn(mem_len=64, n_slot=32, top_k=2) for each
   query strategy with its default summary (training and evaluation tokens/s);
2. ``range``: crtn(n_slot=32) against txl with the same dependency range
   (mem_len = 64 + 32*64 = 2112);
3. ``scaling``: crtn training step time as n_slot grows (16, 64, 256, 1024), for the
   ``token`` query with ``last_state`` keys and for ``last_l`` with ``identity`` keys;
4. ``retrieval``: top-k retrieval alone, torch against faiss (flat and HNSW), for 10^3,
   10^4 and 10^5 keys per row; and an evaluation step (batch 1) with the faiss backend
   and 10^4 slots, with the share of its time spent in retrieval;
5. ``main_pass``: the efficient main pass against the naive per-token reference of the
   tests (speed and peak memory).

Writes ``bench.json`` and ``bench.md`` into ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from crtn.config import STRATEGIES, default_summary, train_config
from crtn.model import TransformerLM, build_model

#: ``scaling`` compares keys of width d (``token`` with ``last_state``) with keys of width L*d
#: (``last_l`` with ``identity``): chosen pairings, not the strategies' defaults.
SCALING_PAIRS = (("token", "last_state"), ("last_l", "identity"))


@dataclass
class Sizes:
    """Model and data sizes of a benchmark run."""

    vocab: int = 256
    n_layer: int = 4
    d_model: int = 256
    n_head: int = 4
    d_head: int = 64
    d_inner: int = 1024
    tgt_len: int = 64
    batch: int = 16
    n_slot: int = 32
    top_k: int = 2
    slots_scaling: tuple[int, ...] = (16, 64, 256, 1024)
    keys_retrieval: tuple[int, ...] = (1_000, 10_000, 100_000)
    eval_slots: int = 10_000
    rounds: int = 7
    warmup: int = 2
    naive_batch: int = 2
    naive_len: int = 16
    strategies: tuple[str, ...] = STRATEGIES
    memory: bool = True  # measure peak memory (the CPU profiler makes this slow)


SMOKE = Sizes(
    vocab=64,
    n_layer=2,
    d_model=32,
    n_head=2,
    d_head=16,
    d_inner=64,
    tgt_len=8,
    batch=2,
    n_slot=8,
    slots_scaling=(4, 16),
    keys_retrieval=(100, 1000),
    eval_slots=200,
    rounds=3,
    warmup=1,
    naive_batch=1,
    naive_len=4,
    memory=False,
)


@dataclass
class Case:
    """One configuration: its model, optimiser and the state of its streams."""

    name: str
    model: TransformerLM
    opt: torch.optim.Optimizer | None
    state: Any = None
    tokens: torch.Tensor | None = None
    times: list[float] = field(default_factory=list)
    peak: int | None = None
    static: int | None = None


def model_cfg(s: Sizes, name: str, mem_len: int, **kw: Any):
    """A crtn-train config node for a benchmark model: the schema's defaults (as the tests' configs,
    :func:`crtn.config.train_config`) with :func:`size_overrides` and ``kw`` (dotted keys)."""
    return train_config({**size_overrides(s, name, mem_len), **kw})


def size_overrides(s: Sizes, name: str, mem_len: int) -> dict[str, Any]:
    """The dotted keys a benchmark model sets over the schema: its sizes, and dropout 0."""
    return {
        "model.name": name,
        "model.n_layer": s.n_layer,
        "model.d_model": s.d_model,
        "model.n_head": s.n_head,
        "model.d_head": s.d_head,
        "model.d_inner": s.d_inner,
        "model.tgt_len": s.tgt_len,
        "model.mem_len": mem_len,
        "model.dropout": 0.0,
        "cache.n_slot": s.n_slot,
        "cache.top_k": s.top_k,
    }


def make_case(
    name: str, cfg: Any, s: Sizes, device: torch.device, train: bool = True, batch: int | None = None
) -> Case:
    torch.manual_seed(0)
    model = build_model(cfg, s.vocab).to(device)
    model.train(train)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4) if train else None
    b = batch or s.batch
    n_seg = 4 + (model.mem_len // model.tgt_len) + model.n_slot  # enough to fill memory and cache
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s.vocab, (b, (n_seg + 64) * model.tgt_len + 1), generator=g).to(device)
    return Case(name, model, opt, tokens=tokens)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stepper:
    """Runs one training (or evaluation) step of a case over the next segment of its streams."""

    def __init__(self, device: torch.device, amp: bool):
        self.device, self.amp = device, amp
        self.pos: dict[str, int] = {}

    def __call__(self, case: Case) -> None:
        L = case.model.tgt_len
        t = self.pos.get(case.name, 0)
        if (t + 1) * L + 1 > case.tokens.shape[1]:
            t = self.pos[case.name] = 0
        x = case.tokens[:, t * L : (t + 1) * L]
        y = case.tokens[:, t * L + 1 : (t + 1) * L + 1]
        ctx = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.amp else _null()
        if case.opt is not None:
            case.opt.zero_grad(set_to_none=True)
            with ctx:
                out = case.model(x, y, case.state)
                loss = out.nll.float().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(case.model.parameters(), 0.25)
            case.opt.step()
        else:
            with torch.no_grad(), ctx:
                out = case.model(x, y, case.state)
        case.state = out.state
        self.pos[case.name] = t + 1

    def fill(self, case: Case) -> None:
        """Run until memory and cache are full (steady state), without timing."""
        m = case.model
        steps = m.mem_len // m.tgt_len + (m.n_slot if m.name == "crtn" else 0) + 1
        opt, case.opt = case.opt, None
        for _ in range(steps):
            self(case)
        case.opt = opt


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def state_bytes(case: Case) -> int:
    """Bytes of the persistent tensors of a case: parameters, optimiser moments, memory and cache."""
    total = sum(p.numel() * p.element_size() for p in case.model.parameters())
    if case.opt is not None:
        for st in case.opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    st = case.state
    if st is not None:
        for t in (st.mem, st.r_prev):
            if t is not None:
                total += t.numel() * t.element_size()
        if st.cache is not None and st.cache.values is not None:
            c = st.cache
            for t in (c.values, c.keys):
                if t is not None:
                    total += t.numel() * t.element_size()
    return total


def step_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Largest tensor memory (bytes) allocated during ``fn()`` beyond what was alive before."""
    if device.type == "cuda":
        _sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.events() if e.cpu_memory_usage != 0), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.cpu_memory_usage
        peak = max(peak, live)
    return peak


def time_cases(
    cases: list[Case], stepper: Stepper, s: Sizes, device: torch.device, memory: bool = True
) -> None:
    """Fill, warm up, then time the cases in alternation (``s.rounds`` rounds)."""
    for c in cases:
        stepper.fill(c)
        for _ in range(s.warmup):
            stepper(c)
    for _ in range(s.rounds):
        for c in cases:
            _sync(device)
            t = time.perf_counter()
            stepper(c)
            _sync(device)
            c.times.append(time.perf_counter() - t)
    for c in cases:
        if memory:
            c.peak = step_peak(lambda c=c: stepper(c), device)
        c.static = state_bytes(c)


def median(c: Case) -> float:
    return statistics.median(c.times)


def tokens_per_s(c: Case) -> float:
    return c.tokens.shape[0] * c.model.tgt_len / median(c)


def row(c: Case, ref: Case | None = None) -> dict[str, Any]:
    r = {
        "config": c.name,
        "step_ms": 1000 * median(c),
        "tokens_per_s": tokens_per_s(c),
        "peak_step_mb": None if c.peak is None else c.peak / 2**20,
        "state_mb": None if c.static is None else c.static / 2**20,
    }
    if ref is not None:
        r["time_ratio_vs_ref"] = median(c) / median(ref)
    return r


def free(cases: list[Case]) -> None:
    for c in cases:
        c.state = c.model = c.opt = c.tokens = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------ sections
def bench_strategies(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """crtn (every strategy, default summary) against txl(mem_len=L), training and evaluation."""
    L = s.tgt_len
    out: dict[str, Any] = {}
    for mode in ("train", "eval"):
        cases = [make_case(f"txl(mem_len={L})", model_cfg(s, "txl", L), s, device, mode == "train")]
        for q in s.strategies:
            summ = default_summary(q)
            cfg = model_cfg(s, "crtn", L, **{"query.strategy": q, "summary.name": summ})
            cases.append(make_case(f"crtn({q}/{summ})", cfg, s, device, mode == "train"))
        log(f"strategies/{mode}: timing {len(cases)} configurations")
        time_cases(cases, stepper, s, device, memory=s.memory and mode == "train")
        out[mode] = [row(c, cases[0]) for c in cases]
        free(cases)
    return out


def bench_range(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """crtn(n_slot=N) against txl whose memory covers the same range, m + N L."""
    L, N = s.tgt_len, s.n_slot
    long_mem = L + N * L
    cases = [make_case(f"txl(mem_len={long_mem})", model_cfg(s, "txl", long_mem), s, device)]
    for q in ("token", "last_l"):
        summ = default_summary(q)
        cfg = model_cfg(s, "crtn", L, **{"query.strategy": q, "summary.name": summ})
        cases.append(make_case(f"crtn({q}/{summ}, n_slot={N})", cfg, s, device))
    log(f"range: txl(mem_len={long_mem}) against crtn(n_slot={N})")
    time_cases(cases, stepper, s, device, memory=s.memory)
    rows = [row(c, cases[0]) for c in cases]
    for r, c in zip(rows[1:], cases[1:]):
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
            cases.append(make_case(f"crtn({q}/{summ}, n_slot={n})", cfg, s, device))
        log(f"scaling {q}/{summ}: n_slot {list(s.slots_scaling)}")
        time_cases(cases, stepper, s, device, memory=False)
        out[f"{q}/{summ}"] = [row(c, cases[0]) for c in cases]
        free(cases)
    return out


def bench_retrieval(s: Sizes, device: torch.device, stepper: Stepper, log: Callable) -> dict[str, Any]:
    """Top-k retrieval alone (torch, faiss flat, faiss HNSW), then a faiss evaluation step."""
    from crtn.model.cache import SegmentCache
    from crtn.model.summary import Summary

    d, L, k = s.d_model, s.tgt_len, s.top_k
    summ = Summary("last_state", L, d)
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
            c = SegmentCache(n, 1, backend=backend, faiss_opts=opts)
            # bulk fill (timing insertion is not the point here): one tiny value row per slot
            c.insert(torch.zeros(1, 1, 1, d), keys[:1], 0, summ)
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
                _sync(device)
                t = time.perf_counter()
                c.select(qq, summ, k, "topk", n * L, count=False)
                _sync(device)
                times[name].append(time.perf_counter() - t)
        exact = caches["faiss-flat"].select(q, summ, k, "topk", n * L, count=False).slot
        approx = caches["faiss-hnsw"].select(q, summ, k, "topk", n * L, count=False).slot
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
            s, "crtn", L, **pair, **{"cache.n_slot": n, "cache.backend": "faiss", "cache.dtype": dtype}
        )
        case = make_case(
            f"crtn(token/last_state) eval faiss n_slot={n} ({dtype})", cfg, s, device, train=False, batch=1
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
        f"crtn({pair}) main pass", cfg, small, torch.device("cpu"), train=False, batch=small.naive_batch
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

    tf = [_timed(fast) for _ in range(s.rounds)]
    tn = [_timed(naive) for _ in range(max(1, s.rounds // 2))]
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


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


# ----------------------------------------------------------------- reporting
def markdown(res: dict[str, Any]) -> str:
    """The benchmark's tables as Markdown."""
    lines = [f"# crtn-bench ({res['device']}, {res['time']})", "", f"sizes: `{res['sizes']}`", ""]

    def table(rows: list[dict], cols: list[str]) -> None:
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            cells = []
            for c in cols:
                v = r.get(c)
                cells.append(f"{v:,.3g}" if isinstance(v, float) else str(v if v is not None else ""))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")

    cols = ["config", "step_ms", "tokens_per_s", "time_ratio_vs_ref", "peak_step_mb", "state_mb"]
    if "strategies" in res:
        for mode in ("train", "eval"):
            lines.append(f"## 1. Strategies vs txl ({mode}; ratio = step time / txl's)")
            table(res["strategies"][mode], cols)
    if "range" in res:
        lines.append(f"## 2. Same dependency range ({res['range']['range_tokens']} tokens)")
        table(res["range"]["rows"], [*cols, "speedup_vs_txl_same_range"])
    if "scaling" in res:
        for key, rows in res["scaling"].items():
            lines.append(f"## 3. Step time vs n_slot ({key}; ratio vs the smallest)")
            table(rows, cols[:4])
    if "retrieval" in res:
        lines.append("## 4. Retrieval alone (batch 1, one segment of queries)")
        table(res["retrieval"]["rows"], ["keys", "backend", "ms", "recall_at_k"])
        ev = res["retrieval"]["eval_faiss"]
        lines.append(f"Evaluation step, batch 1, faiss, n_slot={ev['n_slot']:,}:")
        lines.append("")
        table(
            [{"cache dtype": k, **v} for k, v in ev.items() if isinstance(v, dict)],
            ["cache dtype", "step_ms", "retrieval_share", "cache_mb"],
        )
    if "main_pass" in res:
        lines.append("## 5. Efficient main pass vs naive per-token reference")
        table([res["main_pass"]], list(res["main_pass"]))
    if res.get("targets"):
        lines.append("## Targets")
        table(res["targets"], ["target", "measured", "limit", "met"])
    return "\n".join(lines)


def check_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets, evaluated on this run's ratios."""
    out = []

    def add(name: str, measured: float, limit: float, higher_is_better: bool) -> None:
        met = measured >= limit if higher_is_better else measured <= limit
        out.append({"target": name, "measured": measured, "limit": limit, "met": bool(met)})

    if "range" in res:
        for r in res["range"]["rows"][1:]:
            add(f"{r['config']} tokens/s / txl(same range)", r["speedup_vs_txl_same_range"], 5.0, True)
    if "scaling" in res:
        pair = "/".join(SCALING_PAIRS[0])
        rows = res["scaling"][pair]
        add(f"{pair} step(n_slot max) / step(n_slot min)", rows[-1]["time_ratio_vs_ref"], 1.25, False)
    if "strategies" in res:
        for r in res["strategies"]["train"][1:]:
            name = r["config"]  # crtn(STRATEGY/SUMMARY)
            strategy = name.removeprefix("crtn(").split("/")[0]
            limit = {"token": 2.5, "last_l": 3.0, "middle_l": 3.0, "linear": 3.0}.get(strategy)
            if limit is not None:
                add(f"{name} train step / txl", r["time_ratio_vs_ref"], limit, False)
    if "retrieval" in res:
        ev = res["retrieval"]["eval_faiss"]
        add(
            f"faiss eval (n_slot={ev['n_slot']}) retrieval share",
            ev["float32"]["retrieval_share"],
            0.30,
            False,
        )
    return out


SECTIONS = {
    "strategies": bench_strategies,
    "range": bench_range,
    "scaling": bench_scaling,
    "retrieval": bench_retrieval,
    "main_pass": bench_main_pass,
}


def run(sizes: Sizes, device: torch.device, only: list[str], amp: bool, log: Callable) -> dict[str, Any]:
    """Run the chosen sections; returns the JSON-ready results (with ``targets``)."""
    res: dict[str, Any] = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "host": platform.node(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "sizes": sizes.__dict__,
        "amp": amp,
    }
    stepper = Stepper(device, amp)
    for name in only:
        t = time.perf_counter()
        res[name] = SECTIONS[name](sizes, device, stepper, log)
        log(f"{name}: {time.perf_counter() - t:.1f}s")
    res["targets"] = check_targets(res)
    return res


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``crtn-bench``."""
    p = argparse.ArgumentParser(prog="crtn-bench", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--smoke", action="store_true", help="tiny sizes: a few seconds, every ratio still printed"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--batch", type=int, default=None, help="override the batch size (e.g. 64 on a GPU)")
    p.add_argument("--amp", action="store_true", help="bf16 autocast (CUDA)")
    p.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}"
    )
    p.add_argument("--rounds", type=int, default=None, help="timed rounds per configuration")
    p.add_argument(
        "--strategies",
        default=None,
        help="comma-separated query strategies of the strategies section (default: all six; "
        "the fixed_length ones take most of the CPU time)",
    )
    p.add_argument("--out", default="bench", help="folder for bench.json and bench.md")
    a = p.parse_args(argv)
    from crtn.utils import tune_allocator

    tune_allocator()  # as crtn-train does
    only = [x for x in a.only.split(",") if x]
    bad = [x for x in only if x not in SECTIONS]
    if bad:
        p.error(f"--only: unknown section {bad[0]!r}; choose from {', '.join(SECTIONS)}")
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available")
    sizes = copy.deepcopy(SMOKE if a.smoke else Sizes())
    if a.batch:
        sizes.batch = a.batch
    if a.rounds:
        sizes.rounds = a.rounds
    if a.strategies:
        chosen = tuple(x for x in a.strategies.split(",") if x)
        unknown = [x for x in chosen if x not in STRATEGIES]
        if unknown:
            p.error(f"--strategies: unknown strategy {unknown[0]!r}; choose from {', '.join(STRATEGIES)}")
        sizes.strategies = chosen
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)

    res = run(sizes, device, only, a.amp, log)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(res, indent=2))
    md = markdown(res)
    (out / "bench.md").write_text(md + "\n")
    print(md)
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
