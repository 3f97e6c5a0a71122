"""The plots of ``crtn-report`` (matplotlib, imported when a plot is drawn)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

from crtn.model import dependency_range
from crtn.report.jobs import METRIC_LABEL, Job, fmt_metric, read_yaml, short
from crtn.report.tables import eval_sort_key, metrics_of


def figure(w: float, h: float):
    """A matplotlib Figure on the Agg canvas (no pyplot: no global state, no display needed)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), dpi=110, layout="constrained")


def colors_of(jobs: list[Job]) -> dict[str, Any]:
    """One colour per job, the same in every plot."""
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if len(jobs) <= 10 else "tab20"]
    return {j.name: cmap(i % cmap.N) for i, j in enumerate(jobs)}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def status_suffix(j: Job) -> str:
    return "" if j.status == "done" else f" ({j.status.split(':')[0]})"


def suptitle(fig, text: str) -> None:
    """Figure title, wrapped to the figure width."""
    width = int(fig.get_figwidth() * 11)
    fig.suptitle(textwrap.fill(text, width), fontsize=11)


def legend_layout(labels: list[str], width: float) -> tuple[int, float]:
    """(columns, extra figure height in inches) of a legend below the plots; (0, 0) for a few
    entries, which go inside the axes. Columns are as many as fit the figure width."""
    if len(labels) <= 6:
        return 0, 0.0
    chars = max(len(lab) for lab in labels) + 6
    ncol = max(1, min(3, int(width * 14 // chars)))
    return ncol, 0.2 + 0.19 * math.ceil(len(labels) / ncol)


def legend(fig, ax, ncol: int) -> None:
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


def value_axis(ax, values: list[Any], log_ok: bool, bars: bool = False) -> bool:
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
    metrics = metrics_of(jobs)
    max_elapsed = max((r["elapsed"] for j in jobs for r in j.metrics if _is_num(r.get("elapsed"))), default=0)
    unit, div = (
        ("s", 1.0) if max_elapsed < 120 else ("min", 60.0) if max_elapsed < 3 * 3600 else ("h", 3600.0)
    )
    ncol, extra = legend_layout([j.label + status_suffix(j) for j in jobs], 12)
    fig = figure(12, 4.6 * len(metrics) + extra)
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
            axes[row][0].plot([r.get("step") for r in recs], y, label=j.label + status_suffix(j), **style)
            timed = [r for r in recs if _is_num(r.get("elapsed"))]
            axes[row][1].plot([r["elapsed"] / div for r in timed], [r[f"valid_{m}"] for r in timed], **style)
        for col, ax in enumerate(axes[row]):
            log_y = value_axis(ax, values, log_ok=m == "ppl")
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
    suptitle(fig, f"Validation {' / '.join(metrics)} during training (lower is better): {title}")
    if ncol == 0:
        for row in axes:
            legend(fig, row[0], 0)
    else:
        legend(fig, axes[:, 0].tolist(), ncol)
    fig.savefig(path)
    return True


def plot_test_bars(jobs: list[Job], path: Path, title: str, colors: dict[str, Any]) -> bool:
    """Horizontal bars of the final test metric per training job; jobs without one are named."""
    jobs = [j for j in jobs if j.kind == "train"]
    if not any(isinstance((j.results or {}).get("test"), dict) for j in jobs):
        return False
    metrics = metrics_of([j for j in jobs if j.results])
    panels = [(m, [j for j in jobs if j.metric == m]) for m in metrics]
    fig = figure(10, 1.0 + sum(0.9 + 0.42 * len(shown) for _, shown in panels))
    axes = fig.subplots(len(panels), 1, squeeze=False, height_ratios=[0.9 + 0.42 * len(s) for _, s in panels])
    for ax, (m, shown) in zip(axes[:, 0], panels):
        vals = [((j.results or {}).get("test") or {}).get(m) for j in shown]
        finite = [v for v in vals if isinstance(v, (int, float))]
        top = max(finite) if finite else 1.0
        for y, (j, v) in enumerate(zip(shown, vals)):
            if isinstance(v, (int, float)):
                ax.barh(y, v, color=colors[j.name], height=0.7)
                ax.text(v + top * 0.01, y, fmt_metric(v, m), va="center", fontsize=9)
            else:
                ax.text(top * 0.01, y, f"no test result ({j.status})", va="center", fontsize=9, color="0.35")
        ax.set_yticks(
            range(len(shown)), [textwrap.shorten(j.label, 60, placeholder="…") for j in shown], fontsize=9
        )
        ax.set_ylim(len(shown) - 0.5, -0.5)
        ax.set_xlim(0, top * 1.18)
        ax.set_xlabel(f"test {METRIC_LABEL[m]}, lower is better")
        ax.grid(True, axis="x", alpha=0.3)
    suptitle(fig, f"Final test {' / '.join(metrics)} per job (best checkpoint by validation): {title}")
    fig.savefig(path)
    return True


def distance_series(jobs: list[Job]) -> list[tuple[Job, str, list[int], int, float | None]]:
    """The lines of :func:`plot_distance_hist`: per job with retrieval statistics ``(job, layer
    label, distance_hist, seg_len, mean distance in tokens)``; where the job's evaluation reports
    each retrieving layer (``retrieval.layers``, selection inside attention) one line per layer,
    bottom first, labelled ``layer i of n`` (the last is the top-level statistics' layer), else one
    line labelled ``""``."""
    series = []
    for j in jobs:
        ret = (j.final() or {}).get("retrieval") or {}
        layers = ret.get("layers")
        parts = (
            [(f"layer {i + 1} of {len(layers)}", r) for i, r in enumerate(layers)] if layers else [("", ret)]
        )
        for name, r in parts:
            hist, seg = r.get("distance_hist"), ret.get("seg_len")
            if isinstance(hist, list) and hist and isinstance(seg, (int, float)) and sum(hist) > 0:
                series.append((j, name, hist, int(seg), r.get("mean_distance_tokens")))
    return series


def plot_distance_hist(jobs: list[Job], path: Path, title: str, colors: dict[str, Any]) -> bool:
    """Fraction of cache selections per distance (tokens) of the selected segment: one line per
    job, or per retrieving layer of a job that reports them (:func:`distance_series`; the layers
    in the job's colour, one line style each)."""
    series = distance_series(jobs)
    if not series:
        return False
    first = min(next(i for i, c in enumerate(h) if c) for _, _, h, _, _ in series)
    labels = [
        j.label
        + (f", retrieving {name}" if name else "")
        + (f" (mean {m:,.0f} tokens)" if isinstance(m, (int, float)) else "")
        for j, name, _, _, m in series
    ]
    ncol, extra = legend_layout(labels, 10)
    fig = figure(10, 5.2 + extra)
    ax = fig.subplots()
    styles = ("-", "--", ":", "-.")
    layer_of: dict[str, int] = {}
    for (j, _layer, hist, seg, _), lab in zip(series, labels):
        layer_of[j.name] = layer_of.get(j.name, -1) + 1  # the job's how-many-th line
        total = sum(hist)
        xs = [d * seg for d in range(first, len(hist))]
        ys = [c / total for c in hist[first:]]
        marker = {"marker": "o", "markersize": 4} if len(xs) <= 40 else {}
        ls = styles[layer_of[j.name] % len(styles)]
        ax.plot(xs, ys, linewidth=1.5, color=colors[j.name], linestyle=ls, label=lab, **marker)
    ax.set_xlabel("distance of the selected segment (tokens = segments back × seg_len)")
    ax.set_ylabel("fraction of cache selections")
    ax.set_ylim(0, None)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.08)
    ax.grid(True, alpha=0.3)
    splits = "/".join(sorted({str(j.final_split()) for j, *_ in series}))
    suptitle(fig, f"CRTN retrieval: distance of the selected cache segments ({splits} split): {title}")
    legend(fig, ax, ncol)
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
    ncol, extra = legend_layout([j.label for j, _ in series], fig_w)
    fig = figure(fig_w, 5.2 + extra)
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
    log_y = value_axis(ax, values, log_ok=True, bars=True)
    ax.set_xlabel("occurrences of the target word in the training split (bucket)")
    splits = "/".join(sorted({str(j.final_split()) for j, _ in series}))
    ax.set_ylabel(f"{splits} perplexity" + (" (log scale)" if log_y else "") + ", lower is better")
    ax.grid(True, axis="y", which="both", alpha=0.3)
    suptitle(fig, f"Perplexity by word frequency ({splits} split): {title}")
    legend(fig, ax, ncol)
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
    fig = figure(min(16, max(10, 2.0 + 1.4 * n)), 6.0 if n <= 4 else 7.5)
    ax_p, ax_a = fig.subplots(1, 2)
    ppl_values = _recall_bars(ax_p, ax_a, series)
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
    log_y = value_axis(ax_p, ppl_values, log_ok=True, bars=True)
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
    suptitle(fig, f"Passage recall ({splits} split): {title}")
    fig.savefig(path)
    return True


def _recall_bars(ax_p: Any, ax_a: Any, series: list[tuple[Job, dict[str, Any]]]) -> list[float]:
    """Bars of repeat and fresh perplexity (``ax_p``, with the Markov source's as black ticks) and
    accuracy (``ax_a``) per job; returns the perplexities drawn (for the y scale)."""
    n = len(series)
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
    return ppl_values


def plot_cache_extension(jobs: list[Job], path: Path, title: str) -> bool:
    """Eval jobs: metric of the final split against eval-time n_slot, one line per checkpoint/setting."""
    import matplotlib

    jobs = [j for j in jobs if j.kind == "eval" and isinstance((j.final() or {}).get("n_slot"), int)]
    if not jobs:
        return False
    metrics = metrics_of(jobs)
    groups: dict[tuple, list[Job]] = {}
    for j in sorted(jobs, key=eval_sort_key):
        fin = j.final() or {}
        key = (fin.get("top_k"), fin.get("tgt_len"), fin.get("mem_len"), (j.eval or {}).get("checkpoint"))
        groups.setdefault(key, []).append(j)
    cmap = matplotlib.colormaps["tab10"]
    fig = figure(9, 5.4 * len(metrics))
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
                lab = f"{short(str(ckpt), 40)}: {lab}"
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
                    fmt_metric(y, m),
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
        log_y = value_axis(ax, values, log_ok=m == "ppl")
        ax.set_xlabel("cache slots N at evaluation (eval.n_slot); below: range m + N·L in tokens")
        ax.set_ylabel(f"{split} {METRIC_LABEL[m]}" + (" (log scale)" if log_y else "") + ", lower is better")
        ax.grid(True, alpha=0.3)
        right = _plot_retrieval_axis(ax, groups, m, cmap)
        handles, labels = ax.get_legend_handles_labels()
        if right is not None:
            h2, l2 = right.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        ax.legend(handles, labels, fontsize=8, loc="best")
    suptitle(fig, f"Eval-time cache extension ({split} split): {title}")
    fig.savefig(path)
    return True


def retrieval_quality(fin: dict) -> tuple[str, float] | None:
    """What an eval job says of its retrieval: on the passage-recall corpus the
    fraction of repeat tokens whose copy source, or another copy of the same text, was retrieved
    (older evaluations: the source only), elsewhere the mean alpha mass per token. (label, value), or None when the job has neither."""
    rep = fin.get("repeat") or {}
    copy = rep.get("copy_retrieved")  # the source or another copy of the same text
    if isinstance(copy, (int, float)):
        return "source or a copy retrieved", float(copy)
    src = rep.get("source_retrieved")
    if isinstance(src, (int, float)):
        return "copy source retrieved", float(src)
    mass = (fin.get("retrieval") or {}).get("alpha_mass_mean")
    if isinstance(mass, (int, float)):
        return "alpha mass per token", float(mass)
    return None


def _plot_retrieval_axis(ax, groups: dict, metric: str, cmap):
    """Retrieval quality against n_slot on a right-hand axis (dashed, squares); the axis or None."""
    right, label = None, None
    for g_i, members in enumerate(groups.values()):
        pts = []
        for j in members:
            q = retrieval_quality(j.final() or {}) if j.metric == metric else None
            if q is not None:
                label = q[0]
                pts.append((j.final()["n_slot"], q[1]))
        if not pts:
            continue
        right = right or ax.twinx()
        right.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker="s",
            linestyle="--",
            linewidth=1.4,
            color=cmap(g_i % 10),
            alpha=0.8,
            label=f"{label} (right axis)",
        )
    if right is not None:
        right.set_ylabel(f"{label} (dashed), higher is better")
        if label in ("copy source retrieved", "source or a copy retrieved"):
            right.set_ylim(0, 1.02)
    return right


def _n_tick(n: int, jobs: list[Job]) -> str:
    ranges = set()
    for j in jobs:
        fin = j.final() or {}
        if (
            fin.get("n_slot") == n
            and isinstance(fin.get("tgt_len"), int)
            and isinstance(fin.get("mem_len"), int)
        ):
            ranges.add(dependency_range(fin["mem_len"], n, fin["tgt_len"]))
    return f"{n}\n({ranges.pop():,})" if len(ranges) == 1 else str(n)


def _trained_n_slot(jobs: list[Job]) -> list[tuple[int, str]]:
    """(cache.n_slot, checkpoint) of the training runs whose checkpoints were evaluated, if found."""
    out = []
    for ckpt in sorted({str((j.eval or {}).get("checkpoint")) for j in jobs}):
        cfg_file = Path(ckpt).parent.parent / ".hydra" / "config.yaml"
        try:
            n = read_yaml(cfg_file.read_text())["cache"]["n_slot"]
        except Exception:  # noqa: BLE001 - optional decoration: any problem means "unknown"
            continue
        if isinstance(n, int):
            out.append((n, ckpt))
    return out
