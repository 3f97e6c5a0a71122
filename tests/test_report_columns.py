"""``crtn-report``'s columns of what evaluation measures beyond the loss: MQAR's answers (accuracy,
perplexity, chance, where the stored pair lay) in ``report.csv`` and ``cache_extension.csv``, and
each retrieving layer's retrieval statistics (``<key>_r<i>``) in ``cache_extension.csv``. The job
files are written by hand; every cell is checked against the number written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from crtn.report import load_jobs, train_table, write_report
from crtn.report.tables import TRAIN_HEAD, eval_table
from tests.test_report import _write_job, make_sweep, num, read_csv

CKPT = "/runs/mqar/checkpoints/best.pt"
DONE = {"state": "done", "time": 1.7e9, "pid": 1, "host": "elsewhere"}
ANSWER_COLS = ["answers_acc", "answers_ppl", "answers_chance_acc"]
PAIR_COLS = ["pair_in_memory", "pair_in_cache", "pair_retrieved", "pair_retrieved_any_layer"]
EVAL_HEAD = ["job", "status", "checkpoint", "step", "n_slot", "top_k", "tgt_len", "mem_len", "range_tokens"]
TRAIN_TAIL = ["tokens_per_s", "train_time_s", "note", "overrides"]
EVAL_TAIL = ["tokens_per_s", "note", "overrides"]


def _answers(acc: float, loss: float, where: dict[str, float]) -> dict:
    """An MQAR evaluation's ``answers`` dict (as :meth:`crtn.data.mqar.AnswerSums.metrics` writes
    it), 16 values (chance 1/16), with the fractions ``where`` (``pair_*``)."""
    by_gap = {"1024-2047": {"tokens": 320, "loss": loss, "acc": acc}, "2048-4095": {"tokens": 0}}
    entry = {"tokens": 640, "loss": loss, "ppl": math.exp(loss), "acc": acc, "chance_acc": 0.0625}
    return {**entry, "chance_loss": math.log(16), "cut": 3, "by_gap": by_gap, **where}


def _mqar_eval(answers: dict, retrieval: dict | None = None) -> dict:
    ev = {"split": "test", "loss": 2.5, "ppl": math.exp(2.5), "tokens": 4096, "acc": 0.25}
    ev.update(answers=answers, n_slot=16, top_k=2, tgt_len=4, mem_len=8, tokens_per_s=1000.0)
    return ev if retrieval is None else {**ev, "retrieval": retrieval}


def _mqar_config(model: str) -> dict:
    return {
        "model": {"name": model, "tgt_len": 4, "mem_len": 8},
        "data": {"name": "mqar"},
        "query": {"strategy": "gate"},
        "summary": {"name": "last_state"},
        "cache": {"n_slot": 16, "top_k": 2},
    }


#: three MQAR training jobs: model, test answers' accuracy and loss, where their pairs lay (job 0
#: selects inside attention: several retrieving layers, ``pair_retrieved_any_layer``)
TRAINED = {
    "0": (
        "crtn",
        0.625,
        1.5,
        dict(pair_in_memory=0.125, pair_in_cache=0.5, pair_retrieved=0.375, pair_retrieved_any_layer=0.4375),
    ),
    "1": ("crtn", 0.75, 1.25, dict(pair_in_memory=0.25, pair_in_cache=0.5, pair_retrieved=0.125)),
    "2": ("txl", 0.0625, 2.75, {"pair_in_memory": 0.0625}),
}


def _mqar_train_sweep(root: Path, names: tuple[str, ...] = tuple(TRAINED)) -> None:
    for name in names:
        model, acc, loss, where = TRAINED[name]
        test = _mqar_eval(_answers(acc, loss, where))
        res = {"model": model, "data": "mqar", "metric": "ppl", "valid": test, "test": test}
        res.update(tokens_per_s=900.0, train_time_s=60.0)
        _write_job(root / name, [f"model={model}"], _mqar_config(model), DONE, res)


def test_mqar_answers_in_report_csv(tmp_path):
    """report.csv of MQAR training jobs: test_answers_acc, _ppl, _chance_acc and the pair
    fractions any job has (pair_retrieved_any_layer: job 0 only; pair_in_cache and
    pair_retrieved: the crtn jobs), as written; a failed job's cells are empty."""
    sweep = tmp_path / "sweep"
    _mqar_train_sweep(sweep)
    _write_job(sweep / "3", ["model=crtn"], _mqar_config("crtn"), {"state": "failed", "error": "boom"})
    files = write_report(sweep, plots=False)
    rows = {r["job"]: r for r in read_csv(files["report.csv"])}
    new = [f"test_{c}" for c in ANSWER_COLS + PAIR_COLS]
    assert list(rows["0"]) == TRAIN_HEAD + ["valid_ppl", "test_ppl", *new] + TRAIN_TAIL
    want = {  # job: answers acc, ppl, chance, pair in memory, in cache, retrieved, by any layer
        "0": (0.625, math.exp(1.5), 0.0625, 0.125, 0.5, 0.375, 0.4375),
        "1": (0.75, math.exp(1.25), 0.0625, 0.25, 0.5, 0.125, None),
        "2": (0.0625, math.exp(2.75), 0.0625, 0.0625, None, None, None),
        "3": (None,) * 7,
    }
    assert {name: tuple(num(r[c]) for c in new) for name, r in rows.items()} == want
    md = files["report.md"].read_text()
    assert "| test answers acc | test answers ppl | test answers chance acc |" in md
    assert "| 0.625 | 4.48 | 0.062 | 0.125 | 0.500 | 0.375 | 0.438 |" in md  # job 0, rounded


