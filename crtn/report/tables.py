"""The tables of ``crtn-report``: ``report.csv`` (training jobs), ``cache_extension.csv`` (eval
jobs) and their Markdown form."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

from crtn.config import uses_cache
from crtn.model import dependency_range
from crtn.report.jobs import Job, duration, split_override

TRAIN_HEAD = ["job", "status", "model", "data", "query", "summary", "n_slot", "top_k", "tgt_len", "mem_len"]
TRAIN_HEAD += ["params", "steps"]
RECALL_COLS = ["repeat_ppl", "repeat_acc", "fresh_ppl", "fresh_acc"]
# where the copied source of repeat tokens lay (fractions, when evaluate() measured it)
SOURCE_COLS = [
    "repeat_source_in_memory",
    "repeat_source_in_cache",
    "repeat_source_retrieved",
    "repeat_copy_retrieved",  # the source or another copy of the same text (crtn-eval)
    # the same in the slots of any retrieving layer (selection inside attention selects per layer)
    "repeat_source_retrieved_any_layer",
    "repeat_copy_retrieved_any_layer",
]
#: MQAR's answers (``answers`` of :meth:`crtn.data.mqar.AnswerSums.metrics`): their accuracy,
#: perplexity and the accuracy of a uniform guess among the values
ANSWER_COLS = ["answers_acc", "answers_ppl", "answers_chance_acc"]
#: where an MQAR answer's stored pair lay (fractions of the answers, keys of ``answers``, when
#: evaluate() measured it; ``pair_retrieved_any_layer`` with selection inside attention)
PAIR_COLS = ["pair_in_memory", "pair_in_cache", "pair_retrieved", "pair_retrieved_any_layer"]
#: what crtn-eval says of retrieval on any corpus: mean alpha mass per token, mean distance
#: (the top retrieving layer's; ``<key>_r<i>`` columns give retrieving layer i's, bottom first)
RETRIEVAL_COLS = ["alpha_mass_mean", "mean_distance_tokens"]
TEXT_COLS = ("job", "status", "model", "data", "query", "summary", "note", "overrides", "checkpoint", "split")
TEXT_COLS += ("configuration", "test_by_seed", "metric")


def train_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``report.csv`` (training jobs), values as in the job files; the test
    split's :func:`evaluation_cols` prefixed ``test_``."""
    jobs = [j for j in jobs if j.kind == "train"]
    metrics = metrics_of(jobs)
    synthetic = any(_data_name(j) == "synthetic" for j in jobs)
    extra = evaluation_cols([(j.results or {}).get("test") for j in jobs], synthetic)
    cols = list(TRAIN_HEAD)
    cols += [f"{s}_{m}" for m in metrics for s in ("valid", "test")]
    cols += [f"test_{c}" for c in extra]
    cols += ["tokens_per_s", "train_time_s", "note", "overrides"]
    rows = []
    for j in jobs:
        r = j.results or {}
        row: dict[str, Any] = {"job": j.name, "status": j.status, **_train_setting(j)}
        for split in ("valid", "test"):
            ev = r.get(split) if isinstance(r.get(split), dict) else {}
            for m in metrics:
                row[f"{split}_{m}"] = ev.get(m)
        for c, place in extra.items():
            row[f"test_{c}"] = _at(r.get("test"), place)
        row["tokens_per_s"] = r.get("tokens_per_s")
        row["train_time_s"] = r.get("train_time_s")
        row["note"] = j.note
        row["overrides"] = " ".join(j.overrides)
        rows.append({c: row.get(c) for c in cols})
    return cols, rows


def _train_setting(j: Job) -> dict[str, Any]:
    """A training job's TRAIN_HEAD settings: from ``results.json``, else from its config (what
    the job was asked to do; the steps reached from ``metrics.jsonl``)."""
    if j.results is not None:
        keys = ("model", "data", "query", "summary", "n_slot", "top_k", "tgt_len", "mem_len")
        return {k: j.results.get(k) for k in (*keys, "params", "steps")}
    crtn = uses_cache(j.cfg("model.name"))
    return dict(
        model=j.cfg("model.name"),
        data=j.cfg("data.name"),
        query=j.cfg("query.strategy") if crtn else None,
        summary=j.cfg("summary.name") if crtn else None,
        n_slot=j.cfg("cache.n_slot") if crtn else None,
        top_k=j.cfg("cache.top_k") if crtn else None,
        tgt_len=j.cfg("model.tgt_len"),
        mem_len=j.cfg("model.mem_len"),
        params=None,
        steps=max((rec["step"] for rec in j.metrics if isinstance(rec.get("step"), int)), default=None),
    )


