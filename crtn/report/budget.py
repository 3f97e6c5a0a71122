"""``crtn-report``: models compared at equal wall-clock time and at equal tokens.

A sweep whose training jobs share one ``train.max_time`` (a wall-clock budget, seconds) gives
two comparisons, and a model that is slower per step can win one and lose the other
(docs/results.md compares both at character level):

- **equal time** (``equal_time.csv``): each job's final valid and test metric (``results.json``:
  the best checkpoint by validation, on ``eval.*``'s segments) after the shared budget, with the
  steps and tokens it trained in that time and what stopped it (the budget, or ``train.max_step``
  first); beside them its last validation during training (``metrics.jsonl``). A job without
  ``results.json`` (died, failed, still running) has no metric at the budget; its row says how
  far it got.
- **equal tokens** (``equal_tokens.csv``): each job's validation metric during training
  (``metrics.jsonl``, on ``train.eval_max_step`` segments) at the largest step every job of the
  group reached. When the jobs' validations do not share that step, the table uses the last step
  at which every job validated and says so; when they share none, each row gives the job's last
  validation at or before the common step, with its own step, and the table says that the
  evaluations do not line up. Nothing is interpolated. Tokens are steps times
  ``data.batch_size * model.tgt_len`` (one process); jobs with different tokens per step are
  flagged, since their steps are then not equal tokens.
- ``equal_budget.png``: validation metric against elapsed training time (evaluation included;
  the budget dotted) and against training tokens (the common step dotted), one line per job.

Jobs are grouped by the value of ``train.max_time`` (and the metric, ``ppl`` or ``bpc``); a
group needs two jobs. Jobs without a budget (``train.max_time`` null) take no part.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from crtn.report.jobs import METRIC_LABEL, Job, duration, fmt_metric
from crtn.report.plots import figure, legend, legend_layout, status_suffix, suptitle, value_axis


def budget_groups(jobs: list[Job]) -> dict[tuple[float, str], list[Job]]:
    """Training jobs with a ``train.max_time`` by (budget in seconds, metric), groups of two or
    more, each in the order of ``jobs``."""
    groups: dict[tuple[float, str], list[Job]] = {}
    for j in jobs:
        budget = j.cfg("train.max_time")
        if j.kind != "train" or not isinstance(budget, (int, float)) or isinstance(budget, bool):
            continue
        groups.setdefault((float(budget), j.metric), []).append(j)
    return {k: members for k, members in groups.items() if len(members) >= 2}


def validations(j: Job, m: str) -> dict[int, dict[str, Any]]:
    """The job's validation records during training by step (the last record of a step wins,
    as after a resume), ``metrics.jsonl`` records with ``valid_<m>``."""
    out = {}
    for r in j.metrics:
        if isinstance(r.get("step"), int) and _num(r.get(f"valid_{m}")):
            out[r["step"]] = r
    return dict(sorted(out.items()))


def reached(j: Job) -> int | None:
    """The last step the job trained to: ``results.json``'s steps, else the largest step of
    ``metrics.jsonl`` (training or validation records)."""
    steps = [r["step"] for r in j.metrics if isinstance(r.get("step"), int)]
    done = (j.results or {}).get("steps")
    if isinstance(done, int):
        steps.append(done)
    return max(steps, default=None)


def tokens_per_step(j: Job) -> int | None:
    """``data.batch_size * model.tgt_len`` of the job's config (None when either is missing)."""
    b, t = j.cfg("data.batch_size"), j.cfg("model.tgt_len")
    return b * t if isinstance(b, int) and isinstance(t, int) else None


def common_step(members: list[Job], m: str) -> tuple[int | None, int | None, bool]:
    """(the largest step every job reached, the step the table reads, aligned): the step read is
    the last step at which every job validated, at most the first; with no such step it is the
    first and ``aligned`` is False (each job then shows its last validation at or before it)."""
    reach = [reached(j) for j in members]
    if any(r is None for r in reach):
        return None, None, False
    top = min(reach)
    shared = set.intersection(*(set(validations(j, m)) for j in members))
    shared = {s for s in shared if s <= top}
    if shared:
        return top, max(shared), True
    return top, top, False