def test_mqar_columns_only_what_a_job_has(tmp_path):
    """Without a job that measured by any layer, no test_pair_retrieved_any_layer; with only a
    Transformer-XL (no cache), only test_pair_in_memory of the pair columns."""
    _mqar_train_sweep(tmp_path / "a", ("1", "2"))
    _mqar_train_sweep(tmp_path / "b", ("2",))
    cols_a, _ = train_table(load_jobs(tmp_path / "a"))
    cols_b, rows_b = train_table(load_jobs(tmp_path / "b"))
    answers = [f"test_{c}" for c in ANSWER_COLS]
    assert [c for c in cols_a if c.startswith("test_")] == ["test_ppl", *answers] + [
        "test_pair_in_memory",
        "test_pair_in_cache",
        "test_pair_retrieved",
    ]
    assert [c for c in cols_b if c.startswith("test_")] == ["test_ppl", *answers, "test_pair_in_memory"]
    assert rows_b[0]["test_pair_in_memory"] == 0.0625


def _eval_job(d: Path, n_slot: int, test: dict | None) -> None:
    (d / ".hydra").mkdir(parents=True)
    config = {"checkpoint": CKPT, "eval": {"n_slot": n_slot}}
    (d / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
    (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"eval.n_slot={n_slot}"]))
    (d / "status.json").write_text(json.dumps(DONE))
    if test is not None:
        (d / "eval.json").write_text(
            json.dumps({"checkpoint": CKPT, "step": 500, "test": {**test, "n_slot": n_slot}})
        )


def _layer(mass: float, distance: float) -> dict:
    return {
        "distance_hist": [0, 3, 1],
        "seg_len": 4,
        "mean_distance_tokens": distance,
        "alpha_mass_mean": mass,
    }


