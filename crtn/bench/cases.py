"""The benchmark's configurations (:class:`Case`), sizes, and how a case is stepped and timed."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from crtn.config import STRATEGIES, train_config, uses_cache
from crtn.model import TransformerLM, build_model


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
    n_slot = model.n_slot if model.has_cache else 0
    n_seg = 4 + (model.mem_len // model.tgt_len) + n_slot  # enough to fill memory and cache
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, s.vocab, (b, (n_seg + 64) * model.tgt_len + 1), generator=g).to(device)
    return Case(name, model, opt, tokens=tokens)


def sync(device: torch.device) -> None:
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
        steps = m.mem_len // m.tgt_len + (m.n_slot if uses_cache(m) else 0) + 1
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
    if case.state is not None:
        total += case.state.nbytes()
    return total


def step_peak(fn: Callable[[], None], device: torch.device) -> int:
    """Largest tensor memory (bytes) allocated during ``fn()`` beyond what was alive before."""
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        sync(device)
        return torch.cuda.max_memory_allocated(device) - base
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
            sync(device)
            t = time.perf_counter()
            stepper(c)
            sync(device)
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


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
