"""``crtn-report``: what the cache itself contributes, by distance to the previous occurrence.

Two trained models differ in their weights as well as in their cache, and at CPU and small GPU
sizes the seed moves their loss by more than the cache does (docs/results.md). The same
weights evaluated with and without their cache have no such noise: where ``crtn-eval`` jobs
evaluated one checkpoint on the same tokens once with ``eval.n_slot=0`` (an empty cache, so the
model reads only its Transformer-XL memory; docs/method.md §5) and with caches of other sizes,
the difference of their ``distance_buckets`` (:mod:`crtn.analysis.distance`) is the cache's own
effect on each bucket (docs/method.md §5, "What the cache contributes"). This is the same-model
ablation of distant context of Sun et al. (2021), "Do Long-Range Language Models Actually Use
Long-Range Context?", with the cache as the distant context.

- ``cache_effect.csv`` and a section of ``report.md``: per checkpoint, split, eval-time ``n_slot``
  and analysis (``symbol`` / ``ngram``, :data:`crtn.report.distance.KINDS`), the change of the
  split's mean loss (``total``, nats per token), and per bucket the share of the split's tokens
  (``share_<bucket>``), the change of the bucket's mean NLL (``diff_<bucket>``, nats) and its
  *contribution* to the total, ``diff_<bucket> * share_<bucket>``. The buckets partition the
  split's tokens, so the contributions add up to ``total``: a large gain on a rare bucket shows
  as a small contribution.
- ``cache_effect_<corpus>.png``: ``diff_<bucket>`` per bucket, one line per checkpoint and
  ``n_slot``, (a) and (b) side by side.

Jobs are matched by corpus, checkpoint (as given to ``crtn-eval``), split, ``tgt_len``,
``mem_len`` and the number of tokens evaluated; a group without an ``n_slot=0`` job gets no row.
Training jobs do not take part: their final evaluation used the trained cache only. The sweep
that makes the groups::

    crtn-eval -m checkpoint=RUN/checkpoints/best.pt eval.n_slot=0,32,128,512 'splits=[test]'
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from crtn.analysis.distance import BUCKETS
from crtn.report.distance import KINDS, bucket_loss, file_part, group_rows
from crtn.report.jobs import Job
from crtn.report.plots import figure, legend, legend_layout, suptitle

#: the eval-time cache size of the reference evaluation: an empty cache
EMPTY = 0


def effect_groups(jobs: list[Job]) -> dict[tuple, list[tuple[Job, dict[str, Any]]]]:
    """Finished ``crtn-eval`` jobs with ``distance_buckets``, grouped by (corpus, checkpoint, split,
    tgt_len, mem_len, tokens); only groups with an ``n_slot=0`` job and at least one other, the
    ``n_slot=0`` job first, the others by ``n_slot``."""
    groups: dict[tuple, list[tuple[int, Job, dict[str, Any]]]] = {}
    for j in jobs:
        fin = j.final() or {}
        db, n_slot = fin.get("distance_buckets"), j.eval_setting("n_slot")
        if j.kind != "eval" or j.status != "done" or not isinstance(db, dict) or not isinstance(n_slot, int):
            continue
        if not all(isinstance(db.get(k), dict) for k in KINDS):
            continue
        key = (str(db.get("corpus")), str(j.checkpoint), str(db.get("split")))
        key += (j.eval_setting("tgt_len"), j.eval_setting("mem_len"), fin.get("tokens"))
        groups.setdefault(key, []).append((n_slot, j, db))
    out = {}
    for key, members in groups.items():
        members.sort(key=lambda m: (m[0] != EMPTY, m[0]))
        if members[0][0] == EMPTY and len(members) >= 2:
            out[key] = [(j, db) for _, j, db in members]
    return out


def cache_effect_table(jobs: list[Job]) -> tuple[list[str], list[dict[str, Any]]]:
    """Columns and rows of ``cache_effect.csv`` (module docstring): corpus, checkpoint, split,
    job, n_slot, top_k, analysis, reference (the ``n_slot=0`` job), total, then per bucket
    ``share_<bucket>`` (fraction of the split's tokens), ``diff_<bucket>`` (nats) and
    ``contrib_<bucket>`` (nats per token of the split). A bucket that either job lacks is empty."""
    cols = ["corpus", "checkpoint", "split", "job", "n_slot", "top_k", "analysis", "reference", "total"]
    cols += [f"{p}_{b}" for b in BUCKETS for p in ("share", "diff", "contrib")]
    rows = []
    for (corpus, checkpoint, split, *_), ((ref, ref_db), *others) in effect_groups(jobs).items():
        for j, db in others:
            for kind in KINDS:
                row: dict[str, Any] = {"corpus": corpus, "checkpoint": checkpoint, "split": split}
                row.update(job=j.name, n_slot=j.eval_setting("n_slot"), top_k=j.eval_setting("top_k"))
                row.update(analysis=kind, reference=ref.name)
                row["total"] = j.final().get("loss", math.nan) - ref.final().get("loss", math.nan)
                n_all = sum((db[kind].get(b) or {}).get("tokens") or 0 for b in BUCKETS)
                for b in BUCKETS:
                    mine, theirs = bucket_loss(db, kind, b), bucket_loss(ref_db, kind, b)
                    n = (db[kind].get(b) or {}).get("tokens")
                    share = n / n_all if isinstance(n, int) and n_all else None
                    diff = mine - theirs if mine is not None and theirs is not None else None
                    row[f"share_{b}"] = share
                    row[f"diff_{b}"] = diff
                    row[f"contrib_{b}"] = diff * share if diff is not None and share is not None else None
                rows.append(row)
    return cols, rows


def cache_effect_markdown(jobs: list[Job]) -> list[str]:
    """report.md's section: per checkpoint and split, the share of tokens of each bucket and, per
    eval-time ``n_slot``, the bucket's NLL change and the total change against the empty cache."""
    _, rows = cache_effect_table(jobs)
    if not rows:
        return []
    lines = [
        "## What the cache contributes, same weights (`cache_effect.csv`)",
        "",
        "One checkpoint evaluated with its cache and with an empty one (`eval.n_slot=0`): per bucket of the "
        "distance to the previous occurrence, the mean NLL with the cache minus without it (nats; negative: "
        "the cache helps), and the change of the split's mean loss (total). Each bucket adds its change times "
        "its share of the tokens to the total (`contrib_*` in the CSV).",
        "",
    ]
    for (checkpoint, split), group in group_rows(rows, "checkpoint", "split").items():
        lines += [f"### {checkpoint} ({split} split; reference: job {group[0]['reference']})", ""]
        lines.append("| job | n_slot | analysis | total | " + " | ".join(BUCKETS) + " |")
        lines.append("|---|---:|---|---:|" + "---:|" * len(BUCKETS))
        for kind in KINDS:
            first = next(r for r in group if r["analysis"] == kind)
            shares = [_cell(first[f"share_{b}"], "{:.1%}") for b in BUCKETS]
            lines.append(f"| share of tokens | | {kind} | | " + " | ".join(shares) + " |")
        for r in group:
            cells = [_cell(r[f"diff_{b}"], "{:+.4f}") for b in BUCKETS]
            lines.append(
                f"| {r['job']} | {r['n_slot']} | {r['analysis']} | {_cell(r['total'], '{:+.4f}')} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    return lines


def _cell(v: float | None, fmt: str) -> str:
    return "" if v is None or v != v else fmt.format(v)


def plot_cache_effect(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """One corpus's figure (module docstring) from its :func:`cache_effect_table` rows; False when
    there are none."""
    if not rows:
        return False
    series = list(dict.fromkeys((r["checkpoint"], r["split"], r["n_slot"]) for r in rows))
    many = len({s[0] for s in series}) > 1
    labels = [f"{Path(c).parent.parent.name + ', ' if many else ''}n_slot={n} ({s})" for c, s, n in series]
    ncol, extra = legend_layout(labels, 13)
    fig = figure(13, 5.4 + extra)
    axes = fig.subplots(1, 2, sharey=True)
    for ax, (kind, heading) in zip(axes, KINDS.items()):
        for key, lab in zip(series, labels):
            r = next(
                r for r in rows if (r["checkpoint"], r["split"], r["n_slot"]) == key and r["analysis"] == kind
            )
            pts = [(x, r[f"diff_{b}"]) for x, b in enumerate(BUCKETS) if r[f"diff_{b}"] is not None]
            ax.plot(
                [x for x, _ in pts], [y for _, y in pts], marker="o", markersize=4, linewidth=1.5, label=lab
            )
        ax.axhline(0.0, color="black", linewidth=1.0)
        ax.set_xticks(range(len(BUCKETS)), ["first\noccurrence", *BUCKETS[1:]], fontsize=8)
        ax.set_xlabel("distance to the previous occurrence in the stream (tokens)")
        ax.set_title(heading, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("mean NLL with the cache minus with an empty cache (nats)")
    suptitle(fig, f"What the cache contributes (same weights), {rows[0]['corpus']}: {title}")
    legend(fig, axes[0] if ncol == 0 else list(axes), ncol)
    fig.savefig(path)
    return True


def cache_effect_plots(jobs: list[Job], title: str) -> list[tuple[str, Any]]:
    """(file name, maker(path) -> bool) of each corpus's figure, for :func:`crtn.report.write_report`."""
    _, rows = cache_effect_table(jobs)
    corpora = dict.fromkeys(r["corpus"] for r in rows)
    return [
        (
            f"cache_effect_{file_part(c)}.png",
            lambda p, rs=[r for r in rows if r["corpus"] == c]: plot_cache_effect(rs, p, title),
        )
        for c in corpora
    ]
