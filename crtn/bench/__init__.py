"""``crtn-bench``: the speed and memory of the model ``crtn-train`` would build, against
Transformer-XL, and the cost table (docs/method.md §3; docs/results.md, "Performance").

A Hydra app with ``crtn-train``'s model groups (``model``, ``cache``, ``query``, ``summary``,
composed by ``conf/bench.yaml`` exactly as ``conf/train.yaml`` composes them) and the settings
``bench.*`` (:class:`crtn.app_config.BenchSpec`: every default is there)::

    crtn-bench                                        # config and table sections (CPU: long)
    crtn-bench bench.smoke=true                       # tiny sizes, seconds, every ratio printed
    crtn-bench bench.sections=[config] model=crtn query=last_l summary=mean cache.layers=2
    crtn-bench bench.sections=[table] bench.device=cuda bench.batch=64 bench.amp=true
    crtn-bench bench.sections=[strategies,range] bench.strategies=[token,last_l]
    crtn-bench "+bench.rows.last_l_mean=['query=last_l','summary=mean']" bench.sections=[table]

Sections (``bench.sections``; they run in this order):

- ``config``: the composed model (sizes of its ``model.*``, batch ``bench.batch``, vocabulary
  ``bench.vocab``) against Transformer-XL of the same sizes, ``tgt_len`` and ``mem_len``
  (training step time, peak step memory, tokens/s; evaluation step time) and, for a model with a
  cache, against Transformer-XL whose memory covers the same range, m + N L (tokens/s);
- ``table``: the rows of ``bench.rows`` (Hydra-composed ``crtn-train`` overrides; by default
  txl, the CRTN authors' model ``model=crtn_original``, the default ``model=crtn`` and its row
  match ``query=token``, each CRTN also with ``cache.layers=2`` and ``cache.layers=1``) at the
  standard sizes, against the row ``bench.reference``: training step, peak step memory, tokens/s
  against txl of the same range, step at ``n_slot_large`` over step at ``n_slot``, evaluation
  step;
- ``strategies``: txl(mem_len=L) against crtn for each query strategy of ``bench.strategies``
  with its default summary, plus ``token`` with ``last_state`` keys and the row match (``token``
  with ``token_max``) with ``cache.layers=1`` (training and evaluation);
- ``range``: crtn(n_slot=N), token and last_l, against txl with the same dependency range;
- ``scaling``: crtn training step time as n_slot grows (``bench.slots_scaling``) for the
  ``token`` query with ``last_state`` keys and for ``last_l`` with ``identity`` keys;
- ``retrieval``: top-k retrieval alone, torch against faiss (flat and HNSW), for
  ``bench.keys_retrieval`` keys per row; and an evaluation step (batch 1) with the faiss backend
  and ``bench.eval_slots`` slots, with the share of its time spent in retrieval.

The standard sizes (every section but ``config``): vocabulary 256, n_layer 4, d_model 256,
n_head 4, d_inner 1024, tgt_len = mem_len = 64, batch 16, n_slot 32, and each model's own top_k
(``cache.top_k``'s default, or its model option's; ``bench.top_k`` sets one for every row).

Method: all configurations of a comparison live in one process; each is first run until its
memory and cache are full (steady state; slots beyond the first 64 are filled with random
states, which costs the same), then the configurations are timed in alternation, one step each
per round, and the median over ``bench.rounds`` rounds is reported, so that drifting machine
load affects them alike. A training step is forward, backward, gradient clipping and an Adam
step. Peak memory is the largest amount of tensor memory alive during one step beyond what was
alive before it (``torch.cuda.max_memory_allocated`` on a GPU; the profiler's allocation trace
on the CPU); the persistent state (parameters, optimiser moments, memory, cache) is reported
apart. The targets (:mod:`crtn.bench.report`) are evaluated for every configuration with a
cache.

Writes ``bench.json`` (every measurement, and the resolved spec of every configuration) and
``bench.md`` into ``bench.out`` (default: the Hydra run folder) and prints the tables.
``python tools/bench_main_pass.py`` times the efficient main pass against the tests' naive
per-token reference.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from crtn.app import given_keys, resolve_device, run_app
from crtn.app_config import BENCH_SMOKE, BenchSpec
from crtn.bench.cases import Bench, Row, Stepper
from crtn.bench.compare import ROW_GROUPS, bench_config, bench_table, compose_rows
from crtn.bench.report import check_targets, markdown
from crtn.bench.sections import bench_range, bench_retrieval, bench_scaling, bench_strategies
from crtn.config import STRATEGIES
from crtn.errors import ConfigError, check_choice
from crtn.model import hardware, resolve_spec
from crtn.utils import atomic_write_text

__all__ = [
    "SECTIONS",
    "Bench",
    "Row",
    "check_targets",
    "main",
    "markdown",
    "resolve_bench",
    "run",
    "run_bench",
]

log = logging.getLogger("crtn-bench")

#: every section, in the order they run
SECTIONS: dict[str, Callable[[Bench], dict[str, Any]]] = {
    "config": bench_config,
    "table": bench_table,
    "strategies": bench_strategies,
    "range": bench_range,
    "scaling": bench_scaling,
    "retrieval": bench_retrieval,
}

_POSITIVE = ("rounds", "batch", "vocab", "n_layer", "d_model", "n_head", "d_head", "d_inner", "tgt_len")
_POSITIVE += ("n_slot", "top_k", "n_slot_large", "eval_slots")


def resolve_bench(s: BenchSpec, given: dict[str, Any] | None = None) -> BenchSpec:
    """The settings a run uses: with ``smoke``, :data:`crtn.app_config.BENCH_SMOKE` over the standard
    sizes, except the keys in ``given`` (those the command line set); every value checked.

    Raises:
        ConfigError: naming the ``bench.*`` key and value.
    """
    if s.smoke:
        s = replace(s, **{k: v for k, v in BENCH_SMOKE.items() if k not in (given or {})})
    if not s.sections:
        raise ConfigError(f"bench.sections is empty; choose from {', '.join(SECTIONS)}")
    for name in s.sections:
        check_choice("bench.sections", name, SECTIONS)
    for name in s.strategies:
        check_choice("bench.strategies", name, STRATEGIES)
    for key in _POSITIVE:
        if getattr(s, key) is not None and getattr(s, key) <= 0:  # top_k None: each row's own
            raise ConfigError(f"bench.{key}={getattr(s, key)} must be > 0")
    if s.warmup < 0:
        raise ConfigError(f"bench.warmup={s.warmup} must be >= 0")
    for key in ("slots_scaling", "keys_retrieval"):
        values = getattr(s, key)
        if not values or min(values) <= 0:
            raise ConfigError(f"bench.{key}={list(values)} must be a non-empty list of positive sizes")
    return s


def bench_device(name: str) -> torch.device:
    """The device of ``bench.device`` (cpu, cuda, cuda:N or auto).

    Raises:
        ConfigError: not a device, or CUDA asked for but not available.
    """
    try:
        device = resolve_device(name) if name == "auto" else torch.device(name)
    except RuntimeError:
        raise ConfigError(f"bench.device={name!r} is not a device (cpu, cuda, cuda:N or auto)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"bench.device={name!r} but CUDA is not available")
    return device


def run(b: Bench) -> dict[str, Any]:
    """Run the sections of ``b.s.sections`` (in :data:`SECTIONS` order); returns the JSON-ready
    results, with ``targets`` (:func:`check_targets`)."""
    device = b.device
    res: dict[str, Any] = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "host": platform.node(),
        "threads": torch.get_num_threads(),
        # whether this CPU multiplies bfloat16 natively, which decides the products' dtype of a
        # bfloat16 cache (crtn/model/hardware.py) and so the cost table's CPU ratios
        "cpu": hardware.cpu_features().get("cpu_name"),
        "cpu_bf16_units": hardware.multiplies_natively(torch.bfloat16, torch.device("cpu")),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": {k: v for k, v in asdict(b.s).items() if k != "rows"},
    }
    for name, section in SECTIONS.items():
        if name in b.s.sections:
            t = time.perf_counter()
            res[name] = section(b)
            b.log(f"{name}: {time.perf_counter() - t:.1f}s")
    res["targets"] = check_targets(res)
    return res


def _command(overrides: list[str]) -> str:
    """The command line's overrides of the model groups (what the ``config`` section's model is)."""
    return " ".join(o for o in overrides if o.split("=", 1)[0].lstrip("+~").split(".")[0] in ROW_GROUPS)


def run_bench(cfg: Any) -> dict[str, Any]:
    """The ``crtn-bench`` task: check every setting (and compose the table's rows) before any
    timing, run the sections, write ``bench.json`` and ``bench.md``, print the tables.

    Raises:
        ConfigError: a bad ``bench.*`` value, a model the groups cannot build, an output folder
            that cannot be created.
    """
    hc = HydraConfig.get()
    s = resolve_bench(OmegaConf.to_object(cfg.bench), given_keys(cfg, "bench"))
    device = bench_device(s.device)
    model = resolve_spec(cfg) if "config" in s.sections else None
    rows = compose_rows(s) if "table" in s.sections else ()
    out = Path(s.out or hc.runtime.output_dir)
    try:  # before minutes of timing, not after
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"bench.out={str(out)!r} cannot be created ({e.strerror or e})") from None
    command = _command(list(hc.overrides.task))
    b = Bench(s, device, Stepper(device, s.amp), log=log.info, model=model, command=command, rows=rows)
    res = run(b)
    atomic_write_text(out / "bench.json", json.dumps(res, indent=2))
    md = markdown(res)
    atomic_write_text(out / "bench.md", md + "\n")
    print(md, flush=True)
    log.info("wrote %s and %s", out / "bench.json", out / "bench.md")
    return res


def main() -> None:
    """Console entry point of ``crtn-bench``."""
    run_app("crtn-bench", "bench", run_bench)