def equal_time_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``equal_time.csv`` (module docstring), one row per job of each group."""
    cols = ["budget_s", "job", "model", "status", "stopped_by", "steps", "tokens", "train_time_s"]
    cols += ["valid", "test", "metric", "last_valid_step", "last_valid_elapsed_s", "last_valid", "note"]
    rows = []
    for (budget, m), members in budget_groups(jobs).items():
        for j in members:
            r = j.results or {}
            steps = reached(j)
            tps = tokens_per_step(j)
            evals = validations(j, m)
            last = evals[max(evals)] if evals else {}
            elapsed = [x["elapsed"] for x in j.metrics if _num(x.get("elapsed"))]
            row: dict[str, Any] = {"budget_s": budget, "job": j.name, "status": j.status, "metric": m}
            row["model"] = r.get("model") or j.cfg("model.name")
            row["stopped_by"] = r.get("stopped_by") if j.results is not None else None
            row["steps"] = steps
            row["tokens"] = steps * tps if steps is not None and tps else None
            row["train_time_s"] = r.get("train_time_s", max(elapsed, default=None))
            row["valid"] = (r.get("valid") or {}).get(m) if isinstance(r.get("valid"), dict) else None
            row["test"] = (r.get("test") or {}).get(m) if isinstance(r.get("test"), dict) else None
            row["last_valid_step"] = last.get("step")
            row["last_valid_elapsed_s"] = last.get("elapsed")
            row["last_valid"] = last.get(f"valid_{m}")
            row["note"] = _time_note(j, row, budget)
            rows.append(row)
    return cols, rows


def _time_note(j: Job, row: dict[str, Any], budget: float) -> str:
    if j.results is None:
        t = row["train_time_s"]
        spent = f" after {duration(t)} of the {duration(budget)} budget" if _num(t) else ""
        return f"no result at the budget ({j.status}): stopped at step {row['steps']}{spent}"
    stopped = row["stopped_by"] or "train.max_step"
    if not str(stopped).startswith("train.max_time"):
        return f"ended by {stopped} before the budget"
    return ""


def equal_tokens_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``equal_tokens.csv`` (module docstring): per group, each job's
    validation at the common step (:func:`common_step`), with ``aligned`` False on every row of a
    group whose validations share no step."""
    cols = ["budget_s", "common_step", "job", "model", "status", "reached", "step", "tokens"]
    cols += ["elapsed_s", "valid", "metric", "aligned", "note"]
    rows = []
    for (budget, m), members in budget_groups(jobs).items():
        top, step, aligned = common_step(members, m)
        per_step = {tokens_per_step(j) for j in members}
        for j in members:
            evals = validations(j, m)
            at = [s for s in evals if step is not None and s <= step]
            rec = evals[max(at)] if at else {}
            row: dict[str, Any] = {"budget_s": budget, "common_step": top, "job": j.name, "metric": m}
            row["model"] = (j.results or {}).get("model") or j.cfg("model.name")
            row.update(status=j.status, reached=reached(j), aligned=aligned)
            row["step"] = rec.get("step")
            tps = tokens_per_step(j)
            row["tokens"] = rec["step"] * tps if rec and tps else None
            row["elapsed_s"] = rec.get("elapsed")
            row["valid"] = rec.get(f"valid_{m}")
            notes = []
            if not rec:
                notes.append(f"no validation at or before step {step}")
            elif not aligned and rec["step"] != step:
                notes.append(
                    f"evaluations do not line up: its last validation by step {step} is at step {rec['step']}"
                )
            elif step != top:
                notes.append(f"last validation common to all jobs; every job trained to step {top}")
            if len(per_step) > 1:
                notes.append("jobs differ in tokens per step: equal steps are not equal tokens")
            row["note"] = "; ".join(notes)
            rows.append(row)
    return cols, rows


