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
   query strategy with its default summary (``token``: ``token_max``, the default model),
   plus ``token`` with ``last_state`` keys and the default with ``cache.layers=1``
   (training and evaluation tokens/s; each row says what it measures);
2. ``range``: crtn(n_slot=32) against txl with the same dependency range
   (mem_len = 64 + 32*64 = 2112);
3. ``scaling``: crtn training step time as n_slot grows (16, 64, 256, 1024), for the
   ``token`` query with ``last_state`` keys (not the default ``token_max``, whose scoring
   grows as B L N L d) and for ``last_l`` with ``identity`` keys;
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
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from crtn.bench.cases import SMOKE, Case, Sizes, Stepper, model_cfg, size_overrides
from crtn.bench.sections import SCALING_PAIRS, SECTIONS
from crtn.config import STRATEGIES
from crtn.utils import atomic_write_text, tune_allocator

__all__ = [
    "SECTIONS",
    "SMOKE",
    "Case",
    "Sizes",
    "check_targets",
    "main",
    "markdown",
    "model_cfg",
    "run",
    "size_overrides",
]


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

    cols = ["config", "step_ms", "tokens_per_s", "time_ratio_vs_ref", "peak_step_mb", "state_mb", "measures"]
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


#: issue 15's limits: crtn(token) step / txl(mem L), crtn tokens/s / txl(same range),
#: crtn peak step memory / txl's (the release comparison is measured outside the benchmark)
STEP_LIMIT, RANGE_LIMIT, MEMORY_LIMIT, RETRIEVAL_SHARE_LIMIT = 1.8, 5.0, 1.8, 0.30


def check_targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 15's targets, evaluated on this run's ratios (the ``token`` rows of the strategies
    section, every crtn row of the range section), plus the N-scaling and faiss limits."""
    out = []

    def add(name: str, measured: float, limit: float, higher_is_better: bool) -> None:
        met = measured >= limit if higher_is_better else measured <= limit
        out.append({"target": name, "measured": measured, "limit": limit, "met": bool(met)})

    if "range" in res:
        for r in res["range"]["rows"][1:]:
            add(
                f"{r['config']} tokens/s / txl(same range)", r["speedup_vs_txl_same_range"], RANGE_LIMIT, True
            )
    if "scaling" in res:
        pair = "/".join(SCALING_PAIRS[0])
        rows = res["scaling"][pair]
        add(f"{pair} step(n_slot max) / step(n_slot min)", rows[-1]["time_ratio_vs_ref"], 1.25, False)
    if "strategies" in res:
        train = res["strategies"]["train"]
        for r in train[1:]:
            if not r["config"].startswith("crtn(token/"):
                continue
            add(f"{r['config']} train step / txl", r["time_ratio_vs_ref"], STEP_LIMIT, False)
            if r.get("peak_step_mb") and train[0].get("peak_step_mb"):
                ratio = r["peak_step_mb"] / train[0]["peak_step_mb"]
                add(f"{r['config']} peak step memory / txl", ratio, MEMORY_LIMIT, False)
    if "retrieval" in res:
        ev = res["retrieval"]["eval_faiss"]
        add(
            f"faiss eval (n_slot={ev['n_slot']}) retrieval share",
            ev["float32"]["retrieval_share"],
            RETRIEVAL_SHARE_LIMIT,
            False,
        )
    return out


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


class _Parser(argparse.ArgumentParser):
    """argparse with its errors as one line ``crtn-bench: error: ...`` (no usage lines), exit 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message} (see crtn-bench --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    """Console entry point of ``crtn-bench``."""
    p = _Parser(prog="crtn-bench", description=__doc__.split("\n\n")[0])
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
    tune_allocator()  # as crtn-train does
    only = [x for x in a.only.split(",") if x]
    bad = [x for x in only if x not in SECTIONS]
    if bad:
        p.error(f"--only: unknown section {bad[0]!r}; choose from {', '.join(SECTIONS)}")
    for flag, value in (("--batch", a.batch), ("--rounds", a.rounds)):
        if value is not None and value <= 0:
            p.error(f"{flag} {value}: must be > 0")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        p.error(f"--device {a.device}: not a device (cpu, cuda or cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {a.device}: CUDA is not available")
    out = Path(a.out)
    try:  # before minutes of timing, not after
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out {a.out}: cannot be created ({e.strerror or e})")
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

    res = run(sizes, device, only=only, amp=a.amp, log=log)
    atomic_write_text(out / "bench.json", json.dumps(res, indent=2))
    md = markdown(res)
    atomic_write_text(out / "bench.md", md + "\n")
    print(md)
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
