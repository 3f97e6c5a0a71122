"""FlexAttention (``model.flex``) and compiled layers (``train.compile``) against the eager model on
a GPU: agreement and speed.

    python tools/gpu_attention_check.py --out flex_check.md [--rounds 20] [--warmup 6]

Needs only torch (and numpy, which ``crtn.model`` imports) and this repository on ``PYTHONPATH``:
the models are built from :mod:`crtn.model.spec` directly, without Hydra. Builds a ``txl`` and a
``crtn`` model at the benchmark's sizes (4 layers, d_model 256, 4 heads of 64, d_inner 1024,
vocabulary 256; batch 64, tgt_len = mem_len = 64; crtn: ``--n-slot`` slots and otherwise
``model=crtn``'s cache, :class:`crtn.model.spec.CacheSpec`'s defaults) and, for each, copies with
the same parameters: eager, ``model.flex`` (FlexAttention over memory and segment; retrieved rows
keep the eager path) and ``compiled`` (every decoder layer through ``torch.compile``, as
``train.compile`` does; ``--compile-backend``, default inductor). Training mode, dropout 0.

1. Agreement, in float32 (TF32 products off, so that the check sees the paths' own error and
   not TF32's rounding) and under bf16 autocast: ``--check-steps`` segments (memory and cache
   filling) forward and backward from a fresh state; the largest |NLL difference| (nats, any
   token, any step) and, for a few parameters, the largest |gradient difference| divided by the
   largest |gradient| (accumulated over the steps), each path against the eager model in the
   same precision, with a tolerance: float32 1e-4 nats and 1e-3; bf16 twice bf16's own error
   (the eager bf16 model against the eager float32 one, printed), at least float32's.
2. Speed, with TF32 products (as tools/gpu_measure.sh runs the apps): after ``--warmup``
   rounds (compilation, memory and cache full), ``--rounds`` rounds in which each path runs one
   forward+backward step (mean NLL) in turn, the order rotating every round; per path the
   median wall time (CUDA synchronised), the speed-up over eager, tokens/s and the peak memory
   a step allocates beyond what is held before it.

Prints one Markdown table (one row per model, precision and path) and writes it, with the
device and settings above it, to ``--out``. Exit status 1 when a check is over its tolerance or
a path fails (its row says why; the traceback goes to stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from crtn.model import TransformerLM, build_model, resolve_spec
from crtn.model.spec import CacheSpec, ModelSpec, Spec

PATHS = ("eager", "flex", "compiled")
PRECISIONS = ("float32", "bf16")
#: float32's tolerance (NLL nats, relative gradient); bf16's is twice its own error, at least this
TOLERANCE = (1e-4, 1e-3)
#: parameters whose gradients are compared (the attention's, including W_{k,R}, u and v, which
#: reach the loss only through the position term)
GRADS = (
    "r_w_bias",
    "r_r_bias",
    "layers.0.dec_attn.qkv_net.weight",
    "layers.0.dec_attn.r_net.weight",
    "layers.{top}.dec_attn.r_net.weight",
    "layers.{top}.pos_ff.CoreNet.0.weight",
    "word_emb.emb_layers.0.weight",
)


@dataclass
class Row:
    model: str
    precision: str
    path: str
    d_nll: float | None = None
    d_grad: float | None = None
    times: list[float] = field(default_factory=list)
    peak: int = 0
    error: str | None = None
    tol: tuple[float, float] = TOLERANCE

    def ok(self) -> bool:
        if self.error is not None:
            return False
        if self.d_nll is None:
            return True
        tol_nll, tol_grad = self.tol
        return self.d_nll <= tol_nll and self.d_grad <= tol_grad


def make_models(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, TransformerLM]:
    """The eager model and its flex twin (same parameters) on ``device``, training mode."""
    model = ModelSpec(
        name=name,
        n_layer=args.n_layer,
        n_head=args.n_head,
        d_model=args.d_model,
        d_head=args.d_model // args.n_head,
        d_inner=4 * args.d_model,
        tgt_len=args.tgt_len,
        mem_len=args.tgt_len,
    )
    cache = CacheSpec(n_slot=args.n_slot)
    torch.manual_seed(0)
    eager = build_model(resolve_spec(Spec(model=model, cache=cache)), args.vocab).to(device).train()
    out = {"eager": eager}
    for path in args.paths[1:]:
        spec = Spec(model=replace(model, flex=path == "flex"), cache=cache)
        twin = build_model(resolve_spec(spec), args.vocab).to(device).train()
        twin.load_state_dict(eager.state_dict())
        out[path] = twin.compile_layers(backend=args.compile_backend) if path == "compiled" else twin
    return out


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def segments(tokens: torch.Tensor, L: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive (input, target) segments of ``tokens`` [B, T], cycling."""
    n = (tokens.shape[1] - 1) // L
    t = 0
    while True:
        s = (t % n) * L
        yield tokens[:, s : s + L], tokens[:, s + 1 : s + L + 1]
        t += 1


