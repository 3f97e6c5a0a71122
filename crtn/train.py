"""``crtn-train``: train vanilla / Transformer-XL / CRTN language models (a Hydra app).

    crtn-train                                   # crtn on the synthetic passage-recall task
    crtn-train model=txl data=ptb data.root=...  # any model x corpus; see conf/
    crtn-train -m query=last_l,token             # Hydra multirun sweep

Everything a run produces goes into its Hydra run directory: ``.hydra/`` (the composed
config), ``train.log``, ``metrics.jsonl`` (one JSON record per log or evaluation event),
``checkpoints/last.pt`` and ``checkpoints/best.pt``, and ``results.json``.

Checkpoints hold the model, optimizer, scheduler, step, data position, the memory and
cache of every training stream, RNG states and the config, so a run that is killed
continues exactly where its last checkpoint left it (``crtn-train ... hydra.run.dir=DIR``
on the same directory; bit-identical losses on CPU). A non-finite loss stops the run
before anything is saved, so the last good checkpoint stays.

Training follows the Transformer-XL recipes (SPEC §5): Adam, linear warm-up then
cosine / inverse-sqrt / constant, gradient clipping, gradient accumulation over batch
chunks (``train.batch_chunk``; each chunk keeps its own streams' memory and cache).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from crtn.errors import CheckpointError, UserError

log = logging.getLogger("crtn.train")

# config sections that must match when a run resumes from its checkpoint
RESUME_SECTIONS = ("model", "data", "cache", "query", "summary", "optim", "seed")


class TrainingDiverged(UserError):
    """The training loss became NaN or infinite."""


@contextmanager
def report_user_errors(prog: str) -> Iterator[None]:
    """Print a :class:`UserError` as one line ``PROG: error: MESSAGE`` and exit with status 2.

    In a Hydra multirun the error is logged and re-raised instead, so that Hydra marks
    this job failed and the sweep's other jobs still run.
    """
    try:
        yield
    except UserError as e:
        logging.getLogger(prog).error("%s", e)
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if _in_multirun():
            raise
        sys.exit(2)


def _in_multirun() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # outside a Hydra app
        return False


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available).

    Raises:
        UserError: CUDA asked for but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device={name!r} but CUDA is not available (use device=cpu or auto)")
    return dev


def lr_factor(step: int, scheduler: str, warmup: int, max_step: int, eta_ratio: float) -> float:
    """Learning-rate multiplier after ``step`` optimizer steps (Transformer-XL release schedules).

    Linear warm-up over ``warmup`` steps, then ``cosine`` (to ``eta_ratio`` = eta_min / lr at
    ``max_step``), ``inv_sqrt`` (sqrt(warmup / step)) or ``constant``.
    """
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if scheduler == "cosine":
        span = max(1, max_step - warmup)
        progress = min(1.0, (step - warmup) / span)
        return eta_ratio + (1 - eta_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    if scheduler == "inv_sqrt":
        return math.sqrt(max(warmup, 1) / max(step, 1))
    return 1.0


class _Stop:
    """Set by SIGINT/SIGTERM: the loop stops at the next step boundary and checkpoints."""

    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:  # noqa: ARG002
        if self.signal is not None:  # second signal: give up at once
            raise KeyboardInterrupt
        self.signal = signum


def _catch_signals(stop: _Stop, stack: ExitStack) -> None:
    """Route SIGINT/SIGTERM to ``stop`` until ``stack`` closes (main thread only)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            old = signal.signal(sig, stop)
        except ValueError:  # not in the main thread (some launchers)
            return
        stack.callback(signal.signal, sig, old)


