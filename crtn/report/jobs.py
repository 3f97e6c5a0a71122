"""Reading the job directories of a sweep for ``crtn-report``: :class:`Job`, its status and notes."""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from crtn.data.spec import data_level, metric_name
from crtn.errors import UserError

JOB_FILES = (".hydra/config.yaml", "status.json", "results.json", "eval.json", "metrics.jsonl")
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
        return f"{self.name}: " + " ".join(short(o) for o in self.varying)

    @property
    def metric(self) -> str:
        """``ppl`` or ``bpc``: from the job's results, else from its corpus in the config."""
        for d in (self.results, self.final()):
            if d and d.get("metric") in METRIC_LABEL:
                return d["metric"]
            if d and "bpc" in d:
                return "bpc"
        data = self.config.get("data")
        return metric_name(data_level(data if isinstance(data, dict) else {}))

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

    def eval_setting(self, key: str) -> Any:
        """An eval-time setting (``n_slot``, ``top_k``, ``tgt_len``, ``mem_len``) of the final
        evaluation: as the evaluation recorded it, else as ``eval.<key>`` of the config."""
        fin = self.final() or {}
        return fin[key] if key in fin else self.cfg(f"eval.{key}")

    @property
    def checkpoint(self) -> str | None:
        """The checkpoint an evaluation job evaluated: as ``eval.json`` names it, else its config's."""
        return (self.eval or {}).get("checkpoint", self.cfg("checkpoint"))

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
    return sorted(jobs, key=lambda d: name_key(d.name))


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
            job.order = (i, name_key(d.name))
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

    config = load(".hydra/config.yaml", read_yaml)
    overrides = load(".hydra/overrides.yaml", read_yaml)
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
        job.note = join_notes(job.note, f"metrics.jsonl: {bad_lines} unreadable line(s) skipped")
    return job


def _json_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def read_yaml(text: str) -> Any:
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


def name_key(name: str) -> tuple:
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
            note = join_notes(note, _progress(job, with_age=False))
        elif status == "running":
            alive = _alive(info)
            if alive is False:
                status = "died"
                note = (
                    f"status.json says running, but pid {info.get('pid')} on {info.get('host')} is gone "
                    f"(killed?); resume with the same overrides and hydra.run.dir={job.path}"
                )
            note = join_notes(note, _progress(job, with_age=True))
        elif status == "stopped":
            note = join_notes("stopped by a signal", _progress(job, with_age=False))
            note = join_notes(note, f"resume with the same overrides and hydra.run.dir={job.path}")
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
        parts.append(duration(last["elapsed"]))
    m = job.metric
    valid = [r for r in job.metrics if f"valid_{m}" in r]
    if valid:
        v = valid[-1]
        parts.append(f"last valid {m} {fmt_metric(v[f'valid_{m}'], m)} (step {v.get('step')})")
    if with_age:
        f = job.path / "metrics.jsonl"
        try:
            parts.append(f"updated {duration(time.time() - f.stat().st_mtime)} ago")
        except OSError:
            pass
    return ", ".join(parts)


def _mark_varying(jobs: list[Job]) -> None:
    """Set ``job.varying``: the overrides whose key is missing or differs in another job."""
    parsed = [dict(split_override(o) for o in j.overrides) for j in jobs]
    keys = {k for p in parsed for k in p}
    varying = {k for k in keys if len({p.get(k) for p in parsed}) > 1}
    for j in jobs:
        j.varying = [o for o in j.overrides if split_override(o)[0] in varying]


def split_override(o: str) -> tuple[str, str | None]:
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


# ----------------------------------------------------------------------------- formatting


def fmt_metric(v: Any, m: str) -> str:
    if not isinstance(v, (int, float)):
        return "n/a"
    return f"{v:.4f}" if m == "bpc" else f"{v:,.2f}"


def duration(s: float) -> str:
    if s < 60:
        return f"{s:.1f} s"
    if s < 3 * 3600:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def join_notes(a: str, b: str) -> str:
    return "; ".join(x for x in (a, b) if x)


def short(o: str, width: int = 40) -> str:
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
