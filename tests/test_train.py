"""crtn-train / crtn-eval through their real entry points (subprocesses)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from crtn.checkpoint import checkpoint_spec as checkpoint_config
from crtn.checkpoint import load_checkpoint
from crtn.config import train_config
from crtn.model import build_model
from crtn.model.summary import DEFAULT_NGRAM, DEFAULT_SHIFT
from tests.helpers import TINY_RUN, cli

TINY = TINY_RUN


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in records(run_dir) if "train_loss" in r}


def test_train_writes_everything_and_eval_reproduces_it(tmp_path):
    run = tmp_path / "run"
    p = cli(
        "crtn.train",
        [*TINY, "train.max_step=12", "train.log_interval=4", "train.eval_interval=6", f"hydra.run.dir={run}"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    for f in (
        ".hydra/config.yaml",
        "train.log",
        "metrics.jsonl",
        "checkpoints/last.pt",
        "checkpoints/best.pt",
        "results.json",
    ):
        assert (run / f).is_file(), f
    res = json.loads((run / "results.json").read_text())
    assert res["model"] == "crtn" and res["steps"] == 12 and res["params"] > 0 and res["tokens_per_s"] > 0
    assert {"ppl", "loss", "repeat", "fresh"} <= set(res["test"])
    assert "final test: ppl" in p.stdout
    steps = [r["step"] for r in records(run) if "train_loss" in r]
    assert steps == [4, 8, 12]
    assert any("valid_ppl" in r for r in records(run))
    ckpt = load_checkpoint(run / "checkpoints/last.pt")
    assert ckpt["step"] == 12 and ckpt["vocab"][0] == "<eos>"
    # token_max's defaults are saved as the values used, not None, so the checkpoint keeps
    # building this model if a default changes
    assert ckpt["config"]["summary"]["name"] == "token_max"
    assert (
        ckpt["config"]["summary"]["ngram"] == DEFAULT_NGRAM
        and ckpt["config"]["summary"]["shift"] == DEFAULT_SHIFT
    )
    assert ckpt["states"][0][0]["cache"]["n_insert"] > 0  # rank 0, chunk 0: the cache state is saved
    # crtn-eval on the best checkpoint gives the valid and test metrics the run reported (the
    # run reuses best.pt's validation from training instead of repeating it)
    e = cli(
        "crtn.eval_app",
        [
            f"checkpoint={run / 'checkpoints/best.pt'}",
            "splits=[valid,test]",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'ev'}",
        ],
        tmp_path,
    )
    assert e.returncode == 0, e.stderr
    ev = json.loads((tmp_path / "ev/eval.json").read_text())
    for split in ("valid", "test"):
        assert ev[split]["loss"] == pytest.approx(res[split]["loss"], rel=1e-6)
    assert "test: ppl" in e.stdout


def test_checkpoint_config_builds_the_model_it_was_trained_with():
    """A checkpoint saved before token_max's ngram/shift keys existed loads with the behaviour it
    was trained with (the single-state match, no shift), whatever today's defaults; a saved None
    takes today's default; explicit values and other summaries are kept."""
    base = OmegaConf.to_container(train_config(), resolve=True)
    old = copy.deepcopy(base)
    del old["summary"]["ngram"], old["summary"]["shift"]
    cfg = checkpoint_config({"config": old})
    assert (cfg.summary.ngram, cfg.summary.shift) == (1, 0)
    model = build_model(cfg, 16)
    assert (model.summary.ngram, model.summary.shift) == (1, 0)
    none = checkpoint_config({"config": base})  # the schema saves None: today's defaults
    assert (none.summary.ngram, none.summary.shift) == (
        min(DEFAULT_NGRAM, base["model"]["tgt_len"]),
        DEFAULT_SHIFT,
    )
    explicit = copy.deepcopy(base)
    explicit["summary"].update(ngram=3, shift=1)
    kept_explicit = checkpoint_config({"config": explicit}).summary
    assert (kept_explicit.ngram, kept_explicit.shift) == (3, 1)
    other = copy.deepcopy(old)
    other["summary"]["name"], other["query"]["strategy"] = "last_state", "token"
    kept = checkpoint_config({"config": other})
    assert kept.summary.ngram is None and kept.summary.shift is None  # not token_max: left alone
    txl = copy.deepcopy(base)
    txl["model"]["name"] = "txl"  # e.g. crtn-convert's output: the summary node is unused
    txl_cfg = checkpoint_config({"config": txl})
    assert txl_cfg.summary.ngram is None and txl_cfg.summary.shift is None


