"""Training-step (or evaluation-step) time of cost-table rows against Transformer-XL, with the
retrieved attention grouped by slot (docs/method.md §3, "Efficient main pass") and, with
``--before COMMIT``, also with that commit's attention layer, retrieved attention, row match, top-k and grouped products
(:data:`SWAPS`: ``RelPartialLearnableMultiHeadAttn.forward`` of ``crtn/model/attention.py``,
``attend_with_cache`` and ``CacheContext.slot_groups`` (the pairs' form) of ``crtn/model/retrieved.py``,
``Gate._row_scores`` and ``Gate.select`` of ``crtn/model/gate.py``, ``ngram_row_scores`` of
``crtn/model/rowmatch.py``, ``SegmentCache._top`` of ``crtn/model/cache.py``,
``SlotGroups.to_rows``, ``from_rows``, ``_chunk`` and ``_TileProduct.backward`` of ``crtn/model/grouped.py``; a row match
from before the lead-in was named by slot gets the lead-in rows gathered, as the cache gathered
them then, and grouped products from before ``cache.product_dtype`` multiply in the operands'
dtype, as they did),
every case alternating in one process, so the ratios are side by side on the same machine
state. The process flushes denormal floats to zero and keeps freed memory as the apps do
(``crtn.utils``).

    OMP_NUM_THREADS=1 python tools/bench_grouped.py --before 6181d9f
    OMP_NUM_THREADS=2 python tools/bench_grouped.py --rows row_match,row_match_n1024 --before bba2a90
    OMP_NUM_THREADS=1 python tools/bench_grouped.py --rows ngram8,gate_token_max_layers2 --profile
    OMP_NUM_THREADS=2 python tools/bench_grouped.py --rows ngram8 --rounds 1 --products
    python tools/bench_grouped.py --device cuda --batch 64 --rows default --rounds 9 --profile

Rows (``--rows``, comma-separated; :data:`ROWS`) at ``crtn-bench``'s standard sizes
(``bench.*``, crtn/config.py): memory and cache filled by real steps as in ``crtn-bench``, then
``--rounds`` timed training steps of each case in turn (median), then the FLOPs of one more
step's matrix products of each (``crtn.bench.cases.step_flops``). ``--profile`` prints the
``torch.profiler`` top operators (self CPU time) of 3 steps per case and, per step, the
operators where each case spends more than Transformer-XL (:func:`difference`); with
``--device cuda`` also the kernels by GPU time, how much of each step the GPU is busy (the
kernels' time over the step's wall time) and how many kernels a step launches; ``--peak``
each case's peak step memory as ``crtn-bench`` measures it; ``--eval`` evaluation steps
instead (no optimiser, forward only under ``torch.no_grad``, as ``crtn-eval`` runs); ``--faults``
each case's page faults and step over the first and the last quarter of the rounds
(:func:`print_faults`: whether the heap's growth weighs on the ratios); ``--copies K`` builds K identical
cases of every row (Transformer-XL's too, named ``ROW_copy1``, ...), made after the others and
timed in the same alternation: the spread between them is what one process's side-by-side
ratios can resolve (docs/results.md, "What one process's side-by-side ratios resolve"); ``--products`` each case's matrix
products of one step by operator and factor shapes, with their FLOPs and rates
(:func:`products_by_shape`: where the count above comes from). Run it from a git checkout
(``--before`` reads the old module with ``git show``), or give ``--before`` a folder holding the
old commit's files where the checkout has no history (a GPU machine's copy):

    git archive 6f25120 crtn | tar -x -C .before && python tools/bench_grouped.py --before .before
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

import crtn.bench.cases as cases_module
import crtn.model.attention as attention
import crtn.model.gate as gate
import crtn.model.summary as summary
from crtn.app_config import BenchSpec
from crtn.bench import bench_device
from crtn.bench.cases import Stepper, make_case, step_flops, step_peak, sync
from crtn.bench.compare import compose_rows
from crtn.model.cache import SegmentCache
from crtn.model.grouped import SlotGroups, _TileProduct
from crtn.model.retrieved import CacheContext
from crtn.model.rowmatch import LeadIn
from crtn.utils import flush_denormals, tune_allocator

ROOT = Path(__file__).resolve().parents[1]
#: the 4-gram row match of the token's own state (``query=token``) with the default cache: the
#: cost table's ``row_match`` row, whose overrides the variants below extend
ROW_MATCH = BenchSpec().rows["row_match"]
#: ``crtn-bench``'s table rows, and more: ``row_match_all`` (the row match with alpha below 1),
#: ``k1_all`` (the row match, one slot at alpha below 1 in every layer), ``ngram8`` (exact 8-gram
#: retrieval in every layer), ``ngram8_layers2`` (the same in the default's two retrieving layers,
#: keys at layer 0), ``default_n1024`` / ``row_match_n1024`` (the default, the lookup of the
#: preceding tokens, and the row match with crtn-bench's large cache, ``bench.n_slot_large``) and
#: ``row_match_float32`` / ``row_match_float32_n1024`` (the row match with the cache stored in
#: float32) and ``row_match_products_float32`` (the row match's bfloat16 rows multiplied in float32)
#: and ``crtn_original_detach`` (the CRTN authors' model with its query pass run forward only) and
#: ``txl_range`` (Transformer-XL whose memory covers the default's range) and ``row_match_concat`` /
#: ``row_match_concat_n1024`` / ``ngram8_layers2_concat`` (the retrieved rows placed by the
#: concatenated context alone, ``cache.pos=concat``, not by their slot's best-matching row too)
#: exact 8-gram retrieval in the default's two layers, keys at layer 0
NGRAM8_LAYERS2 = [
    *ROW_MATCH,
    "cache.key_layer=0",
    "summary.ngram=8",
    "summary.cosine=true",
    "cache.top_k=1",
    "cache.alpha_norm=topk",
]
ROWS = {
    **BenchSpec().rows,
    "row_match_all": [*ROW_MATCH, "cache.alpha_norm=all"],
    "default_n1024": ["model=crtn", f"cache.n_slot={BenchSpec().n_slot_large}"],
    "row_match_n1024": [*ROW_MATCH, f"cache.n_slot={BenchSpec().n_slot_large}"],
    "row_match_concat": [*ROW_MATCH, "cache.pos=concat"],
    "row_match_concat_n1024": [*ROW_MATCH, "cache.pos=concat", f"cache.n_slot={BenchSpec().n_slot_large}"],
    "row_match_float32": [*ROW_MATCH, "cache.dtype=float32"],
    "row_match_float32_n1024": [
        *ROW_MATCH,
        "cache.dtype=float32",
        f"cache.n_slot={BenchSpec().n_slot_large}",
    ],
    "row_match_products_float32": [*ROW_MATCH, "cache.product_dtype=float32"],
    "k1_all": [*ROW_MATCH, "cache.layers=null", "cache.alpha_norm=all"],
    "ngram8": [
        *ROW_MATCH,
        "cache.layers=null",
        "cache.key_layer=0",
        "summary.ngram=8",
        "summary.cosine=true",
        "cache.top_k=1",
        "cache.alpha_norm=topk",
    ],
    "ngram8_layers2": NGRAM8_LAYERS2,
    "ngram8_layers2_concat": [*NGRAM8_LAYERS2, "cache.pos=concat"],
    "crtn_original_detach": ["model=crtn_original", "query.detach=true"],
    # Transformer-XL over the default's whole range, m + N L tokens of memory (crtn-bench's
    # same-range reference): the default's tokens/s against it is the inverse of the step ratio
    "txl_range": ["model=txl", f"model.mem_len={BenchSpec().tgt_len * (1 + BenchSpec().n_slot)}"],
}


#: what ``--before`` replaces: (file, attribute of it, [(module, name) it is read through])
SWAPS = [
    (
        "crtn/model/attention.py",
        "RelPartialLearnableMultiHeadAttn.forward",
        [(attention.RelPartialLearnableMultiHeadAttn, "forward")],
    ),
    ("crtn/model/retrieved.py", "attend_with_cache", [(attention, "attend_with_cache")]),
    ("crtn/model/retrieved.py", "CacheContext.slot_groups", [(CacheContext, "slot_groups")]),
    (
        "crtn/model/rowmatch.py",
        "ngram_row_scores",
        [(summary, "ngram_row_scores"), (gate, "ngram_row_scores")],
    ),
    ("crtn/model/cache.py", "SegmentCache._top", [(SegmentCache, "_top")]),
    ("crtn/model/gate.py", "Gate._row_scores", [(gate.Gate, "_row_scores")]),
    ("crtn/model/gate.py", "Gate.select", [(gate.Gate, "select")]),
    ("crtn/model/grouped.py", "SlotGroups.to_rows", [(SlotGroups, "to_rows")]),
    ("crtn/model/grouped.py", "SlotGroups.from_rows", [(SlotGroups, "from_rows")]),
    ("crtn/model/grouped.py", "SlotGroups._chunk", [(SlotGroups, "_chunk")]),
    ("crtn/model/grouped.py", "_TileProduct.backward", [(_TileProduct, "backward")]),
]


def old_module(commit: str, path: str):
    """The module at ``path`` as it was at ``commit`` (loaded under a name of its own); ``commit``
    may also be a folder holding that commit's files (``git archive COMMIT crtn | tar -x -C
    FOLDER``), for a machine whose copy of the repository has no history.

    Raises:
        FileNotFoundError: ``commit`` is a folder without ``path``.
        subprocess.CalledProcessError: ``git show`` found no ``path`` at ``commit``.
    """
    folder = Path(commit)
    if folder.is_dir():
        text = (folder / path).read_text()
    else:
        text = subprocess.run(
            ["git", "show", f"{commit}:{path}"],
            cwd=ROOT,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    name = Path(path).stem + "_before"
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


#: steps per case under the profiler (``--profile``)
PROFILE_STEPS = 3
#: the matrix products :func:`products_by_shape` lists: operator -> index of its first factor among
#: its inputs (``addmm`` and ``baddbmm`` take the term they add first)
PRODUCT_OPS = {"aten::mm": 0, "aten::bmm": 0, "aten::addmm": 1, "aten::baddbmm": 1}


def products_by_shape(fn) -> dict[tuple[str, str], list[float]]:
    """The matrix products that ``fn()`` runs, grouped by operator and factor shapes:
    (operator, "[A] x [B]") -> [calls, FLOPs, CPU ms]. FLOPs are two per multiply-add from the
    shapes ([m, k] x [k, n]: 2 m k n; batched: times b; the added term of ``addmm`` not counted),
    as ``crtn.bench.cases.step_flops`` counts them, so the FLOPs sum to its count of the same
    work; the time is each call's CPU time under ``torch.profiler`` (the device's is not waited
    for). Which products a step's shapes are is read from the model: at the standard sizes,
    for example, [4, 1024, 64] x [4, 64, 256] is the queries' folding (``retrieved.py``)."""
    with profile(record_shapes=True) as prof:
        fn()
    out: dict[tuple[str, str], list[float]] = {}
    for e in prof.events():
        if e.name not in PRODUCT_OPS:
            continue
        a, b = e.input_shapes[PRODUCT_OPS[e.name] :][:2]
        flops = 2 * math.prod(a) * b[-1]
        entry = out.setdefault((e.name, f"{a} x {b}"), [0, 0, 0.0])
        entry[0] += 1
        entry[1] += flops
        entry[2] += e.cpu_time_total / 1e3
    return out