#: the key a sweep searches over, whose best value per configuration "best of each search" reports
SEARCH_KEY = "optim.lr"
#: the key whose values repeat one configuration, which "across seeds" averages over
SEED_KEY = "seed"


def groups_apart(jobs: list[Job], key: str) -> dict[str, list[Job]]:
    """Finished training jobs grouped by their overrides other than ``key`` (sorted, joined by
    spaces; ``(no other override)`` when there are none). A job's value of ``key`` is the one given
    on its command line, else the one in its ``.hydra/config.yaml`` (so a first run at the default
    seed or learning rate joins the runs that name other values); a job with neither is left out.
    Only groups of at least two jobs with at least two different values of ``key`` (re-runs of one
    configuration are no search and no seed spread); each in the order of ``jobs``.
    """
    groups: dict[str, list[Job]] = {}
    for j in jobs:
        if j.kind != "train" or j.status != "done" or not isinstance((j.results or {}).get("valid"), dict):
            continue
        if _given(j, key) is None:
            continue
        rest = " ".join(sorted(o for o in j.overrides if split_override(o)[0] != key))
        groups.setdefault(rest or "(no other override)", []).append(j)
    return {
        rest: members
        for rest, members in groups.items()
        if len(members) >= 2 and len({_given(m, key) for m in members}) >= 2
    }


def _given(j: Job, key: str) -> str | None:
    """``key``'s value in job ``j``: from its command line, else from its config (as text); None
    when it has neither."""
    given = dict(split_override(o) for o in j.overrides)
    if key in given:
        return given[key]
    value = j.cfg(key)
    return None if value is None else str(value)


def search_table(jobs: list[Job], key: str = SEARCH_KEY) -> tuple[list[str], list[dict[str, Any]]]:
    """The best of each search (a fair comparison: every configuration gets its own best value of
    ``key`` from the same grid): finished training jobs whose overrides differ only in ``key`` form
    one search (:func:`groups_apart`); per search, the job with the lowest validation loss, its
    value of ``key`` and its valid and test metric. Rows in the order of the jobs.
    """
    cols = ["search", "jobs", key, "best job", "valid", "test", "metric", "tried"]
    rows = []
    for rest, members in groups_apart(jobs, key).items():
        best = min(members, key=lambda j: j.results["valid"]["loss"])
        metric = best.results.get("metric") or best.metric
        tried = ", ".join(f"{_given(m, key)}: {m.results['valid'].get(metric):.4g}" for m in members)
        rows.append(
            {
                "search": rest,
                "jobs": len(members),
                key: _given(best, key),
                "best job": best.name,
                "valid": best.results["valid"].get(metric),
                "test": (best.results.get("test") or {}).get(metric),
                "metric": metric,
                "tried": tried,
            }
        )
    return cols, rows


def seed_table(jobs: list[Job], key: str = SEED_KEY) -> tuple[list[str], list[dict[str, Any]]]:
    """One configuration over several seeds: finished training jobs whose overrides differ only in
    ``key`` form one group (:func:`groups_apart`); per group, the number of seeds, the mean and the
    sample standard deviation (n - 1 in the denominator) of the valid and test metric, and every
    seed's test metric. A difference between two configurations smaller than their spread across
    seeds is not a result (docs/results.md shows such a case at word level).
    """
    cols = ["configuration", "seeds", "valid_mean", "valid_std", "test_mean", "test_std", "metric"]
    cols += ["test_by_seed"]
    rows = []
    for rest, members in groups_apart(jobs, key).items():
        metric = members[0].results.get("metric") or members[0].metric
        row: dict[str, Any] = {"configuration": rest, "seeds": len(members), "metric": metric}
        for split in ("valid", "test"):
            values = [(m.results.get(split) or {}).get(metric) for m in members]
            if any(not isinstance(v, (int, float)) for v in values):
                row[f"{split}_mean"] = row[f"{split}_std"] = None
                continue
            row[f"{split}_mean"], row[f"{split}_std"] = statistics.mean(values), statistics.stdev(values)
        row["test_by_seed"] = ", ".join(
            f"{_given(m, key)}: {(m.results.get('test') or {}).get(metric, float('nan')):.5g}"
            for m in members
        )
        rows.append(row)
    return cols, rows


