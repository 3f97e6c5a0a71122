"""The benchmark's configurations (:class:`Case`), the context every section runs in
(:class:`Bench`), and how a case is filled, stepped and timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils.flop_counter import FlopCounterMode

from crtn.app_config import BenchSpec
from crtn.config import spec_dict, train_config
from crtn.model import ResolvedSpec, Spec, TransformerLM, build_model, resolve_spec
from crtn.model.lookup import LookupIndex, ending_keys

#: slots filled by real steps before a case's timing; a larger cache gets the rest of its slots
#: as random states (:func:`fill_cache`: the cost of a step does not depend on what they hold)
REAL_FILL_SLOTS = 64


@dataclass(frozen=True)
class Row:
    """One row of the cost table: its name, its ``crtn-train`` overrides, the resolved spec they
    compose to (at the standard sizes) and, for a model with a cache, the same spec with
    ``n_slot = bench.n_slot_large`` (the N-scaling column)."""

    name: str
    overrides: tuple[str, ...]
    spec: Spec
    large: Spec | None = None


@dataclass
class Bench:
    """What every section reads: the settings (``bench.*`` with ``bench.smoke`` applied), the device,
    the stepper, a progress log, the model of the ``config`` section (``model``/``cache``/
    ``query``/``summary`` as composed, resolved) with the command line that composed it, and the
    table's rows."""

    s: BenchSpec
    device: torch.device
    stepper: Stepper
    log: Callable[[str], None]
    model: Spec | None = None
    command: str = ""
    rows: tuple[Row, ...] = ()


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
    flops: int | None = None


def model_cfg(s: BenchSpec, name: str, mem_len: int, **kw: Any):
    """A crtn-train config node for a benchmark model: the schema's defaults (as the tests' configs,
    :func:`crtn.config.train_config`) with :func:`size_overrides`, ``model.name`` and ``kw`` (dotted keys)."""
    return train_config({**size_overrides(s, mem_len), "model.name": name, **kw})


def model_spec(s: BenchSpec, name: str, mem_len: int, **kw: Any) -> ResolvedSpec:
    """The resolved spec of :func:`model_cfg` (:func:`crtn.model.resolve_spec`), what
    :func:`make_case` builds.

    Raises:
        ConfigError: a value or pairing the model's rules refuse."""
    return resolve_spec(model_cfg(s, name, mem_len, **kw))


def size_overrides(s: BenchSpec, mem_len: int) -> dict[str, Any]:
    """The dotted keys a benchmark model sets over the schema: the standard sizes (``top_k`` only
    when ``bench.top_k`` is set), and dropout 0."""
    return {
        "model.n_layer": s.n_layer,
        "model.d_model": s.d_model,
        "model.n_head": s.n_head,
        "model.d_head": s.d_head,
        "model.d_inner": s.d_inner,
        "model.tgt_len": s.tgt_len,
        "model.mem_len": mem_len,
        "model.dropout": 0.0,
        "cache.n_slot": s.n_slot,
        **({} if s.top_k is None else {"cache.top_k": s.top_k}),
    }