def test_eval_sweep_gives_each_retrieving_layer_and_the_mqar_answers(tmp_path):
    """cache_extension.csv of a crtn-eval sweep: a job with one retrieving layer (no
    ``retrieval.layers``), one with two and one with three: ``<key>_r1``..``_r3`` for both
    RETRIEVAL_COLS keys, bottom first, empty where a job has fewer layers; the top-level columns
    stay the top layer's. The answers' columns without ``test_``, after the split they come from."""
    sweep = tmp_path / "eval"
    top = _layer(0.875, 40.0)
    one = _mqar_eval(
        _answers(0.5, 2.0, {"pair_in_memory": 0.25, "pair_in_cache": 0.5, "pair_retrieved": 0.25}), top
    )
    where = {
        "pair_in_memory": 0.25,
        "pair_in_cache": 0.75,
        "pair_retrieved": 0.5,
        "pair_retrieved_any_layer": 0.625,
    }
    layers2 = {**top, "layers": [_layer(0.5, 8.0), top]}
    layers3 = {**top, "layers": [_layer(0.25, 4.0), _layer(0.5, 12.0), top]}
    _eval_job(sweep / "0", 8, one)
    _eval_job(sweep / "1", 16, _mqar_eval(_answers(0.75, 1.0, where), layers2))
    _eval_job(sweep / "2", 32, _mqar_eval(_answers(0.875, 0.5, where), layers3))
    _eval_job(sweep / "3", 64, None)  # no eval.json: empty cells
    files = write_report(sweep, plots=False)
    rows = read_csv(files["cache_extension.csv"])
    layer_cols = [f"{k}_r{i}" for k in ("alpha_mass_mean", "mean_distance_tokens") for i in (1, 2, 3)]
    extra = ["split", *ANSWER_COLS, *PAIR_COLS, "alpha_mass_mean", "mean_distance_tokens", *layer_cols]
    assert list(rows[0]) == EVAL_HEAD + ["test_ppl", *extra] + EVAL_TAIL
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert [r["split"] for r in rows] == ["test", "test", "test", ""]
    assert [tuple(num(r[c]) for c in layer_cols) for r in rows] == [
        (None,) * 6,
        (0.5, 0.875, None, 8.0, 40.0, None),
        (0.25, 0.5, 0.875, 4.0, 12.0, 40.0),
        (None,) * 6,
    ]
    assert [(num(r["alpha_mass_mean"]), num(r["mean_distance_tokens"])) for r in rows[:3]] == [
        (0.875, 40.0)
    ] * 3
    answers = [tuple(num(r[c]) for c in ANSWER_COLS + PAIR_COLS) for r in rows]
    assert answers == [
        (0.5, math.exp(2.0), 0.0625, 0.25, 0.5, 0.25, None),
        (0.75, math.exp(1.0), 0.0625, 0.25, 0.75, 0.5, 0.625),
        (0.875, math.exp(0.5), 0.0625, 0.25, 0.75, 0.5, 0.625),
        (None,) * 7,
    ]
    md = files["report.md"].read_text()
    assert "| alpha_mass_mean_r1 | alpha_mass_mean_r2 | alpha_mass_mean_r3 | mean_distance_tokens_r1 |" in md
    assert "`<key>_r<i>`: retrieving layer i's, bottom first" in md


def test_sweeps_without_mqar_or_layers_get_none_of_the_new_columns(tmp_path):
    """The passage-recall training sweep keeps its columns, and an eval sweep whose retrieval has
    no ``layers`` gets the top-level retrieval columns only."""
    make_sweep(tmp_path / "sweep")
    cols, _ = train_table(load_jobs(tmp_path / "sweep"))
    recall = ["test_repeat_ppl", "test_repeat_acc", "test_fresh_ppl", "test_fresh_acc"]
    source = ["test_repeat_source_in_memory", "test_repeat_source_in_cache", "test_repeat_source_retrieved"]
    assert cols == TRAIN_HEAD + ["valid_ppl", "test_ppl", *recall, *source] + TRAIN_TAIL
    ev = {"split": "test", "loss": 3.0, "ppl": math.exp(3.0), "tokens": 100, "tokens_per_s": 50.0}
    _eval_job(tmp_path / "eval" / "0", 8, {**ev, "retrieval": _layer(0.75, 20.0)})
    _eval_job(tmp_path / "eval" / "1", 16, ev)
    cols, rows = eval_table(load_jobs(tmp_path / "eval"))
    assert cols == EVAL_HEAD + ["test_ppl", "alpha_mass_mean", "mean_distance_tokens"] + EVAL_TAIL
    assert [(r["alpha_mass_mean"], r["mean_distance_tokens"]) for r in rows] == [(0.75, 20.0), (None, None)]
    assert "_r<i>" not in write_report(tmp_path / "eval", plots=False)["report.md"].read_text()
