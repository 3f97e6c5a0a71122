"""crtn-report: tables and plots of a sweep, checked against the job files.

Fabricated job directories (files written by hand, numbers known) check every value of
``report.csv``; tiny real sweeps through the real entry points (``python -m crtn.train -m``,
``python -m crtn.eval_app -m``, ``python -m crtn.report``) check that the report reads what
crtn-train and crtn-eval actually write, including a job that fails.
"""

from __future__ import annotations

import csv
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from crtn.errors import UserError
from crtn.report import load_jobs, main, write_report
from crtn.report.plots import distance_series, plot_distance_hist
from tests.helpers import TINY_RUN, cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

TINY = [
    *TINY_RUN,
    "data.synthetic.repeat_skip=1",  # passages of 4 tokens: measure repeats from the 2nd token
    "train.max_step=6",
    "train.eval_interval=3",
    "train.log_interval=3",
]


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(cell: str) -> float | int | None:
    """A CSV cell back to the number it was written from (exactly: floats are written with repr)."""
    if cell == "":
        return None
    return int(cell) if cell.lstrip("-").isdigit() else float(cell)


def assert_png(path: Path, min_bytes: int = 15_000) -> None:
    """A real, non-trivial PNG that matplotlib can read back."""
    from matplotlib.image import imread

    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > min_bytes, (path, len(data))
    img = imread(path)
    assert img.shape[0] >= 250 and img.shape[1] >= 700, (path, img.shape)
    assert img[..., :3].std() > 0.05, f"{path} is (nearly) blank"


# ----------------------------------------------------------------------------- fabricated sweep


def _config(model: str, query: str, n_slot: int, max_step: int = 1200) -> dict:
    return {
        "model": {"name": model, "tgt_len": 64, "mem_len": 64, "n_layer": 4},
        "data": {"name": "synthetic", "level": "word"},
        "query": {"strategy": query},
        "summary": {"name": "last_state"},
        "cache": {"n_slot": n_slot, "top_k": 2},
        "train": {"max_step": max_step, "eval_interval": 100},
    }


def _evaluation(split: str, ppl: float, model: str, scale: float) -> dict:
    ev = {
        "split": split,
        "loss": math.log(ppl),
        "ppl": ppl,
        "tokens": 65536,
        "segments": 102,
        "time_s": 12.5 * scale,
        "tokens_per_s": 5242.88 / scale,
        "tgt_len": 64,
        "mem_len": 64,
        "repeat": {
            "tokens": 12000,
            "loss": 0.5 * scale,
            "ppl": 1.6487 * scale,
            "acc": 0.91 / scale,
            "source_ppl": 5.3,
            "source_in_memory": 0.125,
            "source_in_cache": 0.75 if model == "crtn" else 0.0,
            "source_retrieved": 0.5 / scale if model == "crtn" else 0.0,
        },
        "fresh": {"tokens": 40000, "loss": 1.8, "ppl": 6.05 * scale, "acc": 0.41, "source_ppl": 5.1},
        "freq_buckets": {
            "<100": {"tokens": 800, "ppl": 310.5 * scale},
            "100-1K": {"tokens": 9000, "ppl": 61.25 * scale},
            "1K-10K": {"tokens": 55736, "ppl": 8.125 * scale},
            ">10K": {"tokens": 0, "ppl": None},
        },
    }
    if model == "crtn":
        ev.update(
            n_slot=16,
            top_k=2,
            retrieval={
                "distance_hist": [0, 0, 900, 700, 520, 400, int(300 * scale), 260, 240, 180],
                "seg_len": 64,
                "mean_distance_tokens": 301.7,
            },
        )
    return ev