def eval_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``cache_extension.csv`` (eval jobs), sorted by checkpoint then n_slot;
    from each job's final evaluation (:meth:`Job.final`) its :func:`evaluation_cols` after the
    split they come from, and the RETRIEVAL_COLS of ``retrieval`` and of each retrieving layer
    (:func:`_layer_cols`) that at least one job has."""
    jobs = [j for j in jobs if j.kind == "eval"]
    metrics = metrics_of(jobs)
    splits = [s for s in ("valid", "test") if any(isinstance((j.eval or {}).get(s), dict) for j in jobs)]
    splits += sorted(
        {
            k
            for j in jobs
            for k, v in (j.eval or {}).items()
            if isinstance(v, dict) and "loss" in v and k not in splits
        }
    )
    finals = [j.final() for j in jobs]
    extra = evaluation_cols(finals, any(isinstance(_at(f, ("repeat",)), dict) for f in finals))
    cols = ["job", "status", "checkpoint", "step", "n_slot", "top_k", "tgt_len", "mem_len", "range_tokens"]
    cols += [f"{s}_{m}" for s in splits for m in metrics]
    retrieval = _present(finals, {c: ("retrieval", c) for c in RETRIEVAL_COLS} | _layer_cols(finals))
    cols += (["split", *extra] if extra else []) + [*retrieval, "tokens_per_s", "note", "overrides"]
    rows = []
    for j in sorted(jobs, key=eval_sort_key):
        e = j.eval or {}
        fin = j.final() or {}
        row: dict[str, Any] = {"job": j.name, "status": j.status}
        row["checkpoint"] = j.checkpoint
        row["step"] = e.get("step")
        for k in ("n_slot", "top_k", "tgt_len", "mem_len"):
            row[k] = j.eval_setting(k)
        if all(isinstance(row[k], int) for k in ("n_slot", "tgt_len", "mem_len")):
            row["range_tokens"] = dependency_range(row["mem_len"], row["n_slot"], row["tgt_len"])
        for s in splits:
            ev = e.get(s) if isinstance(e.get(s), dict) else {}
            for m in metrics:
                row[f"{s}_{m}"] = ev.get(m)
        row["split"] = j.final_split()
        for c, place in (extra | retrieval).items():
            row[c] = _at(fin, place)
        row["tokens_per_s"] = fin.get("tokens_per_s")
        row["note"] = j.note
        row["overrides"] = " ".join(j.overrides)
        rows.append({c: row.get(c) for c in cols})
    return cols, rows


def evaluation_cols(evals: list[Any], synthetic: bool) -> dict[str, tuple]:
    """The columns both tables read from a job's evaluation dict (``evals``: one per job, None
    where a job has none), each with its place in the dict (:func:`_at`): where ``synthetic``
    (the passage-recall corpus) RECALL_COLS and the SOURCE_COLS at least one evaluation has
    (``<block>_<key>``: ``key`` of its ``block`` dict, ``repeat`` or ``fresh``); where an
    evaluation has MQAR's ``answers`` dict, ANSWER_COLS and the PAIR_COLS at least one has."""
    cols: dict[str, tuple] = {}
    if synthetic:
        cols |= _named(RECALL_COLS) | _present(evals, _named(SOURCE_COLS))
    if any(isinstance(_at(e, ("answers",)), dict) for e in evals):
        cols |= _named(ANSWER_COLS) | _present(evals, {c: ("answers", c) for c in PAIR_COLS})
    return cols


def _named(cols: list[str]) -> dict[str, tuple]:
    """Each ``<block>_<key>`` column's place: ``(block, key)``."""
    return {c: tuple(c.split("_", 1)) for c in cols}