def print_products(name: str, table: dict[tuple[str, str], list[float]]) -> None:
    """:func:`products_by_shape`'s table of case ``name``, most FLOPs first, with each group's rate."""
    total = sum(v[1] for v in table.values())
    print(f"===== products of one step of {name}: {total / 1e9:.2f} GFLOP", flush=True)
    print("operator | factors | calls | GFLOP | ms | GFLOP/s")
    for (op, shapes), (calls, flops, ms) in sorted(table.items(), key=lambda kv: -kv[1][1]):
        print(f"{op} | {shapes} | {calls} | {flops / 1e9:.3f} | {ms:.1f} | {flops / 1e6 / max(ms, 1e-3):.0f}")


def _row_match_as_then(before, then: type | None):
    """A row match of another commit, given the lead-in as that commit takes it: its own
    :class:`LeadIn` class (``then``), or, from before the lead-in was named by slot (``then``
    None), the rows gathered as the cache gathered them then (``LeadIn.rows``); from before the
    match took ``cosine``, the rows normalised in the query's dtype first, as the summary did then;
    from before it took ``top_k``, every slot's best row, as it gave them then."""
    takes = inspect.signature(before).parameters
    takes_cosine = "cosine" in takes

    def row_scores(query, rows, lead, *, cosine=False, **kw):
        kw = {k: v for k, v in kw.items() if k in takes}
        if takes_cosine:
            kw["cosine"] = cosine
        elif cosine:
            rows = F.normalize(rows.to(query.dtype), dim=-1)
            lead = F.normalize(lead.to(query.dtype), dim=-1) if isinstance(lead, torch.Tensor) else lead
        if isinstance(lead, LeadIn):
            lead = lead.rows(rows) if then is None else then(lead.pred, lead.found, lead.n)
        return before(query, rows, lead, **kw)

    return row_scores