def budget_markdown(jobs: list[Job]) -> list[str]:
    """report.md's section: per budget, the equal-time table beside the equal-token table."""
    _, time_rows = equal_time_table(jobs)
    if not time_rows:
        return []
    _, token_rows = equal_tokens_table(jobs)
    lines = [
        "## Equal time and equal tokens (`equal_time.csv`, `equal_tokens.csv`)",
        "",
        "Jobs that share a wall-clock budget (`train.max_time`). Equal time: the final evaluation after the "
        "budget (valid, test), what the job trained in it, and its last validation during training. Equal "
        "tokens: each job's validation during training at the largest step every job reached (on "
        "`train.eval_max_step` segments, so comparable with the last column of the equal-time table, not "
        "with its valid and test). Lower is better; nothing is interpolated.",
        "",
    ]
    for key in dict.fromkeys((r["budget_s"], r["metric"]) for r in time_rows):
        budget, m = key
        t_rows = [r for r in time_rows if (r["budget_s"], r["metric"]) == key]
        k_rows = [r for r in token_rows if (r["budget_s"], r["metric"]) == key]
        lines += [f"### Budget {duration(budget)} (`train.max_time={budget:g}`), {m}", ""]
        lines += [
            "| equal time | model | status | steps | tokens | valid | test | last valid (step, time) | note |",
            "|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in t_rows:
            last = ""
            if r["last_valid"] is not None:
                last = f"{fmt_metric(r['last_valid'], m)} ({r['last_valid_step']:,}, {_dur(r['last_valid_elapsed_s'])})"
            lines.append(
                f"| {r['job']} | {r['model']} | {r['status']} | {_int(r['steps'])} | {_int(r['tokens'])} | "
                f"{_metric(r['valid'], m)} | {_metric(r['test'], m)} | {last} | {r['note']} |"
            )
        first = k_rows[0]
        if first["aligned"]:
            head = f"at step {first['step'] if first['step'] is not None else '?'}"
        else:
            head = f"evaluations do not line up by step {first['common_step']}: each job's last validation"
        lines += [
            "",
            f"| equal tokens ({head}) | model | status | reached | step | tokens | time | valid | note |",
            "|---|---|---|---:|---:|---:|---:|---:|---|",
        ]
        for r in k_rows:
            lines.append(
                f"| {r['job']} | {r['model']} | {r['status']} | {_int(r['reached'])} | {_int(r['step'])} | "
                f"{_int(r['tokens'])} | {_dur(r['elapsed_s'])} | {_metric(r['valid'], m)} | {r['note']} |"
            )
        lines.append("")
    return lines


def plot_budget(
    members: list[Job], path: Path, *, budget: float, metric: str, title: str, colors: dict[str, Any]
) -> bool:
    """One group's figure (module docstring): the jobs of one :func:`budget_groups` group, their
    shared ``budget`` (seconds) and ``metric``; False when no job has a validation."""
    m = metric
    shown = [j for j in members if validations(j, m)]
    if not shown:
        return False
    top, step, _ = common_step(members, m)
    labels = [j.label + status_suffix(j) for j in shown]
    ncol, extra = legend_layout(labels, 12)
    fig = figure(12, 4.8 + extra)
    axes = fig.subplots(1, 2, sharey=True)
    values = []
    for j, lab in zip(shown, labels):
        recs = list(validations(j, m).values())
        values += [r[f"valid_{m}"] for r in recs]
        style = {"color": colors.get(j.name), "marker": "o", "markersize": 3.5, "linewidth": 1.6}
        if j.status != "done":
            style["linestyle"] = "--"
        timed = [r for r in recs if _num(r.get("elapsed"))]
        axes[0].plot([r["elapsed"] / 60 for r in timed], [r[f"valid_{m}"] for r in timed], label=lab, **style)
        tps = tokens_per_step(j)
        if tps:
            axes[1].plot([r["step"] * tps / 1e6 for r in recs], [r[f"valid_{m}"] for r in recs], **style)
    axes[0].axvline(
        budget / 60, color="0.3", linestyle=":", linewidth=1.2, label=f"budget ({duration(budget)})"
    )
    per_step = {tokens_per_step(j) for j in members}
    if step is not None and len(per_step) == 1 and None not in per_step:
        x = step * per_step.pop() / 1e6
        axes[1].axvline(x, color="0.3", linestyle=":", linewidth=1.2)
    log_y = value_axis(axes[0], values, log_ok=m == "ppl")
    axes[0].set_ylabel(
        f"validation {METRIC_LABEL[m]}" + (", log scale" if log_y else "") + ", lower is better"
    )
    axes[0].set_xlabel("elapsed training time (min, evaluation included)")
    axes[1].set_xlabel("training tokens (millions; dotted: the last step common to all jobs)")
    axes[0].set_title("equal time", fontsize=10)
    axes[1].set_title("equal tokens", fontsize=10)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    suptitle(fig, f"Validation {m} against time and tokens, budget train.max_time={budget:g}: {title}")
    legend(fig, axes[0] if ncol == 0 else list(axes), ncol)
    fig.savefig(path)
    return True


def budget_plots(jobs: list[Job], title: str, colors: dict[str, Any]) -> list[tuple[str, Any]]:
    """(file name, maker(path) -> bool) per group, for :func:`crtn.report.write_report`:
    ``equal_budget.png``, or ``equal_budget_<seconds>_<metric>.png`` with several groups."""
    groups = budget_groups(jobs)
    out = []
    for (budget, m), members in groups.items():
        name = "equal_budget.png" if len(groups) == 1 else f"equal_budget_{budget:g}_{m}.png"
        out.append(
            (
                name,
                lambda p, g=members, b=budget, mm=m: plot_budget(
                    g, p, budget=b, metric=mm, title=title, colors=colors
                ),
            )
        )
    return out


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> str:
    return f"{v:,}" if isinstance(v, int) else ""


def _dur(v: Any) -> str:
    return duration(v) if _num(v) else ""


def _metric(v: Any, m: str) -> str:
    return fmt_metric(v, m) if _num(v) else ""