def _layer_cols(evals: list[Any]) -> dict[str, tuple]:
    """``<key>_r<i>``, for each RETRIEVAL_COLS key and i = 1..n: ``key`` of retrieving layer i's
    summary in ``retrieval.layers`` (bottom first, as the distance plot's ``layer i of n``); n is
    the most layers any of ``evals`` lists (none without ``layers``: one retrieving layer)."""
    layers = [_at(e, ("retrieval", "layers")) for e in evals]
    n = max((len(x) for x in layers if isinstance(x, list)), default=0)
    return {f"{c}_r{i}": ("retrieval", "layers", i - 1, c) for c in RETRIEVAL_COLS for i in range(1, n + 1)}


_ABSENT = object()


def _at(ev: Any, place: tuple, default: Any = None) -> Any:
    """The value at ``place`` (keys of dicts, indices of lists) in the evaluation dict ``ev``;
    ``default`` where it has none."""
    for step in place:
        if isinstance(ev, dict) and step in ev:
            ev = ev[step]
        elif isinstance(ev, list) and isinstance(step, int) and step < len(ev):
            ev = ev[step]
        else:
            return default
    return ev


def _present(evals: list[Any], cols: dict[str, tuple]) -> dict[str, tuple]:
    """The columns of ``cols`` whose place at least one of these evaluation dicts has (even if
    its value there is None)."""
    return {
        c: place for c, place in cols.items() if any(_at(e, place, _ABSENT) is not _ABSENT for e in evals)
    }


def eval_sort_key(j: Job) -> tuple:
    n = j.eval_setting("n_slot")
    return (str(j.checkpoint or ""), n is None, n if isinstance(n, int) else 0, j.order)


def metrics_of(jobs: list[Job]) -> list[str]:
    found = {j.metric for j in jobs}
    return [m for m in ("ppl", "bpc") if m in found] or ["ppl"]


def _data_name(j: Job) -> str | None:
    return (j.results or {}).get("data") or j.cfg("data.name")


def write_csv(path: Path, cols: list[str], rows: list[dict[str, Any]]) -> None:
    """CSV with a header; None is an empty cell and floats are written unrounded (``repr``)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for r in rows:
            w.writerow(["" if r[c] is None else r[c] for c in cols])


_HEADERS = {
    "tokens_per_s": "tok/s",
    "train_time_s": "train time",
    "range_tokens": "range (tokens)",
    "test_repeat_source_in_memory": "repeat src in memory",
    "test_repeat_source_in_cache": "repeat src in cache",
    "test_repeat_source_retrieved": "repeat src retrieved",
    "repeat_source_in_memory": "repeat src in memory",
    "repeat_source_in_cache": "repeat src in cache",
    "repeat_source_retrieved": "repeat src retrieved",
    "overrides": "overrides",
}


def markdown_table(cols: list[str], rows: list[dict[str, Any]], varying: dict[str, list[str]]) -> str:
    """A Markdown table of ``rows``; columns empty in every row are left out, numbers rounded.

    ``varying`` maps job name to the overrides shown (those that differ between jobs).
    """
    keep = [c for c in cols if c in ("job", "status") or any(r[c] not in (None, "") for r in rows)]
    if "overrides" in cols:
        keep = [c for c in keep if c != "overrides"] + ["overrides"]
    head = [_HEADERS.get(c, c.replace("_", " ") if c.endswith(("_ppl", "_bpc", "_acc")) else c) for c in keep]
    if "overrides" in keep:
        head[-1] = "overrides (varying)"
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(_align(c) for c in keep) + "|"]
    for r in rows:
        cells = []
        for c in keep:
            v = " ".join(varying.get(r["job"], [])) if c == "overrides" else r[c]
            cells.append(_md_escape(_fmt_cell(c, v)))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _align(col: str) -> str:
    return "---" if col in TEXT_COLS else "---:"


def _fmt_cell(col: str, v: Any) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if col.endswith("_acc") or "_source_" in col or "pair_" in col:
        return f"{v:.3f}"
    if col.endswith("_bpc"):
        return f"{v:.4f}"
    if col.endswith("_ppl"):
        return f"{v:,.2f}"
    if col == "train_time_s":
        return duration(v)
    if col == "tokens_per_s":
        return f"{v:,.0f}"
    if col.endswith(("_mean", "_std")):
        return f"{v:.5g}"
    if col in ("params", "steps", "step", "range_tokens"):
        return f"{v:,}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")