def _products_as_then(before):
    """A grouped product (``to_rows`` or ``from_rows``) of another commit, called as today's
    :class:`crtn.model.grouped._TileProduct` calls it: from before the products had a dtype of
    their own, it ignores ``dtype`` and multiplies in the operands' dtype, as it did then."""
    if "dtype" in inspect.signature(before).parameters:
        return before

    def product(self, x, values, *, normalize, eps, dtype):
        return before(self, x, values, normalize=normalize, eps=eps)

    return product


def _delegate(module, path: str) -> None:
    """Point the globals of ``module`` (an older copy of ``path``) that a swap replaces in today's
    module of the same file (``attend_with_cache`` in ``attention.py``, ``ngram_row_scores`` in
    ``gate.py``) at today's module, read at each call: the older code then calls the version
    being timed, not the function its own file imported when it was loaded."""
    for _, _, holders in SWAPS:
        for holder, name in holders:
            same_file = (
                inspect.ismodule(holder) and Path(holder.__file__).resolve() == (ROOT / path).resolve()
            )
            if same_file and hasattr(module, name):
                setattr(module, name, lambda *a, _h=holder, _n=name, **k: getattr(_h, _n)(*a, **k))


def implementations(commit: str | None) -> dict[str, list[tuple[object, str, object]]]:
    """Per version ("" now, "_before" at ``commit``), the (holder, name, value) settings of :data:`SWAPS`."""
    out: dict[str, list[tuple[object, str, object]]] = {"": []}
    for path, attr, holders in SWAPS:
        out[""] += [(h, n, getattr(h, n)) for h, n in holders]
        if not commit:
            continue
        try:
            value = module = old_module(commit, path)
            for part in attr.split("."):
                value = getattr(value, part)
        except (subprocess.CalledProcessError, FileNotFoundError, AttributeError):  # not there yet
            print(f"--before {commit}: no {attr} in {path}; that part is today's", flush=True)
            value = None
        if value is not None:
            _delegate(module, path)
        if attr == "ngram_row_scores" and value is not None:
            value = _row_match_as_then(value, getattr(module, "LeadIn", None))
        if attr in ("SlotGroups.to_rows", "SlotGroups.from_rows") and value is not None:
            value = _products_as_then(value)
        before = out.setdefault("_before", [])
        before += [(h, n, getattr(h, n) if value is None else value) for h, n in holders]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rows", default="default,paper_cache,crtn_original,gate_token_max,gate_token_max_layers2,ngram8"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before", default=None, help="also time each row with this commit's SWAPS")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--products", action="store_true", help="each step's matrix products by shape")
    ap.add_argument(
        "--peak", action="store_true", help="peak step memory of each case (the profiler's trace)"
    )
    ap.add_argument(
        "--random-fill", action="store_true", help="2 slots by real steps, the rest random states"
    )
    ap.add_argument("--eval", action="store_true", help="evaluation steps (no gradient) instead of training")
    ap.add_argument(
        "--faults",
        action="store_true",
        help="page faults and step time, first and last quarter of the rounds",
    )
    ap.add_argument(
        "--copies",
        type=int,
        default=1,
        help="identical cases of each row (txl included): the spread of the harness",
    )
    ap.add_argument("--device", default="cpu", help="cpu or cuda (bench.device)")
    ap.add_argument("--batch", type=int, default=BenchSpec().batch, help="streams a step (bench.batch)")
    a = ap.parse_args()
    # as every app's job does (crtn.app.run_app), before the first tensor
    flush_denormals()
    tune_allocator()
    if a.random_fill:
        cases_module.REAL_FILL_SLOTS = 2
    names = ["txl", *a.rows.split(",")]
    s = BenchSpec(rows={n: ROWS[n] for n in names}, batch=a.batch, device=a.device)
    rows = compose_rows(s)
    dev = bench_device(a.device)
    train = not a.eval
    cases = [make_case(r.name, r.spec, s, device=dev, train=train) for r in rows]
    versions = implementations(a.before)
    if a.before:  # txl's layer too
        cases += [make_case(r.name + "_before", r.spec, s, device=dev, train=train) for r in rows]
    cases += [
        make_case(f"{r.name}_copy{i}", r.spec, s, device=dev, train=train)
        for r in rows
        for i in range(1, a.copies)
    ]
    stepper = Stepper(dev, amp=False)

    def use(c) -> None:
        for holder, name, value in versions["_before" if c.name.endswith("_before") else ""]:
            setattr(holder, name, value)

    def step(c) -> None:
        use(c)
        stepper(c)
        sync(dev)

    for c in cases:
        use(c)
        stepper.fill(c)
        step(c)
    for c in cases:
        c.faults = []  # minor page faults of each timed step, beside c.times
    for _ in range(a.rounds):
        for c in cases:
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            step(c)
            c.times.append(time.perf_counter() - t)
            c.faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    by_name = {c.name: c for c in cases}

    def txl_of(c):  # a version's rows against the same version's Transformer-XL
        return by_name["txl_before" if c.name.endswith("_before") else "txl"]

    for c in cases:
        m = statistics.median(c.times)
        print(
            f"{c.name:24s} {1000 * m:9.1f} ms  {m / statistics.median(txl_of(c).times):5.2f}x txl", flush=True
        )
    if a.faults:
        print_faults(cases, txl_of)
    for c in cases:  # the arithmetic beside the time: one more step of each, counted (txl first)
        c.flops = step_flops(lambda c=c: step(c))
        print(
            f"products {c.name:15s} {c.flops / 1e9:9.2f} GFLOP {c.flops / txl_of(c).flops:5.2f}x txl",
            flush=True,
        )
    if a.products:
        for c in cases:
            print_products(c.name, products_by_shape(lambda c=c: step(c)))
    if a.peak:
        for c in cases:
            peak = step_peak(lambda c=c: step(c), dev)
            print(f"peak {c.name:19s} {peak / 2**20:9.1f} MB", flush=True)
    if a.profile:
        cuda = dev.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        per_step, device_ms = {}, {}
        for c in cases:
            with profile(activities=activities) as prof:
                for _ in range(PROFILE_STEPS):
                    step(c)
            events = prof.key_averages()
            print(f"===== {c.name}\n" + events.table(sort_by="self_cpu_time_total", row_limit=15))
            per_step[c.name] = {e.key: (e.self_cpu_time_total / 1e3, e.count) for e in events}
            if cuda:
                print(events.table(sort_by="self_device_time_total", row_limit=15))
                kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
                busy = sum(e.self_device_time_total for e in kernels) / 1e3 / PROFILE_STEPS
                launches = sum(e.count for e in kernels) / PROFILE_STEPS
                device_ms[c.name] = {e.key: (e.self_device_time_total / 1e3, e.count) for e in kernels}
                m = 1000 * statistics.median(c.times)
                print(
                    f"{c.name}: GPU busy {busy:.1f} ms of a {m:.1f} ms step ({busy / m:.0%}),"
                    f" {launches:.0f} kernels a step",
                    flush=True,
                )
        for c in cases[1:]:
            print(difference(per_step[c.name], per_step[cases[0].name], c.name))
            if cuda:
                print(difference(device_ms[c.name], device_ms[cases[0].name], c.name, "GPU"))
    sys.stdout.flush()