def make_case(
    name: str, spec: Any, s: BenchSpec, device: torch.device, train: bool = True, batch: int | None = None
) -> Case:
    """A case of the model ``spec`` describes (a resolved spec: :func:`crtn.model.resolve_spec`; built with seed 0) with
    vocabulary ``s.vocab``, an Adam optimiser when ``train``, and random token streams of ``batch``
    (default ``s.batch``) rows, long enough to fill its memory and cache and then step on."""
    torch.manual_seed(0)
    model = build_model(spec, s.vocab).to(device)
    model.train(train)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4) if train else None
    b = batch or s.batch
    n_seg = 4 + (model.mem_len // model.tgt_len) + min(_n_slot(model), REAL_FILL_SLOTS)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s.vocab, (b, (n_seg + 64) * model.tgt_len + 1), generator=g).to(device)
    return Case(name, model, opt, tokens=tokens)


def _n_slot(model: TransformerLM) -> int:
    return model.n_slot if model.has_cache and model.spec.cache.enabled else 0


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that host timers see it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stepper:
    """Runs one training (or evaluation) step of a case over the next segment of its streams:
    forward, and when the case has an optimiser the mean NLL's backward, clipping at 0.25 and an
    Adam step (as a training step of ``crtn-train``); ``amp``: bf16 autocast."""

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
        """Run until memory and cache are full (steady state), without timing or training: real
        steps for the memory and up to :data:`REAL_FILL_SLOTS` slots, random states for the rest."""
        m = case.model
        n_slot = _n_slot(m)
        opt, case.opt = case.opt, None
        for _ in range(m.mem_len // m.tgt_len + min(n_slot, REAL_FILL_SLOTS) + 1):
            self(case)
        case.opt = opt
        if n_slot > REAL_FILL_SLOTS:
            fill_cache(case)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def fill_cache(case: Case) -> None:
    """Fill every slot of a case's cache with random states at consistent past positions (the
    stream position moves on by the cache's span, so every slot lies before the memory).

    Timing does not depend on what the states are, and filling N = 10^4 slots with real
    steps would take longer than the benchmark itself.
    """
    cache, model = case.state.cache, case.model
    cache.commit()
    n, B, L = cache.n_slot, cache.batch_size, cache.seg_len
    case.state.pos += n * L
    cache.values.normal_(generator=torch.Generator(device=cache.values.device).manual_seed(2))
    t0 = case.state.pos - model.mem_len
    cache.pos.copy_((t0 - L * (n - torch.arange(n, device=cache.pos.device)))[None].expand(B, n))
    cache.n_insert = n
    if cache.keys is not None:  # each slot's key, as the model makes it when the slot enters
        stored = cache.values.view(cache.values.shape[0], B, n, L, -1)
        for i in range(n):
            cache.keys[:, i] = model.slot_key(stored[:, :, i].to(cache.keys.dtype))
    if cache.index is not None:  # a lookup's keys of random tokens over the 256-token vocabulary
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(0, 256, (B, n * L), generator=gen).to(cache.pos.device)
        keys = ending_keys(tokens, model.match_lengths).view(-1, B, n, L)  # slot i of the ring: oldest first
        cache.index = LookupIndex.of_slots(keys, torch.arange(n, device=tokens.device))
    if cache.backend == "faiss":
        cache._rebuild_faiss()


def state_bytes(case: Case) -> int:
    """Bytes of the persistent tensors of a case: parameters, optimiser moments, memory and cache."""
    total = sum(p.numel() * p.element_size() for p in case.model.parameters())
    if case.opt is not None:
        for st in case.opt.state.values():
            total += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    if case.state is not None:
        total += case.state.nbytes()
    return total


def step_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Largest tensor memory (bytes) allocated during ``fn()`` beyond what was alive before: the CUDA
    allocator's peak (``torch.cuda.max_memory_allocated``) on a GPU; on the CPU the largest running
    sum of the profiler's allocation and free records in time order (each allocation is one record,
    whichever operators it happens inside; memory alive before ``fn`` and freed in it has no record,
    as the profiler knows no size for it, so it makes no room).

    The profiler's per-operator memory (``FunctionEvent.cpu_memory_usage``) counts an allocation once
    for every operator it happens inside (``linear`` -> ``matmul`` -> ``mm``): summed over the
    operators it gives the bytes allocated times the nesting depth, not a peak.
    """
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for e in sorted(records, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def step_flops(fn: Callable[[], None]) -> int:
    """Floating-point operations of the matrix products that ``fn()`` runs (``mm``, ``bmm``,
    ``addmm``, ``baddbmm``, convolutions and fused attention kernels, in whatever autograd
    function or ``out=`` form they are called, forward and backward), two per multiply-add, as
    ``torch.utils.flop_counter.FlopCounterMode`` counts them from their shapes: the arithmetic
    a step executes, padding included (the grouped products' padded tiles, ``grouped.py``).
    Element-wise operations, gathers and copies are not counted. Their ratio between two models is
    the step ratio both would have at the same rate of products (docs/results.md, "Arithmetic of a
    step")."""
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def time_cases(cases: list[Case], b: Bench, measure_step: bool = True) -> None:
    """Fill and warm up every case, then time them in alternation (``rounds`` rounds, one step of
    each per round, the device synchronised around each step), then measure each one's persistent
    state and, with ``measure_step`` (the training cases whose ratios report them), one more
    step's peak memory (with ``bench.memory``) and the FLOPs of its matrix products
    (:func:`step_flops`)."""
    for c in cases:
        b.stepper.fill(c)
        for _ in range(b.s.warmup):
            b.stepper(c)
    for _ in range(b.s.rounds):
        for c in cases:
            sync(b.device)
            t = time.perf_counter()
            b.stepper(c)
            sync(b.device)
            c.times.append(time.perf_counter() - t)
    for c in cases:
        if measure_step and b.s.memory:
            c.peak = step_peak(lambda c=c: b.stepper(c), b.device)
        if measure_step:
            c.flops = step_flops(lambda c=c: b.stepper(c))
        c.static = state_bytes(c)


def median(c: Case) -> float:
    """Median step time (seconds)."""
    return statistics.median(c.times)


def tokens_per_s(c: Case) -> float:
    """Tokens stepped per second: batch x tgt_len / median step time."""
    return c.tokens.shape[0] * c.model.tgt_len / median(c)


def row(c: Case, ref: Case | None = None) -> dict[str, Any]:
    """A case's measurements (ms, tokens/s, GFLOP of a step's matrix products and the rate they
    ran at over the whole step, GFLOP/s: the numerator of model FLOPs utilisation, against the
    hardware's peak; MB; with ``ref`` its step time / ``ref``'s) and its resolved model spec
    (``spec``: what was really built)."""
    r = {
        "config": c.name,
        "step_ms": 1000 * median(c),
        "tokens_per_s": tokens_per_s(c),
        "gflop": None if c.flops is None else c.flops / 1e9,
        "gflop_per_s": None if c.flops is None else c.flops / 1e9 / median(c),
        "peak_step_mb": None if c.peak is None else c.peak / 2**20,
        "state_mb": None if c.static is None else c.static / 2**20,
    }
    if ref is not None:
        r["time_ratio_vs_ref"] = median(c) / median(ref)
    r["spec"] = spec_dict(c.model.spec)
    return r


def free(cases: list[Case]) -> None:
    """Drop the cases' models, optimisers, states and streams (and CUDA's cached blocks)."""
    for c in cases:
        c.state = c.model = c.opt = c.tokens = None
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
