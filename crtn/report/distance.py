"""``crtn-report``: loss by distance to the previous occurrence of the target (the
``distance_buckets`` of each job's final evaluation, :mod:`crtn.analysis.distance`).

- ``distance_nll_<corpus>.png``: per corpus, mean NLL per bucket, one line per job, for (a) the
  symbol's previous occurrence and (b) the longest previous n-gram; each job's reach
  (``m + N·L + L``) is a dashed vertical line in its colour, and for models without a cache the
  reach through the layers (``n_layer·m + L``) a dotted one.
- ``distance_nll.csv`` and a table in ``report.md``: per job and analysis, the mean NLL of every
  bucket and its difference to the Transformer-XL job of the same corpus (the job whose model,
  as its ``model=`` override or else its config says, is ``txl``; the first training job of them
  when there are several, else the first ``crtn-eval`` job). A corpus without one is named in the
  report and gets no differences, nor do jobs that evaluated another split than the baseline.
- ``distance_seeds.csv`` and a table in ``report.md``, when training jobs differ only in ``seed``
  (the configurations of ``seeds.csv``, :func:`crtn.report.tables.seed_table`): per
  configuration and analysis, the mean over its seeds of every bucket's NLL, its difference to
  the mean of the corpus's ``txl`` configuration (the one that shares the most overrides with
  it, e.g. the same ``train.max_step``), and the standard error of that difference,
  sqrt(s_a^2 / n_a + s_b^2 / n_b) with s the sample standard deviation over seeds. One seed's
  bucket differences can be noise; these say whether they are.
- ``distance_seeds_<corpus>.png``: that difference per bucket, one line per configuration, with
  bars of plus and minus two standard errors, per ``txl`` configuration of a corpus (the second
  and further ones as ``distance_seeds_<corpus>_2.png``...).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path
from typing import Any

from crtn.analysis.distance import BUCKET_RANGES, BUCKETS
from crtn.report.jobs import Job, split_override
from crtn.report.plots import figure, legend, legend_layout, suptitle
from crtn.report.tables import SEED_KEY, groups_apart

KINDS = {
    "symbol": "(a) previous occurrence of the symbol",
    "ngram": "(b) previous occurrence of the longest n-gram (n <= 4)",
}
BASELINE = "txl"
#: marks in report.md of a bucket beyond the job's reach, or partly beyond it
REACH_MARK = {"beyond": "†", "partly": "‡"}


def job_model(j: Job) -> str | None:
    """The job's model as the sweep named it: its ``model=`` override (``txl_long``...), else the
    model of its results or config."""
    for o in j.overrides:
        key, value = split_override(o)
        if key == "model" and value:
            return value
    db = (j.final() or {}).get("distance_buckets") or {}
    return (j.results or {}).get("model") or db.get("model") or j.cfg("model.name")


def by_corpus(jobs: list[Job]) -> dict[str, list[tuple[Job, dict[str, Any]]]]:
    """Jobs whose final evaluation has ``distance_buckets``, grouped by corpus (in job order)."""
    groups: dict[str, list[tuple[Job, dict[str, Any]]]] = {}
    for j in jobs:
        db = (j.final() or {}).get("distance_buckets")
        if isinstance(db, dict) and all(isinstance(db.get(k), dict) for k in KINDS):
            corpus = str(db.get("corpus") or (j.results or {}).get("data") or j.cfg("data.name"))
            groups.setdefault(corpus, []).append((j, db))
    return groups


def baseline_of(series: list[tuple[Job, dict[str, Any]]]) -> tuple[Job, dict[str, Any]] | None:
    """The first training job of a corpus whose model is ``txl`` (:func:`job_model`), else the
    first such ``crtn-eval`` job, or None."""
    txl = [(j, db) for j, db in series if job_model(j) == BASELINE]
    return next((p for p in txl if p[0].kind == "train"), txl[0] if txl else None)


def bucket_loss(db: dict[str, Any], kind: str, bucket: str) -> float | None:
    """The mean NLL (nats) of ``bucket`` in analysis ``kind`` (``symbol`` / ``ngram``) of one
    evaluation's ``distance_buckets``; None when the bucket is empty or missing."""
    v = ((db.get(kind) or {}).get(bucket) or {}).get("loss")
    return float(v) if isinstance(v, (int, float)) else None