def print_faults(cases: list, txl_of) -> None:
    """``--faults``: per case, the median minor page faults of a step (pages the process touched
    for the first time: the heap growing) and the median step over the first and the last quarter
    of the rounds, its ratio to its Transformer-XL's over the same rounds; then the process's
    resident size. Where the heap stops growing, the faults fall to about zero and the last
    quarter's ratio is the steady state a long training run sees (``crtn.utils.tune_allocator``)."""
    n = len(cases[0].times)
    q = max(1, n // 4)
    for c in cases:
        f, t, ref = c.faults, c.times, txl_of(c).times
        parts = []
        for name, span in (("first", slice(0, q)), ("last", slice(n - q, n))):
            m, m_ref = statistics.median(t[span]), statistics.median(ref[span])
            parts.append(
                f"{name} {q}: {statistics.median(f[span]):7.0f} faults {1000 * m:7.1f} ms {m / m_ref:5.2f}x txl"
            )
        print(f"faults {c.name:17s} " + " | ".join(parts), flush=True)
    pages = int(Path("/proc/self/statm").read_text().split()[1]) if Path("/proc/self/statm").exists() else 0
    print(f"resident size {pages * resource.getpagesize() / 2**20:.0f} MB", flush=True)


def difference(
    case: dict[str, tuple[float, int]], ref: dict[str, tuple[float, int]], name: str, unit: str = "CPU"
) -> str:
    """Where a case's step spends more than Transformer-XL's: per operator, self ``unit`` (CPU or
    GPU) ms and calls per step (of :data:`PROFILE_STEPS` profiled), the case's minus the
    reference's, largest first. ``case`` and ``ref``: operator -> (self ms, calls) over the
    profiled steps."""
    n = PROFILE_STEPS
    ops = sorted(set(case) | set(ref), key=lambda k: ref.get(k, (0, 0))[0] - case.get(k, (0, 0))[0])
    total = (sum(v[0] for v in case.values()) - sum(v[0] for v in ref.values())) / n
    lines = [f"===== {name} - txl, per step: self {unit} {total:+.1f} ms", "operator | ms | calls"]
    for k in ops[:12]:
        (t, calls), (t0, calls0) = case.get(k, (0.0, 0)), ref.get(k, (0.0, 0))
        lines.append(f"{k} | {(t - t0) / n:+.1f} | {(calls - calls0) / n:+.0f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