def test_killed_run_resumes_bit_identically(tmp_path):
    """SIGKILL mid-run, rerun on the same directory: losses equal an uninterrupted run exactly."""
    args = [
        *TINY,
        "model.dropout=0.1",
        "train.max_step=16",
        "train.log_interval=1",
        "train.eval_interval=5",
        "train.checkpoint_interval=3",
        "train.eval_max_step=2",
    ]
    full = tmp_path / "full"
    p = cli("crtn.train", [*args, f"hydra.run.dir={full}"], tmp_path)
    assert p.returncode == 0, p.stderr

    part = tmp_path / "part"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "crtn.train", *args, f"hydra.run.dir={part}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline:
        m = part / "metrics.jsonl"
        if m.exists() and len(train_losses(part)) >= 8:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(train_losses(part))
    assert 8 <= killed_at < 16, "the run was not killed mid-way"
    assert load_checkpoint(part / "checkpoints/last.pt")["step"] < 16

    p = cli("crtn.train", [*args, f"hydra.run.dir={part}"], tmp_path)
    assert p.returncode == 0, p.stderr
    assert "resumed from" in (part / "train.log").read_text()
    assert train_losses(part) == train_losses(full)  # exact float equality, every step
    a = json.loads((full / "results.json").read_text())["test"]["loss"]
    b = json.loads((part / "results.json").read_text())["test"]["loss"]
    assert a == b


def test_nonfinite_loss_stops_with_one_line_and_keeps_checkpoint(tmp_path):
    run = tmp_path / "run"
    p = cli(
        "crtn.train",
        [
            *TINY,
            "optim.lr=1e30",
            "optim.warmup_step=0",
            "optim.clip=0",
            "train.max_step=50",
            "train.log_interval=1",
            "train.checkpoint_interval=1",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert p.returncode == 2
    err = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "training loss became" in err[0] and "Traceback" not in p.stderr
    assert (run / "checkpoints/last.pt").exists()
    good = load_checkpoint(run / "checkpoints/last.pt")
    finite = [s for s, v in train_losses(run).items() if v == v and abs(v) != float("inf")]
    assert good["step"] == max(finite)  # saved before the bad loss, never after


def test_bad_input_gives_one_line_error_from_the_console_module(tmp_path):
    """``python -m crtn.train`` with a bad value exits 2 with one line and no traceback, and starts
    no run: the process's own exit path (every bad input of every script is checked in this
    process, as a table, by ``tests/test_bad_inputs.py``)."""
    p = cli("crtn.train", [*TINY, "model.mem_len=12", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("crtn-train: error: model.mem_len=12 must be a multiple of model.tgt_len=8")
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_lr_schedule_hand_computed():
    from crtn.optim import lr_factor

    assert lr_factor(0, "cosine", 4, 104, 0.0) == pytest.approx(0.25)
    assert lr_factor(3, "cosine", 4, 104, 0.0) == pytest.approx(1.0)
    assert lr_factor(54, "cosine", 4, 104, 0.0) == pytest.approx(0.5)
    assert lr_factor(104, "cosine", 4, 104, 0.1) == pytest.approx(0.1)
    assert lr_factor(16, "inv_sqrt", 4, 104, 0.0) == pytest.approx(0.5)
    assert lr_factor(50, "constant", 4, 104, 0.0) == 1.0