def _set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop records after ``max_step`` (they are re-done after a resume)."""
    if not path.exists():
        return
    keep = [
        line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= max_step
    ]
    path.write_text("".join(line + "\n" for line in keep))


def run_training(cfg: Any) -> dict[str, Any]:
    """Train a model as configured; returns the contents of ``results.json``.

    Raises:
        UserError: bad config, data or checkpoint (printed as one line by the CLI).
        TrainingDiverged: a non-finite training loss.
    """
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from crtn.checkpoint import config_mismatch, load_checkpoint, rng_state, save_checkpoint, set_rng_state
    from crtn.config import validate_train
    from crtn.data import load_corpus
    from crtn.distributed import DistributedContext
    from crtn.evaluate import eval_lengths, evaluate, format_metrics, metric_name

    validate_train(cfg)
    dist = DistributedContext.from_env(cfg.train.device)
    if not dist.is_main:  # rank 0 logs, evaluates and writes; the others only train
        logging.getLogger().setLevel(logging.WARNING)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    ckpt_dir = run_dir / "checkpoints"
    metrics_path = run_dir / "metrics.jsonl"
    device = dist.device if dist.enabled else resolve_device(cfg.train.device)
    _set_seed(cfg.seed)
    config_dict = OmegaConf.to_container(cfg, resolve=True)

    corpus = load_corpus(cfg.data)
    level = corpus.level
    mname = metric_name(level)
    train_it = corpus.iterator(
        "train",
        cfg.data.batch_size,
        cfg.model.tgt_len,
        drop_last=True,
        rank=dist.rank,
        world_size=dist.world_size,
    )
    eval_bs = cfg.eval.batch_size or cfg.data.eval_batch_size
    eval_tgt = cfg.eval.tgt_len or cfg.model.tgt_len
    for split in ("valid", "test"):  # fail now, not after hours of training
        corpus.iterator(split, eval_bs, eval_tgt)

    from crtn.model import build_model

    model = build_model(cfg, len(corpus.vocab)).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg.init_from:
        _init_from(model, cfg.init_from, corpus)
    optimizer = torch.optim.Adam(
        model.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), weight_decay=cfg.optim.weight_decay
    )
    o = cfg.optim
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: lr_factor(s, o.scheduler, o.warmup_step, cfg.train.max_step, o.eta_min / o.lr),
    )
    ddp_model = dist.wrap(model)

    chunks = cfg.train.batch_chunk
    chunk_bs = train_it.local_batch_size // chunks
    step = epoch = batch_index = 0
    best_valid, elapsed, tokens_seen = math.inf, 0.0, 0
    states = None
    last = ckpt_dir / "last.pt"
    if cfg.train.resume and last.exists():
        ckpt = load_checkpoint(last, map_location=device)
        diff = config_mismatch(ckpt["config"], config_dict, RESUME_SECTIONS)
        if diff:
            raise CheckpointError(
                f"cannot resume from {str(last)!r}: the config changed ({diff}); "
                "use a new run directory or the saved config"
            )
        n_states = len(ckpt.get("states") or [])
        if "optimizer" not in ckpt or n_states != dist.world_size or len(ckpt["states"][0]) != chunks:
            raise CheckpointError(
                f"cannot resume from {str(last)!r}: it was written by {n_states} process(es) with "
                f"another train.batch_chunk, or is not a training checkpoint; resume with the same setup"
            )
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        step, epoch, batch_index = ckpt["step"], ckpt["epoch"], ckpt["batch_index"]
        best_valid, elapsed, tokens_seen = ckpt["best_valid"], ckpt["elapsed"], ckpt["tokens_seen"]
        states = [model.load_state(sd, chunk_bs, device) for sd in ckpt["states"][dist.rank]]
        set_rng_state(ckpt["rng"])
        log.info("resumed from %s at step %d (epoch %d)", last, step, epoch)
    if dist.is_main:
        _truncate_jsonl(metrics_path, step)
    if states is None:
        states = [model.init_state(chunk_bs, device) for _ in range(chunks)]

    log.info(
        "model=%s params=%s data=%s (%s tokens train, vocab %d) device=%s world=%d",
        cfg.model.name,
        f"{n_params:,}",
        cfg.data.name,
        f"{corpus.splits['train'].numel():,}",
        len(corpus.vocab),
        device,
        dist.world_size,
    )
    if cfg.model.name == "crtn":
        log.info(
            "crtn: query=%s summary=%s n_slot=%d top_k=%d (range m+N*L = %d tokens)",
            cfg.query.strategy,
            cfg.summary.name,
            cfg.cache.n_slot,
            cfg.cache.top_k,
            cfg.model.mem_len + cfg.cache.n_slot * cfg.model.tgt_len,
        )

    def make_checkpoint(with_states: bool = True) -> dict[str, Any]:
        """The checkpoint payload; ``with_states`` gathers every rank's streams (a collective)."""
        all_states = None
        if with_states:
            all_states = dist.gather([_cpu(st.state_dict()) for st in states])
        return {
            "config": config_dict,
            "vocab": corpus.vocab.idx2sym,
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "epoch": epoch,
            "batch_index": batch_index,
            "states": all_states,
            "rng": rng_state(),
            "best_valid": best_valid,
            "elapsed": elapsed,
            "tokens_seen": tokens_seen,
            "n_params": n_params,
        }

    def run_eval(split: str, max_step: int | None) -> dict[str, Any]:
        with eval_lengths(model, cfg.eval):
            m = evaluate(model, corpus, split, eval_bs, device, max_step, progress=False)
        model.train()
        return m

    tb = _tensorboard(run_dir) if cfg.train.tensorboard and dist.is_main else None
    last_validated = -1
    best_metrics: dict[str, Any] | None = None  # full-split validation of best.pt, this process

    def validate() -> None:
        """Evaluate on valid, record it, and save best.pt when it improves (rank 0)."""
        nonlocal best_valid, elapsed, last_validated, best_metrics
        t_eval = time.perf_counter()
        m = run_eval("valid", cfg.train.eval_max_step)
        elapsed = time.perf_counter() - t_start
        rec = {"step": step, "valid_loss": m["loss"], f"valid_{mname}": m[mname], "elapsed": elapsed}
        for k in ("repeat", "fresh"):
            if k in m and "acc" in m[k]:
                rec[f"valid_{k}_ppl"], rec[f"valid_{k}_acc"] = m[k]["ppl"], m[k]["acc"]
        log.info("eval at step %d: %s (%.1fs)", step, format_metrics(m), time.perf_counter() - t_eval)
        _append_jsonl(metrics_path, rec)
        if tb:
            tb.add_scalar(f"valid/{mname}", m[mname], step)
        if m["loss"] < best_valid:
            best_valid = m["loss"]
            save_checkpoint(ckpt_dir / "best.pt", make_checkpoint(with_states=False))
            best_metrics = m if cfg.train.eval_max_step is None else None
        last_validated = step

    stop = _Stop()
    ckpt_interval = cfg.train.checkpoint_interval or cfg.train.eval_interval
    amp = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if cfg.train.amp and device.type == "cuda"
        else nullcontext()
    )
    tokens_per_step = cfg.data.batch_size * cfg.model.tgt_len
    loss_sum = torch.zeros((), device=device)
    loss_n = 0
    tokens_window, t_window = 0, time.perf_counter()
    t_start = time.perf_counter() - elapsed
    stopped_by = None
    show = cfg.train.progress and dist.is_main
    model.train()
    batches = train_it.iterate(batch_index)
    with ExitStack() as stack:
        _catch_signals(stop, stack)
        if show:
            stack.enter_context(logging_redirect_tqdm())
        bar = stack.enter_context(
            tqdm(
                total=cfg.train.max_step,
                initial=step,
                desc="train",
                dynamic_ncols=True,
                disable=not show,
                mininterval=1.0,
            )
        )
        while step < cfg.train.max_step:
            out_of_time = (
                cfg.train.max_time is not None and time.perf_counter() - t_start >= cfg.train.max_time
            )
            if dist.any(stop.signal is not None or out_of_time):  # every rank stops at the same step
                if stop.signal is not None:
                    stopped_by = f"signal {signal.Signals(stop.signal).name}"
                else:
                    stopped_by = (
                        "a signal on another rank"
                        if not out_of_time
                        else f"train.max_time={cfg.train.max_time}s"
                    )
                break
            batch = next(batches, None)
            if batch is None:  # end of an epoch: streams start again with empty memory
                epoch, batch_index = epoch + 1, 0
                batches = train_it.iterate(0)
                states = [model.init_state(chunk_bs, device) for _ in range(chunks)]
                continue
            batch_index = batch.index + 1
            x = batch.input.to(device, non_blocking=True)
            y = batch.target.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            for c in range(chunks):
                rows = slice(c * chunk_bs, (c + 1) * chunk_bs)
                with dist.no_sync(ddp_model, last=c == chunks - 1), amp:
                    out = ddp_model(x[rows], y[rows], states[c])
                    loss = out.nll.float().mean() / chunks
                loss.backward()
                states[c] = out.state
                loss_sum += loss.detach()
            loss_n += 1
            if o.clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
            optimizer.step()
            scheduler.step()
            step += 1
            tokens_seen += tokens_per_step
            tokens_window += tokens_per_step
            bar.update(1)

            if step % cfg.train.log_interval == 0 or step == cfg.train.max_step:
                train_loss = dist.mean(loss_sum).item() / loss_n
                if not math.isfinite(train_loss):
                    raise TrainingDiverged(
                        f"training loss became {train_loss} by step {step}; stopping. The last good "
                        f"checkpoint is {str(last)!r}" + ("" if last.exists() else " (none was written yet)")
                    )
                now = time.perf_counter()
                tok_s = tokens_window / (now - t_window)
                elapsed = now - t_start
                rec = {
                    "step": step,
                    "epoch": epoch,
                    "lr": scheduler.get_last_lr()[0],
                    "train_loss": train_loss,
                    f"train_{mname}": _metric(train_loss, level),
                    "tokens_per_s": tok_s,
                    "elapsed": elapsed,
                }
                if dist.is_main:
                    _append_jsonl(metrics_path, rec)
                    if tb:
                        tb.add_scalar("train/loss", train_loss, step)
                        tb.add_scalar("train/tokens_per_s", tok_s, step)
                bar.set_postfix_str(
                    f"loss {train_loss:.3f} {mname} {_metric(train_loss, level):.3f} tok/s {tok_s:,.0f}"
                )
                log.info(
                    "step %d | epoch %d | lr %.3g | loss %.4f | %s %.3f | %.0f tok/s | %.0fs",
                    step,
                    epoch,
                    rec["lr"],
                    train_loss,
                    mname,
                    rec[f"train_{mname}"],
                    tok_s,
                    elapsed,
                )
                loss_sum.zero_()
                loss_n = 0
                tokens_window, t_window = 0, time.perf_counter()

            if step % cfg.train.eval_interval == 0 and step < cfg.train.max_step and dist.is_main:
                validate()
                tokens_window, t_window = 0, time.perf_counter()
            if step % ckpt_interval == 0:
                _check_finite(loss_sum, loss_n, step, last)
                elapsed = time.perf_counter() - t_start
                payload = make_checkpoint()
                if dist.is_main:
                    save_checkpoint(last, payload)

    elapsed = time.perf_counter() - t_start
    if loss_n:
        _check_finite(loss_sum, loss_n, step, last)
    payload = make_checkpoint()
    if dist.is_main:
        save_checkpoint(last, payload)
    if stopped_by and stopped_by.startswith("signal"):
        log.warning("stopped by %s at step %d; checkpoint saved to %s", stopped_by, step, last)
        print(
            f"crtn-train: stopped by {stopped_by} at step {step}; resume with hydra.run.dir={run_dir}",
            file=sys.stderr,
        )
        sys.exit(130)
    if stopped_by:
        log.info("stopped at step %d by %s", step, stopped_by)

    if not dist.is_main:  # rank 0 evaluates and reports
        dist.close()
        return {}
    if last_validated != step and step > 0:  # the final weights compete for best.pt too
        validate()
    # final evaluation with the best weights (by validation loss), as in the Transformer-XL release
    final = {}
    best = ckpt_dir / "best.pt"
    if best.exists():
        model.load_state_dict(load_checkpoint(best, map_location=device)["model"])
    for split in ("valid", "test"):
        # best.pt's full validation from this process is exact (same weights, fresh memory)
        final[split] = (
            best_metrics if split == "valid" and best_metrics is not None else run_eval(split, None)
        )
        log.info("final %s", format_metrics(final[split]))
    train_time = elapsed
    results = {
        "model": cfg.model.name,
        "data": cfg.data.name,
        "metric": mname,
        "query": cfg.query.strategy if cfg.model.name == "crtn" else None,
        "summary": cfg.summary.name if cfg.model.name == "crtn" else None,
        "n_slot": cfg.cache.n_slot if cfg.model.name == "crtn" else None,
        "top_k": cfg.cache.top_k if cfg.model.name == "crtn" else None,
        "tgt_len": cfg.model.tgt_len,
        "mem_len": cfg.model.mem_len,
        "params": n_params,
        "steps": step,
        "epochs": epoch,
        "tokens_seen": tokens_seen,
        "train_time_s": train_time,
        "tokens_per_s": tokens_seen / train_time if train_time > 0 else None,
        "stopped_by": stopped_by or "train.max_step",
        "valid": {k: v for k, v in final["valid"].items() if not isinstance(v, torch.Tensor)},
        "test": {k: v for k, v in final["test"].items() if not isinstance(v, torch.Tensor)},
    }
    if dist.is_main:
        (run_dir / "results.json").write_text(json.dumps(results, indent=2))
        print(f"final {format_metrics(final['valid'])}", flush=True)
        print(f"final {format_metrics(final['test'])}", flush=True)
        print(
            f"params {n_params:,} | {step} steps | {results['tokens_per_s']:,.0f} tok/s | "
            f"{train_time:.0f}s | results in {run_dir}",
            flush=True,
        )
    if tb:
        tb.close()
    dist.close()
    return results