def run_steps(model: TransformerLM, tokens: torch.Tensor, steps: int, precision: str) -> tuple[list, dict]:
    """``steps`` forward+backward steps from a fresh state: per-step NLL [B, L] (float32) and the
    accumulated gradients of :data:`GRADS`."""
    model.zero_grad(set_to_none=True)
    device = tokens.device
    state, nlls = None, []
    it = segments(tokens, model.tgt_len)
    for _ in range(steps):
        x, y = next(it)
        with autocast(precision, device):
            out = model(x, y, state)
        out.nll.float().mean().backward()
        state = out.state
        nlls.append(out.nll.detach().float())
    params = dict(model.named_parameters())
    names = [g.format(top=model.n_layer - 1) for g in GRADS]
    return nlls, {n: params[n].grad.detach().float().clone() for n in names}


def check(models: dict, tokens: torch.Tensor, args: argparse.Namespace, rows: dict) -> str:
    """Fill each row's d_nll and d_grad against the eager model of the same precision, TF32
    products off (:func:`exact_float32`); returns the line comparing eager bf16 with eager float32."""
    ref32, noise = None, ""
    with exact_float32():
        for precision in PRECISIONS:
            ref = run_steps(models["eager"], tokens, args.check_steps, precision)
            if precision == "float32":
                ref32 = ref
            else:
                d_nll, d_grad = differences(ref, ref32)
                noise = (
                    f"eager bf16 against eager float32 (bf16's own error): NLL {d_nll:.2e}, grad {d_grad:.2e}"
                )
                tol = (max(TOLERANCE[0], 2 * d_nll), max(TOLERANCE[1], 2 * d_grad))
            for path in args.paths[1:]:
                row = rows[precision, path]
                row.tol = TOLERANCE if precision == "float32" else tol
                try:
                    row.d_nll, row.d_grad = differences(
                        run_steps(models[path], tokens, args.check_steps, precision), ref
                    )
                except Exception as e:  # reported in the table; the other paths still run
                    row.error = fail(e)
    return noise


@contextlib.contextmanager
def exact_float32() -> Iterator[None]:
    """TF32 products off (matmul and cuDNN) inside, restored after."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def differences(got: tuple[list, dict], ref: tuple[list, dict]) -> tuple[float, float]:
    """(max |NLL difference| over steps and tokens, max over parameters of max|dg| / max|g|)."""
    d_nll = max((a - b).abs().max().item() for a, b in zip(got[0], ref[0]))
    d_grad = max(
        (got[1][n] - g).abs().max().item() / max(g.abs().max().item(), 1e-30) for n, g in ref[1].items()
    )
    return d_nll, d_grad


def time_paths(
    models: dict, tokens: torch.Tensor, args: argparse.Namespace, precision: str, rows: dict
) -> None:
    """Alternating forward+backward steps of every path: each row's times (s) and peak (bytes)."""
    device = tokens.device
    live = [p for p in args.paths if rows[precision, p].error is None]
    states = {p: None for p in live}
    its = {p: segments(tokens, models[p].tgt_len) for p in live}
    for r in range(args.warmup + args.rounds):
        order = live[r % len(live) :] + live[: r % len(live)]
        for path in order:
            model, row = models[path], rows[precision, path]
            if row.error is not None:
                continue
            x, y = next(its[path])
            try:
                sync(device)
                held = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                with autocast(precision, device):
                    out = model(x, y, states[path])
                out.nll.float().mean().backward()
                sync(device)
                dt = time.perf_counter() - t0
            except Exception as e:
                row.error = fail(e)
                continue
            model.zero_grad(set_to_none=True)
            states[path] = out.state
            if r >= args.warmup:
                row.times.append(dt)
                if device.type == "cuda":
                    row.peak = max(row.peak, torch.cuda.max_memory_allocated(device) - held)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fail(e: Exception) -> str:
    traceback.print_exc(file=sys.stderr)
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:120]


