"""``crtn-report``'s report (``report.md`` with the tables and plots) and its command line."""

from __future__ import annotations

import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from crtn.errors import UserError
from crtn.report.budget import budget_markdown, budget_plots, equal_time_table, equal_tokens_table
from crtn.report.cache_effect import cache_effect_markdown, cache_effect_plots, cache_effect_table
from crtn.report.distance import (
    distance_markdown,
    distance_plots,
    distance_seed_markdown,
    distance_seed_table,
    distance_table,
)
from crtn.report.jobs import METRIC_LABEL, Job, common_overrides, load_jobs, short
from crtn.report.plots import (
    colors_of,
    plot_cache_extension,
    plot_distance_hist,
    plot_freq_buckets,
    plot_recall,
    plot_test_bars,
    plot_valid_curves,
)
from crtn.report.tables import (
    SEARCH_KEY,
    SEED_KEY,
    eval_table,
    markdown_table,
    metrics_of,
    search_table,
    seed_table,
    train_table,
    write_csv,
)

PROG = "crtn-report"


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
    tables = [  # (file, report.md section or None, (columns, rows) or None)
        ("report.csv", "train", train_table(train) if train else None),
        ("cache_extension.csv", "eval", eval_table(evals) if evals else None),
        ("distance_nll.csv", None, distance_table(jobs)[:2]),
        ("distance_seeds.csv", None, distance_seed_table(jobs)),
        ("cache_effect.csv", None, cache_effect_table(jobs)),
        ("equal_time.csv", None, equal_time_table(jobs)),
        ("equal_tokens.csv", None, equal_tokens_table(jobs)),
        ("search.csv", "search", search_table(train)),
        ("seeds.csv", "seeds", seed_table(train)),
    ]
    for name, kind, table in tables:
        if table is None or not table[1]:
            continue
        write_csv(out_dir / name, *table)
        written[name] = out_dir / name
        if kind is not None:
            sections.append((kind, *table))

    pngs: list[str] = []
    if plots:
        colors = colors_of(jobs)
        makers = [
            ("valid_curves.png", lambda p: plot_valid_curves(train, p, title, colors)),
            ("test_bars.png", lambda p: plot_test_bars(train, p, title, colors)),
            ("distance_hist.png", lambda p: plot_distance_hist(jobs, p, title, colors)),
            ("freq_buckets.png", lambda p: plot_freq_buckets(jobs, p, title, colors)),
            ("recall.png", lambda p: plot_recall(jobs, p, title)),
            ("cache_extension.png", lambda p: plot_cache_extension(evals, p, title)),
            *distance_plots(jobs, title, colors),
            *cache_effect_plots(jobs, title),
            *budget_plots(train, title, colors),
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
_DISTANCE_TEXT = (
    "Mean NLL by distance to the previous occurrence of the target in its stream (symbol, longest n-gram); "
    "dashed: each job's reach m + N·L + L, dotted: n_layer·m + L (models without a cache)."
)
_DISTANCE_SEEDS_TEXT = (
    "Across seeds: mean NLL per distance bucket minus the txl configuration's, bars of plus and minus two "
    "standard errors of the difference."
)


_CACHE_EFFECT_TEXT = (
    "Same weights: mean NLL per distance bucket with the cache minus with an empty cache (eval.n_slot=0), "
    "one line per evaluated cache size."
)


_BUDGET_TEXT = (
    "Validation metric during training against elapsed time (dotted: the shared budget, train.max_time) "
    "and against training tokens (dotted: the last step every job validated at); dashed: jobs that did not finish."
)


def _plot_text(name: str) -> str:
    if name.startswith("equal_budget"):
        return _BUDGET_TEXT
    if name.startswith("distance_seeds_"):
        return _DISTANCE_SEEDS_TEXT
    if name.startswith("cache_effect_"):
        return _CACHE_EFFECT_TEXT
    return _DISTANCE_TEXT if name.startswith("distance_nll_") else _PLOT_TEXT[name]


#: report.md's heading and text of the tables that reduce groups of jobs: the best of each
#: search (:func:`crtn.report.tables.search_table`) and across seeds (:func:`~crtn.report.tables.seed_table`)
_GROUPED = {
    "search": (
        f"## Best of each search (`search.csv`): `{SEARCH_KEY}` chosen by validation",
        f"Jobs that differ only in `{SEARCH_KEY}` form one search; each row is the search's best job by "
        "validation loss (valid/test as in the training table), and every value it tried with its "
        "validation metric.",
    ),
    "seeds": (
        f"## Across seeds (`seeds.csv`): one configuration, several values of `{SEED_KEY}`",
        f"Jobs that differ only in `{SEED_KEY}` form one configuration; each row gives the mean and the "
        "sample standard deviation of its valid and test metric over the seeds, and each seed's test "
        "metric. Differences between configurations smaller than these deviations are noise.",
    ),
}


def _markdown(jobs: list[Job], sections: list, title: str, pngs: list[str]) -> str:
    """report.md: a summary line, the tables (with the overrides common to all jobs), the plots."""
    counts = Counter(j.status.split(":")[0] for j in jobs)
    summary = ", ".join(f"{n} {s}" for s, n in counts.most_common())
    lines = [
        f"# crtn report: {title}",
        "",
        f"{len(jobs)} job{'s' if len(jobs) != 1 else ''} ({summary}); written {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
    ]
    for kind, cols, rows in sections:
        if kind in _GROUPED:
            heading, text = _GROUPED[kind]
            lines += [heading, "", text, "", markdown_table(cols, rows, {}), ""]
            continue
        group = [j for j in jobs if j.kind == kind]
        varying = {j.name: [short(o, 60) for o in j.varying] for j in group}
        if kind == "train":
            metrics = ", ".join(f"{m} = {METRIC_LABEL[m].split(' (')[0]}" for m in metrics_of(group))
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
                "tokens (docs/method.md §5)."
                + (
                    " `<key>_r<i>`: retrieving layer i's, bottom first (without `_r<i>`: the top layer's)."
                    if any(c.endswith("_r1") for c in cols)
                    else ""
                ),
                "",
            ]
        lines.append(markdown_table(cols, rows, varying))
        common = common_overrides(group)
        if common and len(group) > 1:
            lines += ["", "Overrides common to all jobs: `" + " ".join(common) + "`"]
        lines.append("")
    lines += distance_markdown(jobs)
    lines += distance_seed_markdown(jobs)
    lines += cache_effect_markdown(jobs)
    lines += budget_markdown(jobs)
    for name in pngs:
        lines += [f"![{name}]({name})", "", _plot_text(name), ""]
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
            skip = (
                line.strip() == ""
                or line in _PLOT_TEXT.values()
                or line in (_DISTANCE_TEXT, _DISTANCE_SEEDS_TEXT)
            )
            if skip:
                continue
        out.append(line)
    return "\n".join(out).rstrip() + "\n"