def _cpu(x: Any) -> Any:
    """Move the tensors of a (nested) state dict to the CPU, for gathering and saving."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def _metric(loss: float, level: str) -> float:
    from crtn.evaluate import metric_value

    return metric_value(loss, level)


def _check_finite(loss_sum: torch.Tensor, loss_n: int, step: int, last: Path) -> None:
    if loss_n and not torch.isfinite(loss_sum).item():
        raise TrainingDiverged(
            f"training loss became non-finite by step {step}; stopping without saving. The last good "
            f"checkpoint is {str(last)!r}" + ("" if last.exists() else " (none was written yet)")
        )


def _init_from(model: torch.nn.Module, path: str, corpus: Any) -> None:
    """Load weights from a crtn checkpoint (e.g. converted Transformer-XL); new parameters stay fresh."""
    from crtn.checkpoint import load_checkpoint

    ckpt = load_checkpoint(path)
    vocab = ckpt.get("vocab")
    if vocab is not None and list(vocab) != list(corpus.vocab.idx2sym):
        raise CheckpointError(
            f"init_from={path!r}: its vocabulary ({len(vocab)} symbols) differs from the corpus' "
            f"({len(corpus.vocab)}); train on the corpus the weights were made for"
        )
    own = model.state_dict()
    bad = [k for k, v in ckpt["model"].items() if k in own and own[k].shape != v.shape]
    if bad:
        raise CheckpointError(
            f"init_from={path!r}: tensor {bad[0]!r} has shape {tuple(ckpt['model'][bad[0]].shape)}, "
            f"the model expects {tuple(own[bad[0]].shape)}"
        )
    missing, unexpected = model.load_state_dict(ckpt["model"], strict=False)
    if unexpected:
        raise CheckpointError(f"init_from={path!r}: unknown tensor {unexpected[0]!r} for this model")
    log.info("init_from %s: loaded %d tensors", path, len(ckpt["model"]))
    if missing:
        log.info("freshly initialised (not in %s): %s", path, ", ".join(missing))


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("train.tensorboard=true but tensorboard is not installed (pip install tensorboard)")
        return None
    return SummaryWriter(str(run_dir / "tb"))


def write_status(run_dir: Path, state: str, **info: Any) -> None:
    """``status.json`` of a run: ``running`` (with pid and host), ``done``, ``failed`` (with the error)
    or ``stopped`` (by a signal); ``crtn-report`` uses it to list jobs that did not finish."""
    import socket

    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"state": state, "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), **info}
    tmp = run_dir / ".status.json.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, run_dir / "status.json")


def run_with_status(prog: str, fn: Callable[[Any], Any], cfg: Any) -> Any:
    """Run ``fn(cfg)`` inside a Hydra job, recording ``status.json`` and printing user errors
    as one line (see :func:`report_user_errors`). Used by crtn-train and crtn-eval."""
    from hydra.core.hydra_config import HydraConfig

    run_dir = Path(HydraConfig.get().runtime.output_dir)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    status = (lambda state, **kw: write_status(run_dir, state, **kw)) if main_rank else (lambda *a, **k: None)
    status("running")
    try:
        with report_user_errors(prog):
            try:
                result = fn(cfg)
            except BaseException as e:
                if not isinstance(e, SystemExit):
                    status("failed", error=f"{type(e).__name__}: {e}".strip().splitlines()[0])
                raise
    except SystemExit as e:
        if e.code == 130:
            status("stopped", exit_code=e.code)
        raise
    status("done")
    return result


def _task(cfg: Any) -> dict[str, Any]:
    return run_with_status("crtn-train", run_training, cfg)


def main() -> None:
    """Console entry point of ``crtn-train`` (config ``conf/train.yaml``)."""
    import hydra

    from crtn.config import register_configs
    from crtn.utils import tune_allocator

    tune_allocator()
    register_configs()
    hydra.main(config_path="pkg://crtn.conf", config_name="train", version_base="1.3")(_task)()


if __name__ == "__main__":
    main()