def distance_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]], dict[str, str]]:
    """Columns and rows of ``distance_nll.csv`` and, per corpus, the baseline's description.

    Rows: corpus, job, model, split, analysis (``symbol`` / ``ngram``), baseline job, then per
    bucket ``nll_<bucket>`` (mean NLL, nats) and ``diff_<bucket>`` (minus the baseline's; empty
    without a baseline, a value, or when the baseline evaluated another split). The baseline text
    is ``job N`` or ``none: ...``.
    """
    cols = ["corpus", "job", "model", "split", "analysis", "baseline"]
    cols += [f"{p}_{b}" for b in BUCKETS for p in ("nll", "diff")]
    rows, baselines = [], {}
    for corpus, series in by_corpus(jobs).items():
        base = baseline_of(series)
        baselines[corpus] = (
            f"job {base[0].name}" if base else f"none: no {BASELINE} job for corpus {corpus}, no differences"
        )
        for j, db in series:
            for kind in KINDS:
                row: dict[str, Any] = {"corpus": corpus, "job": j.name, "model": job_model(j)}
                row.update(split=db.get("split"), analysis=kind, baseline=base[0].name if base else None)
                for b in BUCKETS:
                    mine = bucket_loss(db, kind, b)
                    same_split = base is not None and base[1].get("split") == db.get("split")
                    ref = bucket_loss(base[1], kind, b) if same_split else None
                    row[f"nll_{b}"] = mine
                    row[f"diff_{b}"] = mine - ref if mine is not None and ref is not None else None
                rows.append(row)
    return cols, rows, baselines