def table(rows: dict, tokens_per_step: int) -> str:
    head = (
        "| model | precision | path | ms/step (median) | vs eager | tokens/s | peak step MiB "
        "| max abs dNLL (nats) | max rel dgrad | tolerance | ok |"
    )
    lines = [head, "|" + "---|" * 11]
    for (model, precision, path), row in rows.items():
        eager = rows[model, precision, "eager"]
        ms = statistics.median(row.times) * 1e3 if row.times else None
        ms_eager = statistics.median(eager.times) * 1e3 if eager.times else None
        speed = f"{ms_eager / ms:.2f}x" if ms and ms_eager else "-"
        tol = "-" if path == "eager" else "{:.1e} / {:.1e}".format(*row.tol)
        cells = [
            model,
            precision,
            path,
            f"{ms:.2f}" if ms else "-",
            speed,
            f"{tokens_per_step / ms * 1e3:,.0f}" if ms else "-",
            f"{row.peak / 2**20:.0f}" if row.peak else "-",
            "-" if row.d_nll is None else f"{row.d_nll:.2e}",
            "-" if row.d_grad is None else f"{row.d_grad:.2e}",
            tol,
            ("yes" if row.ok() else "**no**") + (f" ({row.error})" if row.error else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="Markdown file for the table")
    p.add_argument("--device", default="cuda")
    p.add_argument("--models", nargs="+", default=["txl", "crtn"])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--tgt-len", type=int, default=64, help="tgt_len = mem_len")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--n-slot", type=int, default=8)
    p.add_argument("--check-steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=6)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--paths", nargs="+", choices=PATHS[1:], default=list(PATHS[1:]), help="besides eager")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile's backend for 'compiled'")
    args = p.parse_args(argv)
    args.paths = ["eager", *args.paths]
    # timing with TF32 products, as gpu_measure.sh runs the apps (the checks turn them off)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    device = torch.device(args.device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, 64 * args.tgt_len + 1), generator=g).to(device)
    rows: dict[tuple[str, str, str], Row] = {}
    notes = []
    for name in args.models:
        print(f"{name}: building and checking", flush=True)
        models = make_models(name, args, device)
        per = {(pr, pa): Row(name, pr, pa) for pr in PRECISIONS for pa in args.paths}
        notes.append(f"- {name}: {check(models, tokens, args, per)}")
        for precision in PRECISIONS:
            print(f"{name} {precision}: timing", flush=True)
            time_paths(models, tokens, args, precision, per)
        rows.update({(name, pr, pa): row for (pr, pa), row in per.items()})
        del models
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    header = (
        f"FlexAttention check: {gpu}, torch {torch.__version__}; batch {args.batch}, tgt_len = mem_len = "
        f"{args.tgt_len}, {args.n_layer} layers, d_model {args.d_model}, {args.n_head} heads, vocabulary "
        f"{args.vocab}, crtn {args.n_slot} slots and model=crtn's cache; agreement over {args.check_steps} steps "
        "with TF32 off; "
        f"median of {args.rounds} rounds after {args.warmup}; TF32 matmul "
        f"{torch.backends.cuda.matmul.allow_tf32}.\n\n"
    )
    text = header + table(rows, args.batch * args.tgt_len) + "\n\n" + "\n".join(notes) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0 if all(row.ok() for row in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
