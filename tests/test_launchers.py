"""Hydra multirun through the real entry point: basic, joblib and submitit_local launchers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.test_train import TINY, cli

FAST = [*TINY, "train.max_step=4", "train.eval_interval=2", "train.log_interval=2"]


def jobs(sweep: Path) -> dict[str, dict]:
    """Job dir name -> {'config': composed config, 'results': results.json or None, 'status': ...}."""
    out = {}
    for d in sorted(p for p in sweep.iterdir() if (p / ".hydra").is_dir()):
        res = d / "results.json"
        out[d.name] = {
            "config": yaml.safe_load((d / ".hydra/config.yaml").read_text()),
            "results": json.loads(res.read_text()) if res.exists() else None,
            "status": json.loads((d / "status.json").read_text()),
        }
    return out


@pytest.mark.parametrize("launcher", ["joblib", "submitit_local"])
def test_launcher_runs_one_job_per_combination(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    extra = ["hydra.launcher.n_jobs=2"] if launcher == "joblib" else ["hydra.launcher.timeout_min=10"]
    p = cli(
        "crtn.train",
        ["-m", *FAST, f"hydra/launcher={launcher}", *extra, "query=token,last_l", f"hydra.sweep.dir={sweep}"],
        tmp_path,
        timeout=400,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    found = jobs(sweep)
    assert list(found) == ["0", "1"]
    assert [j["config"]["query"]["strategy"] for j in found.values()] == ["token", "last_l"]
    assert [j["config"]["summary"]["name"] for j in found.values()] == ["token_max", "identity"]
    for j in found.values():
        assert j["status"]["state"] == "done" and j["results"]["steps"] == 4
    for d in found:  # set in the worker process that ran the job, not only in the launching one
        assert "CPU arithmetic flushes denormal floats to zero" in (sweep / d / "train.log").read_text()


def test_failed_job_does_not_stop_the_sweep(tmp_path):
    sweep = tmp_path / "sweep"
    p = cli("crtn.train", ["-m", *FAST, "cache.n_slot=-1,4", f"hydra.sweep.dir={sweep}"], tmp_path)
    assert p.returncode != 0  # Hydra reports the failed job at the end
    found = jobs(sweep)
    assert found["0"]["status"]["state"] == "failed" and found["0"]["results"] is None
    assert "cache.n_slot=-1" in (sweep / "0" / "train.log").read_text()
    assert found["1"]["status"]["state"] == "done" and found["1"]["results"]["steps"] == 4