def distance_markdown(jobs: list[Job]) -> list[str]:
    """report.md's section: per corpus, the NLL difference to Transformer-XL per bucket (or the
    mean NLL where the corpus has no ``txl`` job), with the reach marks."""
    _, rows, baselines = distance_table(jobs)
    if not rows:
        return []
    lines = [
        "## Loss by distance to the previous occurrence (`distance_nll.csv`)",
        "",
        "Per bucket of the distance (tokens, inside the stream) from the target to the previous occurrence "
        "of (a) the same symbol, (b) the longest n-gram ending at it (n <= 4): mean NLL of the job minus "
        f"that of the `{BASELINE}` job of the corpus (nats; negative: better). "
        f"{REACH_MARK['beyond']}: the bucket lies beyond the job's reach m + N·L + L; "
        f"{REACH_MARK['partly']}: partly beyond it.",
        "",
    ]
    dbs = {(c, j.name): db for c, series in by_corpus(jobs).items() for j, db in series}
    for corpus, text in baselines.items():
        diff = not text.startswith("none")
        split = "/".join(sorted({str(r["split"]) for r in rows if r["corpus"] == corpus}))
        what = f"minus {BASELINE} ({text})" if diff else f"mean NLL; {text}"
        lines += [f"### {corpus} ({split} split): {what}", ""]
        lines.append("| job | model | analysis | " + " | ".join(BUCKETS) + " |")
        lines.append("|---|---|---|" + "---:|" * len(BUCKETS))
        for r in (r for r in rows if r["corpus"] == corpus):
            db = dbs[(corpus, r["job"])]
            cells = []
            for b in BUCKETS:
                v = r[f"diff_{b}" if diff else f"nll_{b}"]
                mark = REACH_MARK.get(((db.get(r["analysis"]) or {}).get(b) or {}).get("reach"), "")
                cells.append("" if v is None else (f"{v:+.3f}" if diff else f"{v:.3f}") + mark)
            lines.append(f"| {r['job']} | {r['model']} | {r['analysis']} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def distance_seed_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``distance_seeds.csv`` (module docstring): per configuration of
    :func:`crtn.report.tables.groups_apart` over ``seed`` whose jobs all have ``distance_buckets``,
    and per analysis, ``seeds``, then per bucket ``nll_<bucket>`` (mean over seeds, nats),
    ``diff_<bucket>`` (minus the mean of the corpus's ``txl`` configuration that shares the most
    overrides with it, the first of them on a tie) and
    ``se_<bucket>`` (the standard error of that difference; empty on the baseline's own rows, whose
    difference is 0). Differences are empty for a corpus
    without a ``txl`` configuration, for another split than its, or a bucket a job left empty.
    """
    cols = ["corpus", "configuration", "model", "split", "seeds", "analysis", "baseline"]
    cols += [f"{p}_{b}" for b in BUCKETS for p in ("nll", "diff", "se")]
    groups = []
    for conf, members in groups_apart(jobs, SEED_KEY).items():
        dbs = [(j.final() or {}).get("distance_buckets") for j in members]
        if all(isinstance(db, dict) and all(isinstance(db.get(k), dict) for k in KINDS) for db in dbs):
            corpus = str(dbs[0].get("corpus") or (members[0].results or {}).get("data"))
            groups.append((corpus, conf, job_model(members[0]), dbs))
    rows = []
    for corpus, conf, model, dbs in groups:
        # the corpus's txl configuration that shares the most overrides (steps, sizes...), the first on a tie
        txl = [g for g in groups if g[0] == corpus and g[2] == BASELINE]
        base = max(txl, key=lambda g: len(set(g[1].split()) & set(conf.split())), default=None)
        split = dbs[0].get("split")
        same = base is not None and {db.get("split") for db in dbs + base[3]} == {split}
        for kind in KINDS:
            row: dict[str, Any] = {"corpus": corpus, "configuration": conf, "model": model, "split": split}
            row.update(seeds=len(dbs), analysis=kind, baseline=base[1] if base else None)
            for b in BUCKETS:
                mine = [bucket_loss(db, kind, b) for db in dbs]
                ref = [bucket_loss(db, kind, b) for db in base[3]] if same else [None]
                ok, ok_ref = None not in mine, None not in ref
                own = base is not None and conf == base[1]  # the reference itself: difference 0, no error
                row[f"nll_{b}"] = statistics.mean(mine) if ok else None
                row[f"diff_{b}"] = statistics.mean(mine) - statistics.mean(ref) if ok and ok_ref else None
                row[f"se_{b}"] = (
                    math.sqrt(statistics.variance(mine) / len(mine) + statistics.variance(ref) / len(ref))
                    if ok and ok_ref and not own
                    else None
                )
            rows.append(row)
    return cols, rows


def group_rows(rows: list[dict[str, Any]], *keys: str) -> dict[tuple, list[dict[str, Any]]]:
    """Table rows grouped by their values of ``keys`` (a tuple per group), groups and rows in order."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    return groups


def distance_seed_markdown(jobs: list[Job]) -> list[str]:
    """report.md's section of :func:`distance_seed_table`: per corpus and ``txl`` configuration, the
    mean difference to it ± its standard error, per bucket (mean NLL where there is no baseline)."""
    _, rows = distance_seed_table(jobs)
    if not rows:
        return []
    lines = [
        "## Loss by distance across seeds (`distance_seeds.csv`)",
        "",
        f"Per configuration of the seeds table: the mean over its seeds of each bucket's NLL minus the mean of "
        f"the `{BASELINE}` configuration, ± the standard error of that difference (nats; negative: better). "
        "A difference within about two standard errors of zero does not separate the models.",
        "",
    ]
    for (corpus, base), mine in group_rows(rows, "corpus", "baseline").items():
        diff = base is not None
        what = f"minus {BASELINE} ({base})" if diff else f"mean NLL; no {BASELINE} configuration"
        lines += [f"### {corpus}: {what}", ""]
        lines.append("| configuration | seeds | analysis | " + " | ".join(BUCKETS) + " |")
        lines.append("|---|---:|---|" + "---:|" * len(BUCKETS))
        for r in mine:
            cells = []
            for b in BUCKETS:
                v, se = r[f"diff_{b}"], r[f"se_{b}"]
                if diff:
                    cells.append("" if v is None else f"{v:+.3f}" + ("" if se is None else f" ± {se:.3f}"))
                else:
                    cells.append("" if r[f"nll_{b}"] is None else f"{r[f'nll_{b}']:.3f}")
            lines.append(
                f"| {r['configuration']} | {r['seeds']} | {r['analysis']} | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return lines


def _reach_x(reach: float) -> float:
    """Where a reach in tokens falls on the bucket axis (bucket i spans i - 0.5 .. i + 0.5, log scale
    inside a bucket; the open last bucket is drawn up to 4x its lower edge)."""
    for i, (lo, hi) in enumerate(BUCKET_RANGES[1:]):
        top = (hi + 1) if hi is not None else 4 * lo
        if reach < top or hi is None:
            frac = (math.log(max(reach, lo)) - math.log(lo)) / (math.log(top) - math.log(lo))
            return i - 0.5 + min(frac, 1.0)
    return len(BUCKETS) - 1.5


def plot_distance_nll(
    series: list[tuple[Job, dict[str, Any]]], path: Path, title: str, colors: dict, corpus: str = ""
) -> bool:
    """One corpus's figure (module docstring): mean NLL per bucket, one line per job of ``series``
    ((job, distance_buckets) pairs), (a) and (b) side by side, reaches marked; False when empty."""
    if not series:
        return False
    labels = [f"{j.label} ({job_model(j)})" for j, _ in series]
    ncol, extra = legend_layout(labels, 13)
    fig = figure(13, 5.4 + extra)
    axes = fig.subplots(1, 2, sharey=True)
    far = len(BUCKETS) - 0.4  # the first-occurrence bucket, apart from the distances
    for ax, (kind, heading) in zip(axes, KINDS.items()):
        for (j, db), lab in zip(series, labels):
            color = colors[j.name]
            ys = [bucket_loss(db, kind, b) for b in BUCKETS[1:]]
            xs = [i for i, y in enumerate(ys) if y is not None]
            ax.plot(xs, [ys[i] for i in xs], marker="o", markersize=4, linewidth=1.6, color=color, label=lab)
            first = bucket_loss(db, kind, BUCKETS[0])
            if first is not None:
                ax.plot([far], [first], marker="s", markersize=6, color=color)
            for key, style in (("reach_tokens", "--"), ("layer_reach_tokens", ":")):
                if isinstance(db.get(key), (int, float)):
                    ax.axvline(_reach_x(db[key]), color=color, linestyle=style, linewidth=1.2, alpha=0.8)
        ax.set_xticks([*range(len(BUCKETS) - 1), far], [*BUCKETS[1:], "first\noccurrence"], fontsize=8)
        ax.set_xlim(-0.6, far + 0.6)
        ax.set_xlabel("distance to the previous occurrence in the stream (tokens)")
        ax.set_title(heading, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("mean NLL (nats), lower is better")
    split = "/".join(sorted({str(db.get("split")) for _, db in series}))
    suptitle(
        fig,
        f"Loss by distance to the previous occurrence, {corpus} ({split} split); dashed: reach m + N·L + L, "
        f"dotted: n_layer·m + L: {title}",
    )
    legend(fig, axes[0] if ncol == 0 else list(axes), ncol)
    fig.savefig(path)
    return True


def plot_distance_seeds(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """The figure of one (corpus, ``txl`` configuration) group of :func:`distance_seed_table` rows
    (module docstring): per analysis, the mean difference to that configuration per bucket with
    +-2 standard errors; False when no configuration but the baseline itself is in ``rows``."""
    rows = [r for r in rows if r["baseline"] not in (None, r["configuration"])]
    if not rows:
        return False
    corpus = rows[0]["corpus"]
    confs = list(dict.fromkeys(r["configuration"] for r in rows))
    base = set(rows[0]["baseline"].split())  # label a configuration by the overrides the baseline lacks
    labels = [" ".join(o for o in c.split() if o not in base) or c for c in confs]
    labels = [
        f"{lab} ({next(r['seeds'] for r in rows if r['configuration'] == c)} seeds)"
        for lab, c in zip(labels, confs)
    ]
    ncol, extra = legend_layout(labels, 13)
    fig = figure(13, 5.4 + extra)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (kind, heading) in zip(axes, KINDS.items()):
        for i, (conf, lab) in enumerate(zip(confs, labels)):
            r = next(r for r in rows if r["configuration"] == conf and r["analysis"] == kind)
            pts = [
                (x, r[f"diff_{b}"], r[f"se_{b}"]) for x, b in enumerate(BUCKETS) if r[f"diff_{b}"] is not None
            ]
            shift = 0.08 * (i - (len(confs) - 1) / 2)  # side by side, so that the bars do not overlap
            ax.errorbar(
                [x + shift for x, _, _ in pts],
                [y for _, y, _ in pts],
                yerr=[2 * (e or 0.0) for _, _, e in pts],
                marker="o",
                markersize=4,
                capsize=3,
                linewidth=1.4,
                label=lab,
            )
        ax.axhline(0.0, color="black", linewidth=1.0)
        ax.set_xticks(range(len(BUCKETS)), ["first\noccurrence", *BUCKETS[1:]], fontsize=8)
        ax.set_xlabel("distance to the previous occurrence in the stream (tokens)")
        ax.set_title(heading, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel(f"mean NLL minus {BASELINE}'s (nats), +-2 standard errors")
    suptitle(
        fig, f"Loss by distance across seeds, {corpus}: minus {BASELINE} ({rows[0]['baseline']}): {title}"
    )
    legend(fig, axes[0] if ncol == 0 else list(axes), ncol)
    fig.savefig(path)
    return True


def file_part(corpus: str) -> str:
    """A corpus name as part of a file name (every run of other characters than letters, digits,
    ``_``, ``.`` and ``-`` becomes ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", corpus)


def distance_plots(jobs: list[Job], title: str, colors: dict) -> list[tuple[str, Any]]:
    """(file name, maker(path) -> bool) of each corpus's figures, for :func:`crtn.report.write_report`."""
    makers = []
    for corpus, series in by_corpus(jobs).items():
        name = f"distance_nll_{file_part(corpus)}.png"
        makers.append(
            (name, lambda p, s=series, c=corpus: plot_distance_nll(s, p, title, colors=colors, corpus=c))
        )
    _, rows = distance_seed_table(jobs)
    count: dict[str, int] = {}
    for (corpus, base), group in group_rows(rows, "corpus", "baseline").items():
        if base is None:
            continue
        count[corpus] = count.get(corpus, 0) + 1  # a second txl configuration of the corpus: _2, ...
        name = f"distance_seeds_{file_part(corpus)}"
        name += f"_{count[corpus]}.png" if count[corpus] > 1 else ".png"
        makers.append((name, lambda p, g=group: plot_distance_seeds(g, p, title)))
    return makers
