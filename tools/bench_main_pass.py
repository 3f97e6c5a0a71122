"""The efficient main pass (docs/method.md §3, "Efficient main pass") against the tests' naive
per-token reference (``tests/reference.py``, ``NaiveCRTN``): forward time and peak memory of one
segment, memory and cache full, float32 on the CPU.

    python tools/bench_main_pass.py                    # batch 2, 16 tokens, the bench's model sizes
    python tools/bench_main_pass.py --smoke            # tiny sizes, seconds
    python tools/bench_main_pass.py --out main_pass.json

Run it from a source checkout (it imports ``tests.reference``, which is not installed; the
checkout's root is put on ``sys.path``). The model is ``crtn`` with its default pairing
(``token``/``token_max``) at the standard sizes of ``crtn-bench`` (``bench.*``, crtn/config.py)
with ``cache.n_slot=4``; peak memory as ``crtn-bench`` measures it (the profiler's allocation
trace).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from crtn.app_config import BENCH_SMOKE, BenchSpec  # noqa: E402
from crtn.bench.cases import make_case, model_spec, step_peak  # noqa: E402
from crtn.config import default_summary  # noqa: E402
from tests.reference import NaiveCRTN  # noqa: E402


def timed(fn) -> float:
    """Seconds ``fn()`` takes."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(s: BenchSpec, batch: int, tgt_len: int, memory: bool) -> dict:
    """Time the model's main pass and the naive reference over one segment after 6 filling segments."""
    small = replace(s, batch=batch, tgt_len=tgt_len)
    summ = default_summary("token")
    cfg = model_spec(
        small, "crtn", tgt_len, **{"query.strategy": "token", "cache.n_slot": 4, "summary.name": summ}
    )
    case = make_case(f"crtn(token/{summ}) main pass", cfg, small, device=torch.device("cpu"), train=False)
    model = case.model.eval()
    L, x_all = model.tgt_len, case.tokens
    refs = [NaiveCRTN(model) for _ in range(x_all.shape[0])]
    state = None
    with torch.no_grad():
        for t in range(6):  # fill memory and cache in both
            x, y = x_all[:, t * L : (t + 1) * L], x_all[:, t * L + 1 : (t + 1) * L + 1]
            state = model(x, y, state).state
            for b, r in enumerate(refs):
                r.step(x[b], y[b], t * L)
    t = 6
    x, y = x_all[:, t * L : (t + 1) * L], x_all[:, t * L + 1 : (t + 1) * L + 1]

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
    cpu = torch.device("cpu")
    pf = step_peak(fast, cpu) / 2**20 if memory else None
    pn = step_peak(naive, cpu) / 2**20 if memory else None
    return {
        "pair": f"token/{summ}",
        "batch": batch,
        "tgt_len": L,
        "efficient_ms": 1000 * statistics.median(tf),
        "naive_ms": 1000 * statistics.median(tn),
        "speedup": statistics.median(tn) / statistics.median(tf),
        "efficient_peak_mb": pf,
        "naive_peak_mb": pn,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="the sizes of bench.smoke=true, 4 tokens, batch 1")
    p.add_argument("--batch", type=int, default=None, help="streams (default 2; smoke 1)")
    p.add_argument("--tgt-len", type=int, default=None, help="tokens per segment (default 16; smoke 4)")
    p.add_argument("--out", default=None, help="also write the results (JSON) to this file")
    a = p.parse_args()
    s = BenchSpec()
    if a.smoke:
        s = replace(s, **BENCH_SMOKE)
    batch = a.batch or (1 if a.smoke else 2)
    tgt_len = a.tgt_len or (4 if a.smoke else 16)
    res = measure(s, batch, tgt_len, memory=not a.smoke)
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
