"""``crtn-report``: tables and plots of the runs in a ``crtn-train`` / ``crtn-eval`` sweep.

    crtn-report SWEEP_DIR                  # a Hydra multirun dir (or a single run dir)
    crtn-report SWEEP_A SWEEP_B out=cmp    # several sweeps or runs in one report, written to cmp/
    crtn-report SWEEP_DIR plots=false      # tables only

Arguments are directory paths plus ``key=value`` options (read with ``OmegaConf.from_cli``):
``out`` (where to write; default: the directory itself, or with several directories a
report into each of them), ``plots`` (default true). A job directory is a directory holding
``.hydra/config.yaml``, ``status.json``, ``results.json``, ``eval.json`` or ``metrics.jsonl``;
a sweep directory is one whose sub-directories are job directories (``0/``, ``1/``, ...).

Files written (each only when there is something to show):

- ``report.md``: the tables below in Markdown, with the plots embedded.
- ``report.csv``: one row per ``crtn-train`` job, sorted by job number: job, status, model,
  data, query, summary, n_slot, top_k, tgt_len, mem_len, params, steps, ``valid_<metric>``,
  ``test_<metric>`` (metric ``ppl`` or ``bpc``), on the synthetic corpus the test split's
  ``test_repeat_ppl``, ``test_repeat_acc``, ``test_fresh_ppl``, ``test_fresh_acc``, then
  ``tokens_per_s``, ``train_time_s``, ``note`` and ``overrides`` (the job's command-line
  overrides). Numbers are copied from ``results.json`` unrounded. Jobs without
  ``results.json`` (failed, running, stopped, unreadable) keep their row, with the status and
  a note: the error message, or the step and time reached.
- ``cache_extension.csv``: one row per ``crtn-eval`` job (a directory with ``eval.json``),
  sorted by checkpoint then ``n_slot``: checkpoint, step, n_slot, top_k, tgt_len, mem_len,
  ``range_tokens`` (mem_len + n_slot * tgt_len, the crtn dependency range) and the metric of
  each evaluated split: the eval-time cache extension of SPEC §5.
- ``valid_curves.png``: validation metric against training step and against elapsed
  training time, one line per job (``metrics.jsonl``).
- ``test_bars.png``: final test metric per training job (best checkpoint by validation).
- ``distance_hist.png``: crtn jobs, fraction of cache selections per distance of the
  selected segment in tokens (segments * seg_len), on the final (test) evaluation.
- ``freq_buckets.png``: word-level jobs, test perplexity per training-frequency bucket.
- ``recall.png``: synthetic corpus, perplexity and accuracy on repeat vs fresh tokens.
- ``cache_extension.png``: eval sweeps, metric against eval-time ``n_slot``.

Lines and bars keep one colour per job in every plot and are labelled by the job number and
the overrides that differ between jobs. Errors: a missing directory, one without job
directories, or a bad option raises :class:`crtn.errors.UserError` (the command prints
``crtn-report: error: ...`` and exits with status 2). A job file that cannot be parsed does
not stop the report: the job is listed with status ``unreadable: <file>``.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import socket
import sys
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from crtn.errors import UserError

PROG = "crtn-report"
JOB_FILES = (".hydra/config.yaml", "status.json", "results.json", "eval.json", "metrics.jsonl")
CHAR_CORPORA = ("enwik8", "text8")
METRIC_LABEL = {"ppl": "perplexity (ppl)", "bpc": "bits per character (bpc)"}
_LOG_ERROR = re.compile(r"^\[[^\]]*\]\[[^\]]*\]\[ERROR\] - (.*)$")


@dataclass
class Job:
    """One job directory of a sweep, as read from its files (missing files: ``None`` / empty).

    ``status`` is ``done``, ``failed``, ``running``, ``stopped``, ``died`` (``status.json``
    says running but the process is gone from this host), ``incomplete`` (an eval job
    without ``eval.json``), ``unknown`` or ``unreadable: FILE[, FILE]``.
    """

    name: str
    path: Path
    kind: str  # "train" (crtn-train) or "eval" (crtn-eval)
    status: str
    config: dict[str, Any] = field(default_factory=dict)  # .hydra/config.yaml
    overrides: list[str] = field(default_factory=list)  # .hydra/overrides.yaml
    status_info: dict[str, Any] = field(default_factory=dict)  # status.json
    results: dict[str, Any] | None = None  # results.json (crtn-train)
    eval: dict[str, Any] | None = None  # eval.json (crtn-eval)
    metrics: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl
    note: str = ""
    unreadable: list[str] = field(default_factory=list)
    varying: list[str] = field(default_factory=list)  # overrides that differ between jobs
    order: tuple = ()

    @property
    def label(self) -> str:
        """Job name and its distinguishing overrides, e.g. ``0: query=token``."""
        if not self.varying:
            return self.name
        return f"{self.name}: " + " ".join(_short(o) for o in self.varying)

    @property
    def metric(self) -> str:
        """``ppl`` or ``bpc``: from the job's results, else from its corpus in the config."""
        for d in (self.results, self.final()):
            if d and d.get("metric") in METRIC_LABEL:
                return d["metric"]
            if d and "bpc" in d:
                return "bpc"
        data = self.config.get("data") or {}
        if data.get("name") in CHAR_CORPORA or (data.get("name") == "text" and data.get("level") == "char"):
            return "bpc"
        return "ppl"

    def final_split(self) -> str | None:
        """The split of the final evaluation shown in plots: ``test`` if there is one."""
        source = self.results if self.kind == "train" else self.eval
        if not source:
            return None
        for split in ("test", "valid"):
            if isinstance(source.get(split), dict):
                return split
        for k, v in source.items():
            if isinstance(v, dict) and "loss" in v:
                return k
        return None

    def final(self) -> dict[str, Any] | None:
        """The evaluation dict of :meth:`final_split` (``results.json`` or ``eval.json``)."""
        split = self.final_split()
        source = self.results if self.kind == "train" else self.eval
        return source[split] if split and source else None

    def cfg(self, dotted: str) -> Any:
        """A value of ``.hydra/config.yaml`` by dotted key (None when absent)."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node


# ----------------------------------------------------------------------------- reading


def find_job_dirs(sweep_dir: str | Path) -> list[Path]:
    """The job directories of ``sweep_dir`` (itself, if it is a single run directory).

    Raises:
        UserError: the path does not exist, is not a directory, or holds no job directory.
    """
    path = Path(sweep_dir)
    if not path.exists():
        raise UserError(f"{str(path)!r} does not exist; give a crtn-train/crtn-eval sweep or run directory")
    if not path.is_dir():
        raise UserError(
            f"{str(path)!r} is not a directory; give a crtn-train/crtn-eval sweep or run directory"
        )
    if _is_job_dir(path):
        return [path]
    jobs = [d for d in path.iterdir() if d.is_dir() and _is_job_dir(d)]
    if not jobs:
        raise UserError(
            f"{str(path)!r} has no job directories (sub-directories with .hydra/config.yaml, status.json, "
            "results.json, eval.json or metrics.jsonl); give the hydra.sweep.dir of a multirun or a run directory"
        )
    return sorted(jobs, key=lambda d: _name_key(d.name))


def load_jobs(sweep_dir: str | Path | list[str | Path]) -> list[Job]:
    """Read every job of one or several sweep (or run) directories, sorted by job number.

    With several directories, job names are ``<dir name>/<job>``. Unreadable files are
    recorded on the job (``status`` ``unreadable: FILE``), never raised.

    Raises:
        UserError: see :func:`find_job_dirs`.
    """
    roots = [Path(p) for p in sweep_dir] if isinstance(sweep_dir, (list, tuple)) else [Path(sweep_dir)]
    if not roots:
        raise UserError("no sweep directory given")
    jobs = []
    for i, root in enumerate(roots):
        for d in find_job_dirs(root):
            if len(roots) == 1:
                name = d.name
            elif d == root:
                name = root.name
            else:
                name = f"{root.name}/{d.name}"
            job = read_job(d, name)
            job.order = (i, _name_key(d.name))
            jobs.append(job)
    jobs.sort(key=lambda j: j.order)
    for kind in ("train", "eval"):
        _mark_varying([j for j in jobs if j.kind == kind])
    return jobs


def read_job(path: Path, name: str | None = None) -> Job:
    """Read one job directory (see :class:`Job`); never raises for bad job files."""
    unreadable: list[str] = []

    def load(rel: str, parse) -> Any:
        f = path / rel
        if not f.is_file():
            return None
        try:
            return parse(f.read_text())
        except Exception:  # noqa: BLE001 - JSON, YAML, decoding or I/O errors: the file is unreadable
            unreadable.append(rel)
            return None

    config = load(".hydra/config.yaml", _yaml)
    overrides = load(".hydra/overrides.yaml", _yaml)
    status_info = load("status.json", _json_dict)
    results = load("results.json", _json_dict)
    ev = load("eval.json", _json_dict)
    metrics, bad_lines = _read_jsonl(path / "metrics.jsonl")
    if not isinstance(config, dict):
        config = {}
    is_eval = (path / "eval.json").is_file() or ("checkpoint" in config and "train" not in config)
    kind = "eval" if is_eval else "train"
    job = Job(
        name=name or path.name,
        path=path,
        kind=kind,
        status="unknown",
        config=config,
        overrides=[str(o) for o in overrides] if isinstance(overrides, list) else [],
        status_info=status_info or {},
        results=results,
        eval=ev,
        metrics=metrics,
        unreadable=unreadable,
    )
    job.status, job.note = _status_and_note(job)
    if bad_lines:
        job.note = _join(job.note, f"metrics.jsonl: {bad_lines} unreadable line(s) skipped")
    return job


def _json_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def _yaml(text: str) -> Any:
    import yaml

    return yaml.safe_load(text)


def _read_jsonl(path: Path) -> tuple[list[dict[str, Any]], int]:
    """Records of a JSON-lines file and the number of lines that could not be parsed."""
    if not path.is_file():
        return [], 0
    records, bad = [], 0
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return [], 1
    for line in lines:
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def _is_job_dir(d: Path) -> bool:
    return any((d / f).is_file() for f in JOB_FILES)


def _name_key(name: str) -> tuple:
    """Numbered job directories first, in numeric order, then the others by name."""
    return (0, int(name), "") if name.isdigit() else (1, 0, name)


def _status_and_note(job: Job) -> tuple[str, str]:
    info = job.status_info
    state = info.get("state")
    note = ""
    if job.kind == "eval":
        status = "done" if job.eval is not None else "incomplete"
        if job.eval is None:
            err = _log_error(job.path / "eval.log")
            if err:
                status, note = "failed", err
            else:
                note = "no eval.json (still running, or killed)"
    elif state in ("failed", "stopped", "running", "done"):
        status = state
    elif job.results is not None:
        status = "done"
    else:
        status = "failed" if _log_error(job.path / "train.log") else "unknown"

    if job.kind == "train":
        if status == "failed":
            note = info.get("error") or _log_error(job.path / "train.log") or ""
            if not note and info.get("exit_code") is not None:
                note = f"exit code {info['exit_code']}"
            note = _join(note, _progress(job, with_age=False))
        elif status == "running":
            alive = _alive(info)
            if alive is False:
                status = "died"
                note = (
                    f"status.json says running, but pid {info.get('pid')} on {info.get('host')} is gone "
                    f"(killed?); resume with the same overrides and hydra.run.dir={job.path}"
                )
            note = _join(note, _progress(job, with_age=True))
        elif status == "stopped":
            note = _join("stopped by a signal", _progress(job, with_age=False))
            note = _join(note, f"resume with the same overrides and hydra.run.dir={job.path}")
        elif status == "done" and job.results is not None:
            stopped_by = job.results.get("stopped_by")
            if stopped_by and stopped_by != "train.max_step":
                note = f"stopped by {stopped_by}"
        elif status == "done":
            note = "no results.json"
        elif status == "unknown":
            note = _progress(job, with_age=True) or "no status.json, results.json or metrics.jsonl"
    if job.unreadable:
        status = "unreadable: " + ", ".join(job.unreadable)
    return status, note


def _log_error(log: Path) -> str | None:
    """The message of the last ``[...][...][ERROR] - MESSAGE`` line of a Hydra job log."""
    if not log.is_file():
        return None
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        m = _LOG_ERROR.match(line)
        if m:
            return m.group(1).strip()
    return None


def _alive(info: dict[str, Any]) -> bool | None:
    """Whether the pid of ``status.json`` still runs; None when it cannot be told (other host)."""
    pid, host = info.get("pid"), info.get("host")
    if not isinstance(pid, int) or host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError, ValueError):
        return None  # e.g. PermissionError: it exists but belongs to someone else
    return True


def _progress(job: Job, with_age: bool) -> str:
    """``step 40/1200, 3.2 min, last valid ppl 23.45 (step 40), updated 2 min ago``."""
    train = [r for r in job.metrics if "step" in r]
    if not train:
        return ""
    last = train[-1]
    max_step = job.cfg("train.max_step")
    parts = [f"step {last['step']}" + (f"/{max_step}" if max_step else "")]
    if isinstance(last.get("elapsed"), (int, float)):
        parts.append(_duration(last["elapsed"]))
    m = job.metric
    valid = [r for r in job.metrics if f"valid_{m}" in r]
    if valid:
        v = valid[-1]
        parts.append(f"last valid {m} {_fmt_metric(v[f'valid_{m}'], m)} (step {v.get('step')})")
    if with_age:
        f = job.path / "metrics.jsonl"
        try:
            parts.append(f"updated {_duration(time.time() - f.stat().st_mtime)} ago")
        except OSError:
            pass
    return ", ".join(parts)


def _mark_varying(jobs: list[Job]) -> None:
    """Set ``job.varying``: the overrides whose key is missing or differs in another job."""
    parsed = [dict(_split_override(o) for o in j.overrides) for j in jobs]
    keys = {k for p in parsed for k in p}
    varying = {k for k in keys if len({p.get(k) for p in parsed}) > 1}
    for j in jobs:
        j.varying = [o for o in j.overrides if _split_override(o)[0] in varying]


def _split_override(o: str) -> tuple[str, str | None]:
    key, sep, value = o.partition("=")
    return key.lstrip("+~"), (value if sep else None)


def common_overrides(jobs: list[Job]) -> list[str]:
    """Overrides shared by every job (in the first job's order)."""
    if not jobs:
        return []
    shared = set(jobs[0].overrides)
    for j in jobs[1:]:
        shared &= set(j.overrides)
    return [o for o in jobs[0].overrides if o in shared]


# ----------------------------------------------------------------------------- tables

TRAIN_HEAD = ["job", "status", "model", "data", "query", "summary", "n_slot", "top_k", "tgt_len", "mem_len"]
TRAIN_HEAD += ["params", "steps"]
RECALL_COLS = ["repeat_ppl", "repeat_acc", "fresh_ppl", "fresh_acc"]
# where the copied source of repeat tokens lay (fractions, when evaluate() measured it)
SOURCE_COLS = ["repeat_source_in_memory", "repeat_source_in_cache", "repeat_source_retrieved"]
TEXT_COLS = ("job", "status", "model", "data", "query", "summary", "note", "overrides", "checkpoint", "split")


def train_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``report.csv`` (training jobs), values as in the job files."""
    jobs = [j for j in jobs if j.kind == "train"]
    metrics = _metrics_of(jobs)
    synthetic = any(_data_name(j) == "synthetic" for j in jobs)
    cols = list(TRAIN_HEAD)
    cols += [f"{s}_{m}" for m in metrics for s in ("valid", "test")]
    if synthetic:
        cols += [
            f"test_{c}" for c in RECALL_COLS + _source_cols([(j.results or {}).get("test") for j in jobs])
        ]
    cols += ["tokens_per_s", "train_time_s", "note", "overrides"]
    rows = []
    for j in jobs:
        r = j.results or {}
        crtn = (r.get("model") or j.cfg("model.name")) == "crtn"
        row: dict[str, Any] = {"job": j.name, "status": j.status}
        if j.results is not None:
            for k in ("model", "data", "query", "summary", "n_slot", "top_k", "tgt_len", "mem_len"):
                row[k] = r.get(k)
            row["params"], row["steps"] = r.get("params"), r.get("steps")
        else:  # from the config: what the job was asked to do
            row.update(
                model=j.cfg("model.name"),
                data=j.cfg("data.name"),
                query=j.cfg("query.strategy") if crtn else None,
                summary=j.cfg("summary.name") if crtn else None,
                n_slot=j.cfg("cache.n_slot") if crtn else None,
                top_k=j.cfg("cache.top_k") if crtn else None,
                tgt_len=j.cfg("model.tgt_len"),
                mem_len=j.cfg("model.mem_len"),
                params=None,
                steps=max(
                    (rec["step"] for rec in j.metrics if isinstance(rec.get("step"), int)), default=None
                ),
            )
        for split in ("valid", "test"):
            ev = r.get(split) if isinstance(r.get(split), dict) else {}
            for m in metrics:
                row[f"{split}_{m}"] = ev.get(m)
        if synthetic:
            test = r.get("test") if isinstance(r.get("test"), dict) else {}
            for c in RECALL_COLS + SOURCE_COLS:
                kind, key = c.split("_", 1)
                row[f"test_{c}"] = (test.get(kind) or {}).get(key)
        row["tokens_per_s"] = r.get("tokens_per_s")
        row["train_time_s"] = r.get("train_time_s")
        row["note"] = j.note
        row["overrides"] = " ".join(j.overrides)
        rows.append({c: row.get(c) for c in cols})
    return cols, rows


def eval_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``cache_extension.csv`` (eval jobs), sorted by checkpoint then n_slot."""
    jobs = [j for j in jobs if j.kind == "eval"]
    metrics = _metrics_of(jobs)
    splits = [s for s in ("valid", "test") if any(isinstance((j.eval or {}).get(s), dict) for j in jobs)]
    splits += sorted(
        {
            k
            for j in jobs
            for k, v in (j.eval or {}).items()
            if isinstance(v, dict) and "loss" in v and k not in splits
        }
    )
    synthetic = any(isinstance((j.final() or {}).get("repeat"), dict) for j in jobs)
    cols = ["job", "status", "checkpoint", "step", "n_slot", "top_k", "tgt_len", "mem_len", "range_tokens"]
    cols += [f"{s}_{m}" for s in splits for m in metrics]
    if synthetic:
        cols += ["split"] + RECALL_COLS + _source_cols([j.final() for j in jobs])
    cols += ["tokens_per_s", "note", "overrides"]
    rows = []
    for j in sorted(jobs, key=_eval_sort_key):
        e = j.eval or {}
        fin = j.final() or {}
        row: dict[str, Any] = {"job": j.name, "status": j.status}
        row["checkpoint"] = e.get("checkpoint", j.cfg("checkpoint"))
        row["step"] = e.get("step")
        for k in ("n_slot", "top_k", "tgt_len", "mem_len"):
            row[k] = fin.get(k, j.cfg(f"eval.{k}"))
        if all(isinstance(row[k], int) for k in ("n_slot", "tgt_len", "mem_len")):
            row["range_tokens"] = row["mem_len"] + row["n_slot"] * row["tgt_len"]
        for s in splits:
            ev = e.get(s) if isinstance(e.get(s), dict) else {}
            for m in metrics:
                row[f"{s}_{m}"] = ev.get(m)
        if synthetic:
            row["split"] = j.final_split()
            for c in RECALL_COLS + SOURCE_COLS:
                kind, key = c.split("_", 1)
                row[c] = (fin.get(kind) or {}).get(key)
        row["tokens_per_s"] = fin.get("tokens_per_s")
        row["note"] = j.note
        row["overrides"] = " ".join(j.overrides)
        rows.append({c: row.get(c) for c in cols})
    return cols, rows


def _source_cols(evals: list[Any]) -> list[str]:
    """The SOURCE_COLS that at least one of these evaluation dicts has."""
    reps = [e.get("repeat") for e in evals if isinstance(e, dict) and isinstance(e.get("repeat"), dict)]
    return [c for c in SOURCE_COLS if any(c.split("_", 1)[1] in r for r in reps)]


def _eval_sort_key(j: Job) -> tuple:
    fin = j.final() or {}
    n = fin.get("n_slot", j.cfg("eval.n_slot"))
    ckpt = (j.eval or {}).get("checkpoint", j.cfg("checkpoint")) or ""
    return (str(ckpt), n is None, n if isinstance(n, int) else 0, j.order)


def _metrics_of(jobs: list[Job]) -> list[str]:
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
    if col.endswith("_acc") or "_source_" in col:
        return f"{v:.3f}"
    if col.endswith("_bpc"):
        return f"{v:.4f}"
    if col.endswith("_ppl"):
        return f"{v:,.2f}"
    if col == "train_time_s":
        return _duration(v)
    if col == "tokens_per_s":
        return f"{v:,.0f}"
    if col in ("params", "steps", "step", "range_tokens"):
        return f"{v:,}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _md_escape(s: str) -> str:
    return s.replace("|", "\\|").replace("\n", " ")


def _fmt_metric(v: Any, m: str) -> str:
    if not isinstance(v, (int, float)):
        return "n/a"
    return f"{v:.4f}" if m == "bpc" else f"{v:,.2f}"


def _duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3 * 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _join(a: str, b: str) -> str:
    return "; ".join(x for x in (a, b) if x)


def _short(o: str, width: int = 40) -> str:
    """An override (or path) shortened for a legend: ``checkpoint=RUN/checkpoints/best.pt`` becomes
    ``checkpoint=RUN/best.pt``; other long values keep their end (``…d/of/a/long/value``)."""
    key, sep, value = o.partition("=") if "=" in o else ("", "", o)
    parts = value.split("/")
    if len(parts) >= 3 and parts[-2] == "checkpoints":
        value = f"{parts[-3]}/{parts[-1]}"
    o = f"{key}{sep}{value}"
    if len(o) <= width:
        return o
    keep = max(8, width - len(key) - 2)
    return f"{key}{sep}…{value[-keep:]}"


# ----------------------------------------------------------------------------- plots


def _figure(w: float, h: float):
    """A matplotlib Figure on the Agg canvas (no pyplot: no global state, no display needed)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=110, layout="constrained")


def _colors(jobs: list[Job]) -> dict[str, Any]:
    """One colour per job, the same in every plot."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(jobs) <= 10 else "tab20"]
    return {j.name: cmap(i % cmap.N) for i, j in enumerate(jobs)}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _status_suffix(j: Job) -> str:
    return "" if j.status == "done" else f" ({j.status.split(':')[0]})"


def _suptitle(fig, text: str) -> None:
    """Figure title, wrapped to the figure width."""
    width = int(fig.get_figwidth() * 11)
    fig.suptitle(textwrap.fill(text, width), fontsize=11)


def _legend_layout(labels: list[str], width: float) -> tuple[int, float]:
    """(columns, extra figure height in inches) of a legend below the plots; (0, 0) for a few
    entries, which go inside the axes. Columns are as many as fit the figure width."""
    if len(labels) <= 6:
        return 0, 0.0
    chars = max(len(lab) for lab in labels) + 6
    ncol = max(1, min(3, int(width * 14 // chars)))
    return ncol, 0.2 + 0.19 * math.ceil(len(labels) / ncol)


def _legend(fig, ax, ncol: int) -> None:
    """Legend inside the axes (``ncol`` 0) or in ``ncol`` columns below the plots (``ax`` may then
    be a list of axes whose entries are merged)."""
    handles, labels = [], []
    for a in ax if isinstance(ax, list) else [ax]:
        for h, lab in zip(*a.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if not handles:
        return
    if ncol == 0:
        ax.legend(handles, labels, fontsize=8, loc="best", framealpha=0.85)
    else:
        fig.legend(handles, labels, fontsize=8, loc="outside lower center", ncol=ncol, frameon=False)


def _value_axis(ax, values: list[Any], log_ok: bool, bars: bool = False) -> bool:
    """Log scale (plain tick labels) when the values span more than 3x, else linear without an
    offset; a nearly flat set of values gets a y range of at least 2% so ticks stay readable."""
    from matplotlib import ticker

    vals = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not vals:
        return False
    lo, hi = min(vals), max(vals)
    if log_ok and lo > 0 and hi / lo > 3:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ticker.LogFormatter(labelOnlyBase=False))
        ax.yaxis.set_minor_formatter(ticker.LogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        top = hi * (1.7 if bars else 1.15)
        ax.set_ylim(lo / 1.4 if bars else lo / 1.15, top)
        return True
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    if bars:
        ax.set_ylim(0, hi * 1.15 if hi > 0 else 1)
        return False
    span, mid = hi - lo, (hi + lo) / 2
    need = max(abs(mid) * 0.02, 1e-6)
    if span < need:
        ax.set_ylim(mid - need * 0.75, mid + need * 0.75)
    else:
        ax.set_ylim(lo - span * 0.12, hi + span * 0.15)
    return False


def _spaced(values: list[float], gap: float) -> list[float]:
    """Sorted ``values`` without those closer than ``gap`` to the previous one kept (the last
    value wins over its neighbour, so the end of the longest run keeps its label)."""
    kept: list[float] = []
    for v in values:
        if kept and v - kept[-1] < gap:
            if v == values[-1]:
                kept[-1] = v
            continue
        kept.append(v)
    return kept


def plot_valid_curves(jobs: list[Job], path: Path, title: str, colors: dict[str, Any]) -> bool:
    """Validation metric vs training step (left) and vs elapsed training time (right)."""
    from matplotlib import ticker

    jobs = [j for j in jobs if j.kind == "train" and any(f"valid_{j.metric}" in r for r in j.metrics)]
    if not jobs:
        return False
    metrics = _metrics_of(jobs)
    max_elapsed = max((r["elapsed"] for j in jobs for r in j.metrics if _is_num(r.get("elapsed"))), default=0)
    unit, div = (
        ("s", 1.0) if max_elapsed < 120 else ("min", 60.0) if max_elapsed < 3 * 3600 else ("h", 3600.0)
    )
    ncol, extra = _legend_layout([j.label + _status_suffix(j) for j in jobs], 12)
    fig = _figure(12, 4.6 * len(metrics) + extra)
    axes = fig.subplots(len(metrics), 2, squeeze=False)
    steps = sorted(
        {r["step"] for j in jobs for r in j.metrics if f"valid_{j.metric}" in r and _is_num(r.get("step"))}
    )
    for row, m in enumerate(metrics):
        values = []
        for j in (j for j in jobs if j.metric == m):
            recs = [r for r in j.metrics if _is_num(r.get(f"valid_{m}")) and _is_num(r.get("step"))]
            y = [r[f"valid_{m}"] for r in recs]
            values += y
            style = {"color": colors[j.name], "marker": "o", "markersize": 3.5, "linewidth": 1.6}
            if j.status != "done":
                style["linestyle"] = "--"
            axes[row][0].plot([r.get("step") for r in recs], y, label=j.label + _status_suffix(j), **style)
            timed = [r for r in recs if _is_num(r.get("elapsed"))]
            axes[row][1].plot([r["elapsed"] / div for r in timed], [r[f"valid_{m}"] for r in timed], **style)
        for col, ax in enumerate(axes[row]):
            log_y = _value_axis(ax, values, log_ok=m == "ppl")
            ax.set_ylabel(f"validation {METRIC_LABEL[m]}" + (", log scale" if log_y else ""))
            if col == 0:
                ax.set_xlabel("training step (optimizer updates)")
                if len(steps) <= 12:  # few evaluations: a tick at each that has room for its label
                    ax.set_xticks(_spaced(steps, 0.04 * (steps[-1] - steps[0])))
                else:
                    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
            else:
                ax.set_xlabel(f"elapsed training time ({unit}, evaluation included)")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"valid {m} vs " + ("step" if col == 0 else "time"), fontsize=10)
    _suptitle(fig, f"Validation {' / '.join(metrics)} during training (lower is better): {title}")
    if ncol == 0:
        for row in axes:
            _legend(fig, row[0], 0)
    else:
        _legend(fig, axes[:, 0].tolist(), ncol)
    fig.savefig(path)
    return True


def plot_test_bars(jobs: list[Job], path: Path, title: str, colors: dict[str, Any]) -> bool:
    """Horizontal bars of the final test metric per training job; jobs without one are named."""
    jobs = [j for j in jobs if j.kind == "train"]
    if not any(isinstance((j.results or {}).get("test"), dict) for j in jobs):
        return False
    metrics = _metrics_of([j for j in jobs if j.results])
    panels = [(m, [j for j in jobs if j.metric == m]) for m in metrics]
    fig = _figure(10, 1.0 + sum(0.9 + 0.42 * len(shown) for _, shown in panels))
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=[0.9 + 0.42 * len(s) for _, s in panels])
    for ax, (m, shown) in zip(axes[:, 0], panels):
        vals = [((j.results or {}).get("test") or {}).get(m) for j in shown]
        finite = [v for v in vals if isinstance(v, (int, float))]
        top = max(finite) if finite else 1.0
        for y, (j, v) in enumerate(zip(shown, vals)):
            if isinstance(v, (int, float)):
                ax.barh(y, v, color=colors[j.name], height=0.7)
                ax.text(v + top * 0.01, y, _fmt_metric(v, m), va="center", fontsize=9)
            else:
                ax.text(top * 0.01, y, f"no test result ({j.status})", va="center", fontsize=9, color="0.35")
        ax.set_yticks(
            range(len(shown)), [textwrap.shorten(j.label, 60, placeholder="…") for j in shown], fontsize=9
        )
        ax.set_ylim(len(shown) - 0.5, -0.5)
        ax.set_xlim(0, top * 1.18)
        ax.set_xlabel(f"test {METRIC_LABEL[m]}, lower is better")
        ax.grid(True, axis="x", alpha=0.3)
    _suptitle(fig, f"Final test {' / '.join(metrics)} per job (best checkpoint by validation): {title}")
    fig.savefig(path)
    return True


def plot_distance_hist(jobs: list[Job], path: Path, title: str, colors: dict[str, Any]) -> bool:
    """Fraction of cache selections per distance (tokens) of the selected segment, one line per job."""
    series = []
    for j in jobs:
        ret = (j.final() or {}).get("retrieval") or {}
        hist, seg = ret.get("distance_hist"), ret.get("seg_len")
        if isinstance(hist, list) and hist and isinstance(seg, (int, float)) and sum(hist) > 0:
            series.append((j, hist, seg, ret.get("mean_distance_tokens")))
    if not series:
        return False
    first = min(next(i for i, c in enumerate(h) if c) for _, h, _, _ in series)
    labels = [
        j.label + (f" (mean {m:,.0f} tokens)" if isinstance(m, (int, float)) else "") for j, _, _, m in series
    ]
    ncol, extra = _legend_layout(labels, 10)
    fig = _figure(10, 5.2 + extra)
    ax = fig.subplots()
    for (j, hist, seg, _), lab in zip(series, labels):
        total = sum(hist)
        xs = [i * seg for i in range(first, len(hist))]
        ys = [c / total for c in hist[first:]]
        marker = {"marker": "o", "markersize": 4} if len(xs) <= 40 else {}
        ax.plot(xs, ys, linewidth=1.5, color=colors[j.name], label=lab, **marker)
    ax.set_xlabel("distance of the selected segment (tokens = segments back × seg_len)")
    ax.set_ylabel("fraction of cache selections")
    ax.set_ylim(0, None)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.grid(True, alpha=0.3)
    splits = "/".join(sorted({str(j.final_split()) for j, *_ in series}))
    _suptitle(fig, f"CRTN retrieval: distance of the selected cache segments ({splits} split): {title}")
    _legend(fig, ax, ncol)
    fig.savefig(path)
    return True


def plot_freq_buckets(jobs: list[Job], path: Path, title: str, colors: dict[str, Any]) -> bool:
    """Grouped bars: perplexity per training-frequency bucket of the target word, one bar per job."""
    series = [(j, (j.final() or {}).get("freq_buckets")) for j in jobs]
    series = [(j, fb) for j, fb in series if isinstance(fb, dict) and fb]
    buckets: list[str] = []
    for _, fb in series:
        buckets += [b for b, e in fb.items() if b not in buckets and isinstance(e, dict) and e.get("ppl")]
    if not buckets:
        return False
    n = len(series)
    width = 0.8 / n
    fig_w = min(16, max(8, 1.5 + len(buckets) * (0.6 + 0.4 * n)))
    ncol, extra = _legend_layout([j.label for j, _ in series], fig_w)
    fig = _figure(fig_w, 5.2 + extra)
    ax = fig.subplots()
    values = []
    for i, (j, fb) in enumerate(series):
        labelled = False
        for b_i, b in enumerate(buckets):
            v = (fb.get(b) or {}).get("ppl")
            if not isinstance(v, (int, float)):
                continue
            values.append(v)
            x = b_i - 0.4 + width * (i + 0.5)
            ax.bar(x, v, width=width * 0.95, color=colors[j.name], label=None if labelled else j.label)
            labelled = True
            ax.annotate(
                f"{v:,.1f}",
                (x, v),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90 if n > 3 else 0,
            )
    ticks = []
    for b in buckets:
        counts = {(fb.get(b) or {}).get("tokens") for _, fb in series}
        ticks.append(f"{b}\n({counts.pop():,} tokens)" if len(counts) == 1 and None not in counts else b)
    ax.set_xticks(range(len(buckets)), ticks)
    log_y = _value_axis(ax, values, log_ok=True, bars=True)
    ax.set_xlabel("occurrences of the target word in the training split (bucket)")
    splits = "/".join(sorted({str(j.final_split()) for j, _ in series}))
    ax.set_ylabel(f"{splits} perplexity" + (" (log scale)" if log_y else "") + ", lower is better")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    _suptitle(fig, f"Perplexity by word frequency ({splits} split): {title}")
    _legend(fig, ax, ncol)
    fig.savefig(path)
    return True


def plot_recall(jobs: list[Job], path: Path, title: str) -> bool:
    """Synthetic corpus: repeat vs fresh perplexity (left, with the Markov source's) and accuracy."""
    series = []
    for j in jobs:
        fin = j.final() or {}
        rep, fresh = fin.get("repeat"), fin.get("fresh")
        if isinstance(rep, dict) and isinstance(fresh, dict) and ("ppl" in rep or "ppl" in fresh):
            series.append((j, {"repeat": rep, "fresh": fresh}))
    if not series:
        return False
    n = len(series)
    fig = _figure(min(16, max(10, 2.0 + 1.4 * n)), 6.0 if n <= 4 else 7.5)
    ax_p, ax_a = fig.subplots(1, 2)
    kinds = {
        "repeat": ("tab:blue", "repeat tokens (copied passage)", -0.2),
        "fresh": ("tab:orange", "fresh tokens", 0.2),
    }
    ppl_values, src_labelled = [], False
    for kind, (color, label, off) in kinds.items():
        for ax, key in ((ax_p, "ppl"), (ax_a, "acc")):
            labelled = False
            for x, (_, entries) in enumerate(series):
                e = entries[kind]
                v = e.get(key)
                if not isinstance(v, (int, float)):
                    why = "0 tokens" if e.get("tokens") == 0 else "n/a"
                    ax.text(
                        x + off,
                        0.03,
                        f"{kind}: {why}",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        color="0.4",
                        rotation=90,
                        transform=ax.get_xaxis_transform(),
                    )
                    continue
                ax.bar(x + off, v, width=0.38, color=color, label=None if labelled else label)
                labelled = True
                ax.annotate(
                    f"{v:.2f}" if key == "ppl" else f"{v:.3f}",
                    (x + off, v),
                    xytext=(0, 2),
                    textcoords="offset points",
                    ha="center",
                    va="bottom",
                    fontsize=8 if n <= 6 else 7,
                    rotation=0 if n <= 6 else 90,
                )
                if key == "ppl":
                    ppl_values.append(v)
                    src = e.get("source_ppl")
                    if isinstance(src, (int, float)):
                        ppl_values.append(src)
                        ax.plot(
                            [x + off - 0.17, x + off + 0.17],
                            [src, src],
                            color="black",
                            linewidth=2.2,
                            zorder=3,
                            label=None if src_labelled else "Markov source ppl (reference)",
                        )
                        src_labelled = True
    few = n <= 4
    names = [
        textwrap.fill(j.label, 18) if few else textwrap.shorten(j.label, 60, placeholder="…")
        for j, _ in series
    ]
    for ax in (ax_p, ax_a):
        ax.set_xticks(range(n), names, fontsize=8, rotation=0 if few else 35, ha="center" if few else "right")
        ax.set_xlim(-0.6, n - 0.4)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.set_xlabel("job")
    log_y = _value_axis(ax_p, ppl_values, log_ok=True, bars=True)
    ax_p.set_ylabel("perplexity" + (" (log scale)" if log_y else "") + ", lower is better")
    ax_p.set_title("perplexity on repeat vs fresh tokens", fontsize=10)
    ax_a.set_ylim(0, 1.12)
    ax_a.set_ylabel("next-token accuracy (fraction), higher is better")
    ax_a.set_title("next-token accuracy on repeat vs fresh tokens", fontsize=10)
    handles, labels = ax_p.get_legend_handles_labels()
    seen = set(labels)
    for h, lab in zip(*ax_a.get_legend_handles_labels()):
        if lab not in seen:
            handles.append(h)
            labels.append(lab)
    fig.legend(handles, labels, fontsize=9, loc="outside lower center", ncol=3, frameon=False)
    splits = "/".join(sorted({str(j.final_split()) for j, _ in series}))
    _suptitle(fig, f"Passage recall ({splits} split): {title}")
    fig.savefig(path)
    return True


def plot_cache_extension(jobs: list[Job], path: Path, title: str) -> bool:
    """Eval jobs: metric of the final split against eval-time n_slot, one line per checkpoint/setting."""
    import matplotlib

    jobs = [j for j in jobs if j.kind == "eval" and isinstance((j.final() or {}).get("n_slot"), int)]
    if not jobs:
        return False
    metrics = _metrics_of(jobs)
    groups: dict[tuple, list[Job]] = {}
    for j in sorted(jobs, key=_eval_sort_key):
        fin = j.final() or {}
        key = (fin.get("top_k"), fin.get("tgt_len"), fin.get("mem_len"), (j.eval or {}).get("checkpoint"))
        groups.setdefault(key, []).append(j)
    cmap = matplotlib.colormaps["tab10"]
    fig = _figure(9, 5.4 * len(metrics))
    axes = fig.subplots(len(metrics), 1, squeeze=False)[:, 0]
    ckpts = {k[3] for k in groups}
    all_n = sorted({(j.final() or {})["n_slot"] for j in jobs})
    split = "/".join(sorted({str(j.final_split()) for j in jobs}))
    for ax, m in zip(axes, metrics):
        values = []
        for g_i, (key, members) in enumerate(groups.items()):
            pts = [(j.final()["n_slot"], j.final().get(m)) for j in members if j.metric == m]
            pts = [(x, y) for x, y in pts if isinstance(y, (int, float))]
            if not pts:
                continue
            values += [y for _, y in pts]
            top_k, tgt, mem, ckpt = key
            lab = f"top_k={top_k}, tgt_len={tgt}, mem_len={mem}"
            if len(ckpts) > 1:
                lab = f"{_short(str(ckpt), 40)}: {lab}"
            ax.plot(
                [p[0] for p in pts],
                [p[1] for p in pts],
                marker="o",
                linewidth=1.8,
                color=cmap(g_i % 10),
                label=lab,
            )
            for x, y in pts:
                ax.annotate(
                    _fmt_metric(y, m),
                    (x, y),
                    textcoords="offset points",
                    xytext=(0, 7),
                    ha="center",
                    fontsize=8,
                    bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8},
                )
        for n_train in sorted({n for n, _ in _trained_n_slot(jobs)}):
            ax.axvline(
                n_train, color="0.4", linestyle=":", linewidth=1.2, label=f"n_slot in training ({n_train})"
            )
        if all_n[0] > 0 and all_n[-1] / all_n[0] >= 4:
            ax.set_xscale("log", base=2)
        ax.set_xticks(all_n, [_n_tick(n, jobs) for n in all_n])
        ax.minorticks_off()
        log_y = _value_axis(ax, values, log_ok=m == "ppl")
        ax.set_xlabel("cache slots N at evaluation (eval.n_slot); below: range m + N·L in tokens")
        ax.set_ylabel(f"{split} {METRIC_LABEL[m]}" + (" (log scale)" if log_y else "") + ", lower is better")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    _suptitle(fig, f"Eval-time cache extension ({split} split): {title}")
    fig.savefig(path)
    return True


def _n_tick(n: int, jobs: list[Job]) -> str:
    ranges = set()
    for j in jobs:
        fin = j.final() or {}
        if (
            fin.get("n_slot") == n
            and isinstance(fin.get("tgt_len"), int)
            and isinstance(fin.get("mem_len"), int)
        ):
            ranges.add(fin["mem_len"] + n * fin["tgt_len"])
    return f"{n}\n({ranges.pop():,})" if len(ranges) == 1 else str(n)


def _trained_n_slot(jobs: list[Job]) -> list[tuple[int, str]]:
    """(cache.n_slot, checkpoint) of the training runs whose checkpoints were evaluated, if found."""
    out = []
    for ckpt in sorted({str((j.eval or {}).get("checkpoint")) for j in jobs}):
        cfg_file = Path(ckpt).parent.parent / ".hydra" / "config.yaml"
        try:
            n = _yaml(cfg_file.read_text())["cache"]["n_slot"]
        except Exception:  # noqa: BLE001 - optional decoration: any problem means "unknown"
            continue
        if isinstance(n, int):
            out.append((n, ckpt))
    return out


# ----------------------------------------------------------------------------- report


def write_report(
    sweep_dir: str | Path | list[str | Path], out: str | Path | None = None, plots: bool = True
) -> dict[str, Path]:
    """Write ``report.md``, the CSV tables and the plots of the jobs in ``sweep_dir``.

    Args:
        sweep_dir: a sweep or run directory, or a list of them (combined in one report).
        out: directory for the files (created); default ``sweep_dir`` (the first of a list).
        plots: also write the PNG plots.

    Returns:
        file name -> path of every file written (``report.md`` first).

    Raises:
        UserError: bad ``sweep_dir`` (see :func:`find_job_dirs`) or ``out`` not writable.
    """
    roots = [Path(p) for p in sweep_dir] if isinstance(sweep_dir, (list, tuple)) else [Path(sweep_dir)]
    jobs = load_jobs(roots)
    out_dir = Path(out) if out is not None else roots[0]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        return _write(jobs, roots, out_dir, plots)
    except OSError as e:
        raise UserError(f"cannot write the report into {str(out_dir)!r}: {e.strerror or e}") from None


def _write(jobs: list[Job], roots: list[Path], out_dir: Path, plots: bool) -> dict[str, Path]:
    written: dict[str, Path] = {}
    title = ", ".join(_root_title(r) for r in roots)
    train = [j for j in jobs if j.kind == "train"]
    evals = [j for j in jobs if j.kind == "eval"]
    sections = []
    if train:
        cols, rows = train_table(train)
        write_csv(out_dir / "report.csv", cols, rows)
        written["report.csv"] = out_dir / "report.csv"
        sections.append(("train", cols, rows))
    if evals:
        cols, rows = eval_table(evals)
        write_csv(out_dir / "cache_extension.csv", cols, rows)
        written["cache_extension.csv"] = out_dir / "cache_extension.csv"
        sections.append(("eval", cols, rows))

    pngs: list[str] = []
    if plots:
        colors = _colors(jobs)
        makers = [
            ("valid_curves.png", lambda p: plot_valid_curves(train, p, title, colors)),
            ("test_bars.png", lambda p: plot_test_bars(train, p, title, colors)),
            ("distance_hist.png", lambda p: plot_distance_hist(jobs, p, title, colors)),
            ("freq_buckets.png", lambda p: plot_freq_buckets(jobs, p, title, colors)),
            ("recall.png", lambda p: plot_recall(jobs, p, title)),
            ("cache_extension.png", lambda p: plot_cache_extension(evals, p, title)),
        ]
        for name, make in makers:
            try:
                made = make(out_dir / name)
            except OSError:
                raise
            except Exception as e:  # noqa: BLE001 - odd values in a job file must not cost the report
                print(f"{PROG}: warning: {name} not drawn: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            if made:
                pngs.append(name)
                written[name] = out_dir / name

    md = _markdown(jobs, sections, title, pngs)
    (out_dir / "report.md").write_text(md)
    return {"report.md": out_dir / "report.md", **written}


def _root_title(root: Path) -> str:
    parts = root.resolve().parts
    return "/".join(parts[-2:]) if len(parts) >= 2 else str(root)


_PLOT_TEXT = {
    "valid_curves.png": "Validation metric during training (dashed: jobs that did not finish).",
    "test_bars.png": "Final test metric per job, evaluated with the best checkpoint by validation loss.",
    "distance_hist.png": "CRTN: how far back the selected cache segments lie (fraction of selections).",
    "freq_buckets.png": "Test perplexity by how often the target word occurs in the training split.",
    "recall.png": "Synthetic corpus: copied-passage (repeat) vs fresh tokens; black ticks: the Markov source.",
    "cache_extension.png": "Eval-time cache extension: the same checkpoint evaluated with more cache slots.",
}


def _markdown(jobs: list[Job], sections: list, title: str, pngs: list[str]) -> str:
    """report.md: a summary line, the tables (with the overrides common to all jobs), the plots."""
    from collections import Counter

    counts = Counter(j.status.split(":")[0] for j in jobs)
    summary = ", ".join(f"{n} {s}" for s, n in counts.most_common())
    lines = [
        f"# crtn report: {title}",
        "",
        f"{len(jobs)} job{'s' if len(jobs) != 1 else ''} ({summary}); written {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
    ]
    for kind, cols, rows in sections:
        group = [j for j in jobs if j.kind == kind]
        varying = {j.name: [_short(o, 60) for o in j.varying] for j in group}
        if kind == "train":
            metrics = ", ".join(f"{m} = {METRIC_LABEL[m].split(' (')[0]}" for m in _metrics_of(group))
            lines += [
                "## Training runs (`report.csv`)",
                "",
                f"valid/test: final evaluation of the best checkpoint (by validation loss); {metrics}, "
                "lower is better. tok/s: training throughput. Full overrides of each job: `report.csv`.",
                "",
            ]
        else:
            lines += [
                "## Evaluation runs: eval-time cache extension (`cache_extension.csv`)",
                "",
                "One checkpoint evaluated with different eval-time settings; range = mem_len + n_slot * tgt_len "
                "tokens (SPEC §5).",
                "",
            ]
        lines.append(markdown_table(cols, rows, varying))
        common = common_overrides(group)
        if common and len(group) > 1:
            lines += ["", "Overrides common to all jobs: `" + " ".join(common) + "`"]
        lines.append("")
    for name in pngs:
        lines += [f"![{name}]({name})", "", _PLOT_TEXT[name], ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


@dataclass
class ReportOptions:
    """``key=value`` options of ``crtn-report`` (read with ``OmegaConf.from_cli``)."""

    sweep_dir: list[str] = field(default_factory=list)
    out: str | None = None
    plots: bool = True


def parse_args(argv: list[str]) -> ReportOptions:
    """Positional directory paths plus ``key=value`` options (``out``, ``plots``, ``sweep_dir``).

    An argument is a path when it exists as one or has no ``=``; the rest go to
    ``OmegaConf.from_cli`` and are checked against :class:`ReportOptions`.

    Raises:
        UserError: an unknown option, a badly typed value, or no directory.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    paths = [a for a in argv if "=" not in a or Path(a).exists()]
    dotlist = [a for a in argv if a not in paths]
    try:
        given = OmegaConf.to_container(OmegaConf.from_cli(dotlist))
    except OmegaConfBaseException as e:
        raise UserError(f"bad option in {' '.join(dotlist)!r}: {str(e).splitlines()[0]}") from None
    extra = given.pop("sweep_dir", [])
    paths += [str(p) for p in (extra if isinstance(extra, list) else [extra])]
    try:
        opts = OmegaConf.merge(OmegaConf.structured(ReportOptions), given, {"sweep_dir": paths})
    except OmegaConfBaseException as e:
        known = ", ".join(f.name for f in ReportOptions.__dataclass_fields__.values())
        raise UserError(f"bad option: {str(e).splitlines()[0]} (options: {known})") from None
    if not opts.sweep_dir:
        raise UserError(
            "no directory given; usage: crtn-report SWEEP_DIR [MORE_DIRS ...] [out=DIR] [plots=false]"
        )
    return OmegaConf.to_object(opts)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``crtn-report``: write the report, print its tables and files."""
    args = sys.argv[1:] if argv is None else argv
    try:
        if any(a in ("-h", "--help") for a in args):
            print(__doc__)
            return
        opts = parse_args(args)
        targets = (
            [(opts.sweep_dir, opts.out)]
            if opts.out is not None or len(opts.sweep_dir) == 1
            else [([d], None) for d in opts.sweep_dir]
        )
        for dirs, out in targets:
            files = write_report(dirs if len(dirs) > 1 else dirs[0], out=out, plots=opts.plots)
            text = files["report.md"].read_text()
            print(_tables_only(text))
            print("wrote:")
            for p in files.values():
                print(f"  {p}")
            sys.stdout.flush()
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    except BrokenPipeError:  # e.g. `crtn-report DIR | head`: the files are written; stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


def _tables_only(md: str) -> str:
    """report.md without the image links and their captions (for the terminal)."""
    out, skip = [], False
    for line in md.splitlines():
        if line.startswith("!["):
            skip = True
            continue
        if skip:
            skip = line.strip() == "" or line in _PLOT_TEXT.values()
            if skip:
                continue
        out.append(line)
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    main()