def _metrics(n_eval: int, start: float, end: float, minutes: float) -> list[dict]:
    recs = []
    for i in range(1, n_eval + 1):
        step = 100 * i
        frac = i / n_eval
        ppl = end + (start - end) * math.exp(-4 * frac)
        t = minutes * 60 * frac
        train = {"step": step, "epoch": 0, "lr": 2.5e-4, "train_loss": math.log(ppl * 1.1)}
        train.update(train_ppl=ppl * 1.1, tokens_per_s=4000.0, elapsed=t - 5)
        valid = {"step": step, "valid_loss": math.log(ppl), "valid_ppl": ppl, "elapsed": t}
        valid.update(valid_repeat_ppl=ppl / 5, valid_repeat_acc=0.5, valid_fresh_ppl=ppl, valid_fresh_acc=0.3)
        recs += [train, valid]
    return recs


def _write_job(
    d: Path, overrides: list[str], config: dict, status: dict | None = None, results=None, metrics=()
):
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if status is not None:
        (d / "status.json").write_text(json.dumps(status))
    if results is not None:
        (d / "results.json").write_text(json.dumps(results, indent=2))
    if metrics:
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))


def make_sweep(root: Path) -> dict[str, dict]:
    """A sweep of four jobs: txl done, crtn done, crtn failed, crtn running. Returns results by job."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "multirun.yaml").write_text("hydra: {}\n")
    done = {"state": "done", "time": 1.7e9, "pid": 1, "host": "elsewhere"}
    results = {}
    for num_, model, query, test_ppl, scale in (
        ("0", "txl", "token", 38.123456789, 1.5),
        ("1", "crtn", "last_l", 29.87654321, 1.0),
    ):
        res = {
            "model": model,
            "data": "synthetic",
            "metric": "ppl",
            "query": query if model == "crtn" else None,
            "summary": "identity" if model == "crtn" else None,
            "n_slot": 16 if model == "crtn" else None,
            "top_k": 2 if model == "crtn" else None,
            "tgt_len": 64,
            "mem_len": 64,
            "params": 3_301_234 if model == "crtn" else 3_280_000,
            "steps": 1200,
            "epochs": 1,
            "tokens_seen": 1228800,
            "train_time_s": 1834.25 * scale,
            "tokens_per_s": 669.9123 / scale,
            "stopped_by": "train.max_step",
            "valid": _evaluation("valid", test_ppl * 1.02, model, scale),
            "test": _evaluation("test", test_ppl, model, scale),
        }
        results[num_] = res
        ov = [f"model={model}", "train.max_step=1200"] + ([f"query={query}"] if model == "crtn" else [])
        _write_job(
            root / num_,
            ov,
            _config(model, query, 16),
            done,
            res,
            _metrics(12, 140 * scale, 28 * scale, 31 * scale),
        )
    _write_job(
        root / "2",
        ["model=crtn", "train.max_step=1200", "query=token", "cache.n_slot=-1"],
        _config("crtn", "token", -1),
        {
            "state": "failed",
            "time": 1.7e9,
            "pid": 2,
            "host": "elsewhere",
            "error": "ConfigError: cache.n_slot=-1 and cache.top_k=2 must be >= 0",
        },
    )
    _write_job(
        root / "3",
        ["model=crtn", "train.max_step=1200", "query=linear"],
        _config("crtn", "linear", 16),
        {"state": "running", "time": 1.7e9, "pid": os.getpid(), "host": socket.gethostname()},
        metrics=_metrics(3, 150, 40, 8),
    )
    return results


def test_fabricated_sweep_every_value_matches_the_job_files(tmp_path, capsys):
    sweep = tmp_path / "sweep"
    results = make_sweep(sweep)
    files = write_report(sweep)
    names = {p.name for p in files.values()}
    expected_pngs = {
        "valid_curves.png",
        "test_bars.png",
        "distance_hist.png",
        "freq_buckets.png",
        "recall.png",
    }
    assert names == {"report.md", "report.csv"} | expected_pngs
    for name in expected_pngs:
        assert_png(sweep / name)

    rows = read_csv(sweep / "report.csv")
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    for r in rows[:2]:
        res = results[r["job"]]
        assert r["status"] == "done" and r["note"] == ""
        for key in ("model", "data", "query", "summary"):
            assert r[key] == (res[key] or ""), key
        for key in (
            "n_slot",
            "top_k",
            "tgt_len",
            "mem_len",
            "params",
            "steps",
            "tokens_per_s",
            "train_time_s",
        ):
            assert num(r[key]) == res[key], key
        for split in ("valid", "test"):
            assert num(r[f"{split}_ppl"]) == res[split]["ppl"]
        for kind in ("repeat", "fresh"):
            for key in ("ppl", "acc"):
                assert num(r[f"test_{kind}_{key}"]) == res["test"][kind][key]
        for key in ("source_in_memory", "source_in_cache", "source_retrieved"):
            assert num(r[f"test_repeat_{key}"]) == res["test"]["repeat"][key]
    assert rows[0]["overrides"] == "model=txl train.max_step=1200"
    assert rows[1]["overrides"] == "model=crtn train.max_step=1200 query=last_l"

    failed, running = rows[2], rows[3]
    assert failed["status"] == "failed"
    assert "cache.n_slot=-1 and cache.top_k=2 must be >= 0" in failed["note"]
    assert (failed["model"], failed["query"], failed["n_slot"]) == ("crtn", "token", "-1")
    assert failed["test_ppl"] == failed["valid_ppl"] == failed["params"] == ""
    assert running["status"] == "running" and running["steps"] == "300"
    assert "step 300/1200" in running["note"] and "last valid ppl" in running["note"]
    assert running["query"] == "linear" and running["test_ppl"] == ""

    md = (sweep / "report.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ")]
    assert len(table) == 5  # header + 4 jobs
    assert "| 2 | failed |" in md and "| 3 | running |" in md and "| 1 | done |" in md
    assert "29.88" in md and "38.12" in md  # rounded in Markdown, exact in CSV
    assert "query=last_l" in md and "train.max_step=1200" in md  # varying vs common overrides
    for name in expected_pngs:
        assert f"![{name}]({name})" in md

    main([str(sweep), "plots=false"])
    out = capsys.readouterr().out
    assert "| 0 | done | txl |" in out and "must be >= 0" in out
    assert f"{sweep / 'report.csv'}" in out and ".png" not in out


def test_unreadable_files_are_listed_not_fatal(tmp_path):
    sweep = tmp_path / "sweep"
    make_sweep(sweep)
    (sweep / "0" / "results.json").write_text('{"model": "txl", "valid": {')  # cut short
    (sweep / "1" / "status.json").write_text("not json")
    with (sweep / "3" / "metrics.jsonl").open("a") as f:  # wrong types, then a line cut short
        f.write('{"step": "x", "valid_ppl": "bad", "elapsed": null}\n{"step": 400, "valid_')
    (sweep / "4" / ".hydra").mkdir(parents=True)
    (sweep / "4" / ".hydra" / "config.yaml").write_text("model: [unclosed\n")
    write_report(sweep)
    rows = {r["job"]: r for r in read_csv(sweep / "report.csv")}
    assert rows["0"]["status"] == "unreadable: results.json" and rows["0"]["test_ppl"] == ""
    assert rows["1"]["status"] == "unreadable: status.json" and rows["1"]["test_ppl"] != ""
    assert rows["3"]["status"] == "running" and "1 unreadable line" in rows["3"]["note"]
    assert rows["4"]["status"] == "unreadable: .hydra/config.yaml"
    assert_png(sweep / "valid_curves.png")
    assert_png(sweep / "test_bars.png")


def test_running_job_whose_process_is_gone_is_marked_died(tmp_path):
    sweep = tmp_path / "sweep"
    make_sweep(sweep)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    status = {"state": "running", "time": 1.7e9, "pid": gone.pid, "host": socket.gethostname()}
    (sweep / "3" / "status.json").write_text(json.dumps(status))
    job = {j.name: j for j in load_jobs(sweep)}["3"]
    assert job.status == "died" and f"pid {gone.pid}" in job.note and "hydra.run.dir=" in job.note


def test_single_run_dir_and_several_sweeps_in_one_report(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_sweep(a)
    make_sweep(b)
    files = write_report(a / "1", plots=False)  # one run directory (crtn-train without -m)
    assert [r["job"] for r in read_csv(files["report.csv"])] == ["1"]
    out = tmp_path / "cmp"
    main([str(a), str(b), f"out={out}", "plots=false"])
    jobs = [r["job"] for r in read_csv(out / "report.csv")]
    assert jobs == ["a/0", "a/1", "a/2", "a/3", "b/0", "b/1", "b/2", "b/3"]
    main([str(a), str(b), "plots=false"])  # without out=: a report into each
    assert (a / "report.md").is_file() and (b / "report.md").is_file()


def test_fabricated_eval_sweep_with_failed_and_incomplete_jobs(tmp_path):
    sweep = tmp_path / "eval"
    ckpt = "/runs/a/checkpoints/best.pt"
    for i, (n, ppl) in enumerate([(32, 27.5), (8, 30.25), (16, 28.125), (64, None), (128, None)]):
        d = sweep / str(i)
        (d / ".hydra").mkdir(parents=True)
        (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump({"checkpoint": ckpt, "eval": {"n_slot": n}}))
        (d / ".hydra" / "overrides.yaml").write_text(
            yaml.safe_dump([f"checkpoint={ckpt}", f"eval.n_slot={n}"])
        )
        if ppl is not None:
            ev = {"split": "test", "loss": math.log(ppl), "ppl": ppl, "tokens": 100, "tokens_per_s": 50.0}
            ev.update(n_slot=n, top_k=2, tgt_len=64, mem_len=64)
            (d / "eval.json").write_text(json.dumps({"checkpoint": ckpt, "step": 1200, "test": ev}))
    (sweep / "3" / "eval.log").write_text(
        "[2026-01-01 10:00:00,000][__main__][INFO] - loading\n"
        "[2026-01-01 10:00:01,000][crtn-eval][ERROR] - cache.n_slot: out of memory for 64 slots\n"
    )
    files = write_report(sweep)
    assert "report.csv" not in files and "cache_extension.png" in files
    assert_png(files["cache_extension.png"])
    rows = read_csv(files["cache_extension.csv"])
    assert [(r["n_slot"], r["status"]) for r in rows] == [
        ("8", "done"),
        ("16", "done"),
        ("32", "done"),
        ("64", "failed"),
        ("128", "incomplete"),
    ]
    assert [num(r["test_ppl"]) for r in rows] == [30.25, 28.125, 27.5, None, None]
    assert [num(r["range_tokens"]) for r in rows[:3]] == [64 + 8 * 64, 64 + 16 * 64, 64 + 32 * 64]
    assert rows[3]["note"] == "cache.n_slot: out of memory for 64 slots"
    assert "no eval.json" in rows[4]["note"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["{tmp}/missing"], "does not exist"),
        (["{tmp}/empty"], "has no job directories"),
        (["{tmp}/file.txt"], "is not a directory"),
        (["{tmp}/empty", "colour=red"], "bad option"),
        (["{tmp}/empty", "plots=maybe"], "bad option"),
        ([], "no directory given"),
    ],
)
def test_bad_input_is_one_line_error(tmp_path, capsys, args, needle):
    (tmp_path / "empty" / "notajob").mkdir(parents=True)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(SystemExit) as e:
        main([a.format(tmp=tmp_path) for a in args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("crtn-report: error: ") and needle in err and err.count("\n") == 1, err
    with pytest.raises(UserError):
        load_jobs(tmp_path / "empty")


# ----------------------------------------------------------------------------- real sweeps


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory) -> Path:
    """``crtn-train -m query=token,last_l`` on a tiny model (about 5 s)."""
    base = tmp_path_factory.mktemp("real")
    sweep = base / "sweep"
    p = cli("crtn.train", ["-m", "query=token,last_l", *TINY, f"hydra.sweep.dir={sweep}"], base)
    assert p.returncode == 0, p.stderr[-3000:]
    return sweep


def test_report_of_a_real_multirun(real_sweep):
    p = cli("crtn.report", [str(real_sweep)], real_sweep.parent)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    rows = read_csv(real_sweep / "report.csv")
    assert [(r["job"], r["status"], r["query"]) for r in rows] == [
        ("0", "done", "token"),
        ("1", "done", "last_l"),
    ]
    for r in rows:
        res = json.loads((real_sweep / r["job"] / "results.json").read_text())
        assert num(r["test_ppl"]) == res["test"]["ppl"] and num(r["valid_ppl"]) == res["valid"]["ppl"]
        assert num(r["test_repeat_acc"]) == res["test"]["repeat"]["acc"]
        for key in (
            "source_in_memory",
            "source_in_cache",
            "source_retrieved",
            "copy_retrieved",
        ):  # when there
            if key in res["test"]["repeat"]:
                assert num(r[f"test_repeat_{key}"]) == res["test"]["repeat"][key]
        assert num(r["params"]) == res["params"] and num(r["tokens_per_s"]) == res["tokens_per_s"]
        assert r["summary"] == res["summary"] and r["overrides"].startswith(f"query={r['query']} ")
        assert f"| {r['job']} | done | crtn | synthetic | {r['query']} |" in p.stdout
    assert not (
        real_sweep / "freq_buckets.png"
    ).exists()  # no word-frequency analysis of the synthetic corpus
    for name in ("valid_curves.png", "test_bars.png", "distance_hist.png", "recall.png"):
        assert_png(real_sweep / name)
        assert str(real_sweep / name) in p.stdout
    assert not (real_sweep / "cache_extension.png").exists()


def test_eval_sweep_gives_the_cache_extension_table(real_sweep, tmp_path):
    ckpt = real_sweep / "0" / "checkpoints" / "best.pt"
    sweep = tmp_path / "eval"
    args = ["-m", f"checkpoint={ckpt}", "eval.n_slot=8,2,4", "splits=[test]", "progress=false"]
    p = cli("crtn.eval_app", [*args, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    p = cli("crtn.report", [str(sweep)], tmp_path)
    assert p.returncode == 0, p.stderr
    rows = read_csv(sweep / "cache_extension.csv")
    assert [num(r["n_slot"]) for r in rows] == [2, 4, 8]  # sorted by n_slot, not by job number
    assert [r["job"] for r in rows] == ["1", "2", "0"]
    for r in rows:
        ev = json.loads((sweep / r["job"] / "eval.json").read_text())
        assert num(r["test_ppl"]) == ev["test"]["ppl"] and r["checkpoint"] == str(ckpt)
        assert num(r["range_tokens"]) == 8 + 8 * num(r["n_slot"])
    md = (sweep / "report.md").read_text()
    assert "cache extension" in md and md.count("| done | ") == 3
    assert_png(sweep / "cache_extension.png")
    assert not (sweep / "report.csv").exists()  # no training jobs in an eval sweep


def test_sweep_with_a_failing_job(tmp_path):
    sweep = tmp_path / "sweep"
    tiny = [a for a in TINY if not a.startswith("cache.n_slot=")]
    p = cli("crtn.train", ["-m", "cache.n_slot=4,-1", *tiny, f"hydra.sweep.dir={sweep}"], tmp_path)
    assert p.returncode != 0  # the sweep reports the failed job (exit status 1 or 2)
    assert "cache.n_slot=-1" in p.stderr
    p = cli("crtn.report", [str(sweep)], tmp_path)
    assert p.returncode == 0, p.stderr
    rows = read_csv(sweep / "report.csv")
    assert [(r["job"], r["status"]) for r in rows] == [("0", "done"), ("1", "failed")]
    assert "cache.n_slot=-1" in rows[1]["note"] and num(rows[1]["n_slot"]) == -1
    assert "| 1 | failed |" in p.stdout and "cache.n_slot=-1" in p.stdout


def test_cli_bad_path_prints_no_traceback(tmp_path):
    p = cli("crtn.report", [str(tmp_path / "nope")], tmp_path)
    assert p.returncode == 2
    assert p.stderr.startswith("crtn-report: error: ") and p.stderr.count("\n") == 1 and p.stdout == ""


def _finished(d: Path, overrides: list[str], model: str, valid: float, test: float | None) -> None:
    """A finished training job with the given valid and test perplexities (test None: none)."""
    results = {"model": model, "metric": "ppl", "valid": {"loss": math.log(valid), "ppl": valid}}
    if test is not None:
        results["test"] = {"loss": math.log(test), "ppl": test}
    _write_job(d, overrides, _config(model, "token", 8), status={"state": "done"}, results=results)


def test_best_of_each_search_picks_the_lowest_validation_per_configuration(tmp_path):
    """Jobs that differ only in optim.lr form one search; its best job is the one with the lowest
    validation loss (made by hand below), and a lone job is not a search."""
    sweep = tmp_path / "sweep"
    grid = {  # (model, lr) -> valid ppl, test ppl
        ("txl", "5e-4"): (30.0, 29.0),
        ("txl", "1e-3"): (20.0, 19.5),
        ("txl", "2e-3"): (25.0, 24.0),
        ("crtn", "5e-4"): (18.0, 17.0),
        ("crtn", "1e-3"): (22.0, 21.0),
    }
    for i, ((model, lr), (valid, test)) in enumerate(grid.items()):
        _finished(sweep / str(i), [f"model={model}", f"optim.lr={lr}"], model, valid, test)
    _finished(sweep / "9", ["model=vanilla", "optim.lr=1e-3"], "vanilla", 2.7, None)
    files = write_report(sweep, plots=False)
    rows = list(csv.DictReader(open(files["search.csv"])))
    best = {r["search"]: (r["optim.lr"], float(r["valid"]), float(r["test"]), r["jobs"]) for r in rows}
    assert best == {"model=txl": ("1e-3", 20.0, 19.5, "3"), "model=crtn": ("5e-4", 18.0, 17.0, "2")}
    assert "Best of each search" in files["report.md"].read_text()
    assert "seeds.csv" not in files  # no job was given a seed


def test_a_run_at_the_default_seed_joins_the_seeds_given_later(tmp_path):
    """A first run that named no seed (its config holds the default, 1111) and a later one with
    seed=2 form one configuration: mean (510 + 520) / 2 = 515, std sqrt(2 * 5^2) = 5 * sqrt(2).
    Two runs of one configuration with the same seed are no seed spread and form no group."""
    sweep = tmp_path / "sweep"
    for i, (overrides, seed, test) in enumerate(
        [(["model=txl"], 1111, 510.0), (["model=txl", "seed=2"], 2, 520.0)]
        + [(["model=crtn", "seed=5"], 5, 500.0), (["model=crtn"], 5, 502.0)]
    ):
        config = {**_config(overrides[0].split("=")[1], "token", 8), "seed": seed}
        results = {"model": "m", "metric": "ppl", "valid": {"loss": 6.0, "ppl": 400.0}}
        results["test"] = {"loss": math.log(test), "ppl": test}
        _write_job(sweep / str(i), overrides, config, status={"state": "done"}, results=results)
    rows = list(csv.DictReader(open(write_report(sweep, plots=False)["seeds.csv"])))
    assert [r["configuration"] for r in rows] == ["model=txl"]
    assert float(rows[0]["test_mean"]) == pytest.approx(515.0)
    assert float(rows[0]["test_std"]) == pytest.approx(5 * math.sqrt(2))
    assert rows[0]["test_by_seed"] == "1111: 510, 2: 520"


def test_across_seeds_gives_mean_and_sample_deviation_per_configuration(tmp_path):
    """Jobs that differ only in seed form one configuration. Hand-computed: txl test 510, 503, 520
    -> mean 511, sample std sqrt((1 + 64 + 81) / 2) = sqrt(73); crtn 492, 515 -> mean 503.5,
    std sqrt(2 * 11.5^2) = 11.5 * sqrt(2). A lone seed and a failed job form no group."""
    sweep = tmp_path / "sweep"
    runs = [  # model, seed, valid ppl, test ppl
        ("txl", 1111, 545.0, 510.0),
        ("crtn", 1111, 525.0, 492.0),
        ("txl", 2, 540.0, 503.0),
        ("crtn", 2, 550.0, 515.0),
        ("txl", 3, 556.0, 520.0),
        ("vanilla", 1, 900.0, 880.0),
    ]
    for i, (model, seed, valid, test) in enumerate(runs):
        _finished(sweep / str(i), [f"model={model}", f"seed={seed}"], model, valid, test)
    _write_job(sweep / "6", ["model=crtn", "seed=3"], _config("crtn", "token", 8), status={"state": "failed"})
    files = write_report(sweep, plots=False)
    rows = {r["configuration"]: r for r in csv.DictReader(open(files["seeds.csv"]))}
    assert set(rows) == {"model=txl", "model=crtn"}
    txl, crtn = rows["model=txl"], rows["model=crtn"]
    assert (txl["seeds"], crtn["seeds"]) == ("3", "2")
    assert float(txl["test_mean"]) == pytest.approx(511.0)
    assert float(txl["test_std"]) == pytest.approx(math.sqrt(73))
    assert float(txl["valid_mean"]) == pytest.approx(547.0)
    assert float(txl["valid_std"]) == pytest.approx(math.sqrt((4 + 49 + 81) / 2))
    assert float(crtn["test_mean"]) == pytest.approx(503.5)
    assert float(crtn["test_std"]) == pytest.approx(11.5 * math.sqrt(2))
    assert txl["test_by_seed"] == "1111: 510, 2: 503, 3: 520" and txl["metric"] == "ppl"
    md = files["report.md"].read_text()
    assert "## Across seeds (`seeds.csv`)" in md and "| model=crtn | 2 |" in md


def test_distance_plot_draws_each_retrieving_layer(tmp_path):
    """A job whose evaluation reports each retrieving layer (``retrieval.layers``) gets one line
    per layer, bottom first, each with its own histogram and mean; a job without gets one line."""
    results = make_sweep(tmp_path / "sweep")
    res = results["1"]
    bottom = {"distance_hist": [0, 5, 3], "mean_distance_tokens": 70.4}
    top = {"distance_hist": [0, 0, 900, 700], "mean_distance_tokens": 301.7}
    res["test"]["retrieval"] = {**top, "seg_len": 64, "layers": [bottom, top]}
    (tmp_path / "sweep" / "1" / "results.json").write_text(json.dumps(res))
    jobs = {j.name: j for j in load_jobs(tmp_path / "sweep")}
    series = distance_series([jobs["1"]])
    assert [(name, hist, seg, m) for _, name, hist, seg, m in series] == [
        ("layer 1 of 2", [0, 5, 3], 64, 70.4),
        ("layer 2 of 2", [0, 0, 900, 700], 64, 301.7),
    ]
    assert [name for _, name, *_ in distance_series([jobs["0"], jobs["1"]])] == [
        "layer 1 of 2",
        "layer 2 of 2",
    ]
    del res["test"]["retrieval"]["layers"]
    (tmp_path / "sweep" / "1" / "results.json").write_text(json.dumps(res))
    one = distance_series(load_jobs(tmp_path / "sweep"))
    assert [(name, hist) for _, name, hist, *_ in one] == [("", [0, 0, 900, 700])]
    assert plot_distance_hist(list(jobs.values()), tmp_path / "d.png", "t", {j: "C0" for j in jobs})
    assert (tmp_path / "d.png").stat().st_size > 0
