"""crtn-report's "what the cache contributes" (crtn/report/cache_effect.py): one checkpoint
evaluated with and without its cache, by distance bucket, against hand-computed values and
against the total loss of real evaluations."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from crtn.analysis.distance import BUCKETS
from crtn.report import write_report
from crtn.train import train_in
from tests.helpers import TINY_RUN, cli, compose_train
from tests.test_report import assert_png

#: (tokens, loss) of the first four buckets; the other three are empty
WITHOUT = [(10, 4.0), (60, 1.0), (20, 2.0), (10, 3.0)]  # mean loss (40 + 60 + 40 + 30) / 100 = 1.7
WITH = [(10, 4.0), (60, 1.0), (20, 2.0), (10, 2.5)]  # mean loss (40 + 60 + 40 + 25) / 100 = 1.65


def _db(buckets: list[tuple[int, float]], ngram_shift: float) -> dict:
    out = {"corpus": "wt2", "split": "test", "model": "crtn", "reach_tokens": 2112}
    for kind, shift in (("symbol", 0.0), ("ngram", ngram_shift)):
        out[kind] = {b: {"tokens": 0, "loss": None} for b in BUCKETS}
        for b, (n, loss) in zip(BUCKETS, buckets):
            out[kind][b] = {"tokens": n, "loss": loss + shift}
    return out


def _eval_job(root: Path, name: str, checkpoint: str, n_slot: int, buckets: list, tokens: int = 100) -> None:
    """A finished crtn-eval job of ``checkpoint`` at ``eval.n_slot=n_slot`` with these buckets (the
    n-gram analysis: the same losses plus 0.5, so that its differences equal the symbol's)."""
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(
        json.dumps({"checkpoint": checkpoint, "eval": {"n_slot": n_slot}})
    )
    (d / ".hydra" / "overrides.yaml").write_text(
        json.dumps([f"checkpoint={checkpoint}", f"eval.n_slot={n_slot}"])
    )
    (d / "status.json").write_text(json.dumps({"state": "done"}))
    loss = sum(n * v for n, v in buckets) / sum(n for n, _ in buckets)
    test = {"split": "test", "loss": loss, "tokens": tokens, "n_slot": n_slot, "top_k": 2}
    test.update(tgt_len=64, mem_len=64, distance_buckets=_db(buckets, 0.5))
    (d / "eval.json").write_text(json.dumps({"checkpoint": checkpoint, "test": test}))


def test_the_cache_effect_by_hand(tmp_path):
    """a.pt at n_slot 32 against n_slot 0: only bucket 128-511 changes, by 2.5 - 3.0 = -0.5 on 10%
    of the tokens, a contribution of -0.05, which is the whole change of the mean loss (1.65 -
    1.7). Not matched: a.pt at n_slot 128 on other tokens (no n_slot=0 evaluation of them), and
    b.pt, which has no n_slot=0 evaluation."""
    sweep = tmp_path / "sweep"
    _eval_job(sweep, "0", "a.pt", 32, WITH)
    _eval_job(sweep, "1", "a.pt", 0, WITHOUT)
    _eval_job(sweep, "2", "a.pt", 128, WITH, tokens=50)
    _eval_job(sweep, "3", "b.pt", 32, WITH)
    files = write_report(sweep)
    with open(files["cache_effect.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["n_slot"], r["analysis"], r["reference"]) for r in rows] == [
        ("0", "32", "symbol", "1"),
        ("0", "32", "ngram", "1"),
    ]
    for r in rows:
        assert float(r["total"]) == pytest.approx(-0.05)
        assert float(r["diff_128-511"]) == pytest.approx(-0.5)
        assert float(r["share_128-511"]) == pytest.approx(0.1)
        assert float(r["contrib_128-511"]) == pytest.approx(-0.05)
        assert [float(r[f"diff_{b}"]) for b in BUCKETS[:3]] == [0.0, 0.0, 0.0]
        assert r["diff_512-2047"] == r["contrib_512-2047"] == ""
        assert sum(float(r[f"contrib_{b}"] or 0) for b in BUCKETS) == pytest.approx(float(r["total"]))
    md = files["report.md"].read_text()
    assert "## What the cache contributes, same weights (`cache_effect.csv`)" in md
    assert "| 0 | 32 | symbol | -0.0500 | +0.0000 | +0.0000 | +0.0000 | -0.5000 |  |  |  |" in md
    assert "| share of tokens | | symbol | | 10.0% | 60.0% | 20.0% | 10.0% | 0.0% | 0.0% | 0.0% |" in md
    assert_png(files["cache_effect_wt2.png"])


def test_a_report_without_an_empty_cache_evaluation_has_no_cache_effect(tmp_path):
    sweep = tmp_path / "sweep"
    _eval_job(sweep, "0", "a.pt", 32, WITH)
    _eval_job(sweep, "1", "a.pt", 128, WITHOUT)
    files = write_report(sweep, plots=False)
    assert "cache_effect.csv" not in files
    assert "What the cache contributes" not in files["report.md"].read_text()


def test_the_contributions_of_real_evaluations_add_up_to_their_loss_change(tmp_path):
    """A tiny CRTN trained for a few steps, then crtn-eval's sweep over eval.n_slot=0,4,16 on the
    test split, as the module docstring gives it: per analysis the contributions add up to the
    difference of the two evaluations' mean losses, read from their eval.json files."""
    run = tmp_path / "run"
    train_in(compose_train([*TINY_RUN, "train.max_step=4", "train.eval_interval=4"]), run)  # in this process
    sweep = tmp_path / "ext"
    ev = [
        "-m",
        f"checkpoint={run}/checkpoints/best.pt",
        "eval.n_slot=0,4,16",
        "splits=[test]",
        "progress=false",
    ]
    done = cli("crtn.eval_app", [*ev, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    losses = {}
    for d in sweep.iterdir():
        if (d / "eval.json").is_file():
            test = json.loads((d / "eval.json").read_text())["test"]
            losses[test["n_slot"]] = test["loss"]
    assert sorted(losses) == [0, 4, 16]
    files = write_report(sweep, plots=False)
    with open(files["cache_effect.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted({int(r["n_slot"]) for r in rows}) == [4, 16] and len(rows) == 4
    for r in rows:
        total = losses[int(r["n_slot"])] - losses[0]
        assert float(r["total"]) == pytest.approx(total, abs=1e-12)
        assert sum(float(r[f"contrib_{b}"] or 0) for b in BUCKETS) == pytest.approx(total, abs=1e-6)
        assert sum(float(r[f"share_{b}"] or 0) for b in BUCKETS) == pytest.approx(1.0)
