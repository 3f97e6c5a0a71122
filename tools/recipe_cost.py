"""What a paper recipe costs on this machine: seconds per training step at full size, peak memory,
and the projected time of the whole recipe (docs/results.md, "The paper recipes").

    python tools/recipe_cost.py ptb_paper crtn --out cost/ptb_crtn.json [--steps 20] [--warmup 3]

Builds the run exactly as ``crtn-train +experiment=RECIPE model=MODEL`` would (the composed
config, the corpus, :class:`crtn.trainer.Trainer`), runs ``--warmup`` untimed training steps (the
cache holds at least top_k slots after them), then times ``--steps`` steps one by one
(wall clock). Peak memory: the process' maximum resident set size (``getrusage``), which
includes the corpus and the Python runtime. Projection: the median step CPU time times the
recipe's steps (``train.max_epoch`` epochs of ``len(train iterator)`` steps), validation
excluded. Run one configuration per process, so that each peak is its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from crtn.app_config import register_configs
from crtn.config import resolve
from crtn.distributed import DistributedContext
from crtn.trainer import Trainer


def measure(recipe: str, model: str, steps: int, warmup: int, out: Path) -> dict:
    """Time ``steps`` training steps of ``+experiment=recipe model=model`` on the CPU; the
    results so far are written to ``out`` after every timed step (a stopped run keeps them)."""
    register_configs()
    with initialize_config_module(config_module="crtn.conf", version_base="1.3"):
        cfg = compose("train", overrides=[f"+experiment={recipe}", f"model={model}", "train.device=cpu"])
    resolve(cfg)
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, dist=DistributedContext(), device=torch.device("cpu"), run_dir=Path(tmp))
        trainer.start()
        it = trainer.train_it.iterate(0)
        times, cpu = [], []
        for i in range(warmup + steps):
            batch = next(it)
            t0, c0 = time.perf_counter(), time.process_time()
            trainer.train_step(batch)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                res = _results(cfg, trainer, times, cpu)
                out.write_text(json.dumps(res, indent=2))
    return res


def _results(cfg, trainer: Trainer, times: list[float], cpu: list[float]) -> dict:
    step_s = statistics.median(cpu)
    per_epoch, total = len(trainer.train_it), trainer.total_steps
    return {
        "recipe": cfg.data.name,
        "model": cfg.model.name,
        "params": trainer.n_params,
        "threads": torch.get_num_threads(),
        "timed_steps": len(cpu),
        "step_cpu_s_median": step_s,
        "step_wall_s_median": statistics.median(times),
        "step_cpu_s_all": cpu,
        "step_wall_s_all": times,
        "loadavg_end": Path("/proc/loadavg").read_text().split()[:3],
        "tokens_per_s": cfg.data.batch_size * cfg.model.tgt_len / step_s,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "steps_per_epoch": per_epoch,
        "recipe_steps": total,
        "projected_days": step_s * total / 86400,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe", help="experiment file, e.g. ptb_paper")
    ap.add_argument("model", help="crtn | crtn_original | txl")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    res = measure(args.recipe, args.model, args.steps, args.warmup, args.out)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_all")}), file=sys.stdout)


if __name__ == "__main__":
    main()
