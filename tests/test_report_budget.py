"""``crtn-report``'s equal-time and equal-token comparison (crtn/report/budget.py) on hand-built
sweeps whose jobs share a ``train.max_time``: the numbers each table must show are read off the
constructed ``metrics.jsonl`` and ``results.json`` by hand."""

from __future__ import annotations

import csv
import json
import socket
import subprocess
import sys
from pathlib import Path

import yaml

from crtn.report import write_report

BUDGET = 600
TOKENS_PER_STEP = 16 * 64  # data.batch_size * model.tgt_len below


def _config(model: str) -> dict:
    return {
        "model": {"name": model, "tgt_len": 64, "mem_len": 64},
        "data": {"name": "wt2", "level": "char", "batch_size": 16},
        "train": {"max_step": 4000, "max_time": BUDGET, "eval_interval": 100},
    }


def _job(
    d: Path, model: str, evals: list[tuple[int, float, float]], last_step: int, status: dict, results=None
):
    """A job directory: validations (step, elapsed s, valid bpc) and a training record at each
    validation's step and at ``last_step``."""
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(_config(model)))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"model={model}"]))
    (d / "status.json").write_text(json.dumps(status))
    recs = []
    for step, t, bpc in evals:
        recs.append({"step": step, "train_loss": 2.0, "train_bpc": 2.9, "elapsed": t - 1.0})
        recs.append({"step": step, "valid_loss": bpc * 0.6931, "valid_bpc": bpc, "elapsed": t})
    recs.append(
        {"step": last_step, "train_loss": 1.9, "train_bpc": 2.7, "elapsed": 999.0 if results else 260.0}
    )
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    if results is not None:
        (d / "results.json").write_text(json.dumps(results))


def _dead_status() -> dict:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    return {"state": "running", "time": 1.7e9, "pid": gone.pid, "host": socket.gethostname()}


def _txl(d: Path, evals) -> None:
    results = {
        "model": "txl",
        "metric": "bpc",
        "steps": 400,
        "train_time_s": 600.5,
        "stopped_by": f"train.max_time={BUDGET}s",
        "valid": {"loss": 1.4, "bpc": 2.10},
        "test": {"loss": 1.39, "bpc": 2.05},
    }
    _job(d, "txl", evals, 400, {"state": "done"}, results)


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path, newline="") as f:
        return {r["job"]: r for r in csv.DictReader(f)}


def test_equal_time_and_equal_tokens_with_a_job_that_died_early(tmp_path):
    sweep = tmp_path / "sweep"
    # txl: done at the budget after 400 steps; crtn: died at step 250, validated at 100 and 200
    _txl(sweep / "0", [(100, 150.0, 3.0), (200, 300.0, 2.5), (300, 450.0, 2.2), (400, 600.0, 2.1)])
    _job(sweep / "1", "crtn", [(100, 90.0, 3.2), (200, 180.0, 2.4)], 250, _dead_status())
    written = write_report(sweep, plots=True)
    assert {"equal_time.csv", "equal_tokens.csv", "equal_budget.png"} <= set(written)

    t = _rows(sweep / "equal_time.csv")
    assert (t["0"]["status"], t["0"]["valid"], t["0"]["test"], t["0"]["steps"]) == (
        "done",
        "2.1",
        "2.05",
        "400",
    )
    assert t["0"]["tokens"] == str(400 * TOKENS_PER_STEP) and t["0"]["note"] == ""
    assert (t["0"]["last_valid_step"], t["0"]["last_valid"]) == ("400", "2.1")
    assert t["1"]["status"] == "died" and t["1"]["valid"] == "" and t["1"]["test"] == ""
    assert (t["1"]["steps"], t["1"]["train_time_s"], t["1"]["last_valid"]) == ("250", "260.0", "2.4")
    assert "no result at the budget (died): stopped at step 250" in t["1"]["note"]

    # every job reached step 250; the last validation both have is step 200
    k = _rows(sweep / "equal_tokens.csv")
    for job, valid, elapsed in (("0", "2.5", "300.0"), ("1", "2.4", "180.0")):
        row = k[job]
        assert (row["common_step"], row["step"], row["valid"], row["elapsed_s"]) == (
            "250",
            "200",
            valid,
            elapsed,
        )
        assert row["tokens"] == str(200 * TOKENS_PER_STEP) and row["aligned"] == "True"
        assert "every job trained to step 250" in row["note"]
    assert k["0"]["reached"] == "400" and k["1"]["reached"] == "250"

    md = (sweep / "report.md").read_text()
    assert "## Equal time and equal tokens" in md and "| equal tokens (at step 200) |" in md
    assert "| 0 | txl | done | 400 | 409,600 | 2.1000 | 2.0500 | 2.1000 (400, 10.0 min) |  |" in md
    assert "![equal_budget.png](equal_budget.png)" in md


def test_evaluations_that_do_not_line_up_are_said_so_not_interpolated(tmp_path):
    sweep = tmp_path / "sweep"
    _txl(sweep / "0", [(100, 150.0, 3.0), (200, 300.0, 2.5), (300, 450.0, 2.2), (400, 600.0, 2.1)])
    # crtn validated at 150 and 350 only, and ran to step 380
    _job(sweep / "1", "crtn", [(150, 200.0, 2.8), (350, 560.0, 2.3)], 380, {"state": "running"})
    write_report(sweep, plots=False)
    k = _rows(sweep / "equal_tokens.csv")
    assert {r["aligned"] for r in k.values()} == {"False"} and k["0"]["common_step"] == "380"
    # each job's last validation at or before step 380, with its own step
    assert (k["0"]["step"], k["0"]["valid"]) == ("300", "2.2")
    assert (k["1"]["step"], k["1"]["valid"]) == ("350", "2.3")
    assert "do not line up" in k["1"]["note"] and "step 350" in k["1"]["note"]
    assert "evaluations do not line up by step 380" in (sweep / "report.md").read_text()


def test_jobs_without_a_shared_budget_get_no_comparison(tmp_path):
    sweep = tmp_path / "sweep"
    _txl(sweep / "0", [(100, 150.0, 3.0)])
    write_report(sweep, plots=False)
    assert not (sweep / "equal_time.csv").exists()
    assert "Equal time" not in (sweep / "report.md").read_text()
