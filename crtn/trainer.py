"""The training loop of ``crtn-train``, as a :class:`Trainer` whose methods are its parts.

    trainer = Trainer(cfg, dist=dist, device=device, run_dir=run_dir)  # data, model, optimizer
    trainer.start()                 # resume from checkpoints/last.pt, or fresh streams
    stopped_by = trainer.fit()      # steps, logging, validation and checkpoints until done
    trainer.save_last()
    final = trainer.final_evaluation()   # valid and test metrics of best.pt

Each step (:meth:`Trainer.train_step`) runs the batch's chunks through the model with their
own streams' memory and cache, then clips and steps the optimizer and the schedule
(:func:`lr_factor`). Every ``train.log_interval`` steps :meth:`Trainer.log_train` writes a
record to ``metrics.jsonl``; every ``train.eval_interval`` steps :meth:`Trainer.validate`
evaluates on the valid split and keeps ``best.pt``; every ``train.checkpoint_interval`` steps
:meth:`Trainer.save_last` writes ``last.pt``. :class:`Progress` is what a checkpoint restores
besides weights, optimizer, schedule, streams and RNG states.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from crtn.checkpoint import (
    config_mismatch,
    init_from,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from crtn.config import ResolvedRun, load_spec, spec_dict
from crtn.data import load_corpus
from crtn.data.spec import metric_name
from crtn.distributed import DistributedContext
from crtn.errors import CheckpointError, UserError
from crtn.evaluate import EvaluationStopped, evaluate, format_metrics, metric_value
from crtn.model import build_model, dependency_range, require_resolved, with_spec
from crtn.objective import chunk_loss
from crtn.optim import WeightAverage, avg_start_step, lr_factor, param_groups, total_steps
from crtn.runlog import append_jsonl, truncate_jsonl
from crtn.signals import Stop, catch_signals

log = logging.getLogger("crtn.train")

# config sections that must match when a run resumes from its checkpoint
RESUME_SECTIONS = ("model", "data", "cache", "query", "summary", "optim", "seed")
# train.* keys a resume may change freely (they do not change the losses or the chosen weights);
# a change of any other (max_step reshapes the schedule...) needs train.allow_change=true.
# batch_chunk has a check of its own.
FREE_TRAIN_KEYS = (
    "device",
    "progress",
    "tensorboard",
    "max_time",
    "resume",
    "overwrite",
    "allow_change",
    "log_interval",
    "checkpoint_interval",
    "batch_chunk",
)


class TrainingDiverged(UserError):
    """The training loss became NaN or infinite."""


@dataclass
class Progress:
    """Where a run stands; saved in every checkpoint."""

    step: int = 0
    epoch: int = 0
    batch_index: int = 0  # next batch of the epoch
    best_valid: float = math.inf  # lowest validation loss so far
    elapsed: float = 0.0  # seconds of training (validations included) at the last update
    tokens_seen: int = 0


def _cpu(x: Any) -> Any:
    """Move the tensors of a (nested) state dict to the CPU, for gathering and saving."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, dict):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def amp_context(amp: bool, device: torch.device) -> Any:
    """The context of the training forward passes: bf16 autocast on a CUDA ``device`` when ``amp``
    (``train.amp``), else a null context (``train.amp`` does nothing on other devices)."""
    if amp and device.type == "cuda":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        log.warning("train.tensorboard=true but tensorboard is not installed (pip install tensorboard)")
        return None
    return SummaryWriter(str(run_dir / "tb"))


class Trainer:
    """One training run of ``crtn-train`` (rank ``dist.rank`` of a data-parallel run), from its
    resolved run spec (``cfg``: a :class:`crtn.config.ResolvedRun`, else TypeError).

    Built in the order a run needs (the RNG draws of model initialisation follow the seed):
    the corpus and its training iterator, the model (``init_from`` weights), Adam and the
    learning-rate schedule. Attributes of note: ``progress`` (:class:`Progress`), ``states``
    (the memory and cache of each batch chunk's streams), ``best_metrics`` (the full validation
    of ``best.pt`` when this process computed it), ``last``/``best`` (checkpoint paths).
    """

    def __init__(self, cfg: Any, dist: DistributedContext, device: torch.device, run_dir: Path):
        cfg = require_resolved(cfg, "Trainer", ResolvedRun)
        self.cfg, self.dist, self.device, self.run_dir = cfg, dist, device, run_dir
        self.ckpt_dir = run_dir / "checkpoints"
        self.last, self.best = self.ckpt_dir / "last.pt", self.ckpt_dir / "best.pt"
        self.metrics_path = run_dir / "metrics.jsonl"
        # the run spec as checkpoints store it: every default written out, so a checkpoint keeps
        # building this model when a default changes
        self.config_dict = spec_dict(cfg)
        self._eval_twins: dict[int, torch.nn.Module] = {}
        self._load_data()
        self.total_steps = total_steps(cfg.train.max_step, cfg.train.max_epoch, len(self.train_it))
        self._build_model()
        self.chunks = cfg.train.batch_chunk
        self.chunk_bs = self.train_it.local_batch_size // self.chunks
        self.progress = Progress()
        self.states: list[Any] = []
        self.best_metrics: dict[str, Any] | None = None
        self.last_validated = -1
        self.validate_pending = False  # a validation was stopped by a signal: redo it on resume
        self.stop = Stop()
        self.tb = None
        self.amp = amp_context(cfg.train.amp, device)
        self.tokens_per_step = cfg.data.batch_size * cfg.model.tgt_len
        self.loss_sum = torch.zeros((), device=device)  # training loss since the last log record
        self.loss_n = 0
        self.tokens_window, self.t_window = 0, time.perf_counter()  # throughput since the last record
        self.t_start = time.perf_counter()

    @property
    def step(self) -> int:
        return self.progress.step

    def _load_data(self) -> None:
        cfg = self.cfg
        self.corpus = load_corpus(cfg.data)
        self.level = self.corpus.level
        self.mname = metric_name(self.level)
        self.train_it = self.corpus.iterator(
            "train",
            cfg.data.batch_size,
            cfg.model.tgt_len,
            drop_last=True,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        self.eval_bs = cfg.eval.batch_size
        for split in ("valid", "test"):  # fail now, not after hours of training
            self.corpus.iterator(split, self.eval_bs, cfg.eval.tgt_len)

    def _build_model(self) -> None:
        cfg, o = self.cfg, self.cfg.optim
        self.model = build_model(cfg, len(self.corpus.vocab)).to(self.device)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if cfg.init_from:
            init_from(self.model, cfg.init_from, self.corpus)
        if cfg.train.compile:
            self.model.compile_layers()
        self.optimizer = torch.optim.Adam(
            param_groups(self.model, o.lr, o.emb_lr_mult),
            lr=o.lr,
            betas=tuple(o.betas),
            weight_decay=o.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(
                s,
                scheduler=o.scheduler,
                warmup=o.warmup_step,
                max_step=self.total_steps,
                eta_ratio=o.eta_min / o.lr,
            ),
        )
        self.ddp_model = self.dist.wrap(self.model)
        start = avg_start_step(cfg.train.avg_start, self.total_steps)
        self.average = None if start is None else WeightAverage(self.model, start)

    @property
    def eval_model(self) -> torch.nn.Module:
        """The weights that validation and ``best.pt`` use: the average once it started."""
        return self.average.module if self.average is not None and self.average.active else self.model

    # ------------------------------------------------------------------ start and checkpoints
    def start(self) -> None:
        """Resume from ``last.pt`` (``train.resume``) or start fresh streams; log what runs."""
        if self.cfg.train.resume and self.last.exists():
            self._resume()
        if self.dist.is_main:
            truncate_jsonl(self.metrics_path, self.step)
        if not self.states:
            self.states = [self.model.init_state(self.chunk_bs, self.device) for _ in range(self.chunks)]
        self._log_setup()
        self.tb = _tensorboard(self.run_dir) if self.cfg.train.tensorboard and self.dist.is_main else None

    def _resume(self) -> None:
        ckpt = load_checkpoint(self.last, map_location=self.device)
        saved = spec_dict(load_spec(ckpt["config"]))  # as this version resolves it
        diff = config_mismatch(saved, self.config_dict, RESUME_SECTIONS)
        if diff:
            raise CheckpointError(
                f"cannot resume from {str(self.last)!r}: the config changed ({diff}); "
                "use a new run directory or the saved config"
            )
        self._check_train_changes(saved["train"])
        n_states = len(ckpt.get("states") or [])
        if (
            "optimizer" not in ckpt
            or n_states != self.dist.world_size
            or len(ckpt["states"][0]) != self.chunks
        ):
            raise CheckpointError(
                f"cannot resume from {str(self.last)!r}: it was written by {n_states} process(es) with "
                f"another train.batch_chunk, or is not a training checkpoint; resume with the same setup"
            )
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.average is not None:
            if ckpt.get("averaged") is None:
                raise CheckpointError(
                    f"cannot resume from {str(self.last)!r}: it holds no averaged weights but "
                    f"train.avg_start={self.cfg.train.avg_start}; resume with the same setup"
                )
            self.average.load_state_dict(ckpt["averaged"])
        self.progress = Progress(
            step=ckpt["step"],
            epoch=ckpt["epoch"],
            batch_index=ckpt["batch_index"],
            best_valid=ckpt["best_valid"],
            elapsed=ckpt["elapsed"],
            tokens_seen=ckpt["tokens_seen"],
        )
        self.states = [
            self.model.load_state(sd, self.chunk_bs, self.device) for sd in ckpt["states"][self.dist.rank]
        ]
        if "loss_sums" in ckpt:  # the training loss since the last log record (all ranks)
            self.loss_sum = ckpt["loss_sums"][self.dist.rank].to(self.device).clone()
            self.loss_n = ckpt["loss_n"]
        self.validate_pending = bool(ckpt.get("validate_pending", False))
        set_rng_state(ckpt["rng"])
        log.info("resumed from %s at step %d (epoch %d)", self.last, self.step, self.progress.epoch)

    def _check_train_changes(self, saved: dict[str, Any]) -> None:
        """Refuse a resume whose ``train.*`` differs from the checkpoint's in a key that shapes the
        run (not in :data:`FREE_TRAIN_KEYS`), unless ``train.allow_change=true``; then log it."""
        current = self.config_dict["train"]
        keep = [k for k in sorted(set(saved) | set(current)) if k not in FREE_TRAIN_KEYS]
        diff = config_mismatch(
            {"train": {k: saved.get(k) for k in keep}},
            {"train": {k: current.get(k) for k in keep}},
            ("train",),
        )
        if diff is None:
            return
        if not self.cfg.train.allow_change:
            raise CheckpointError(
                f"cannot resume from {str(self.last)!r}: {diff} differs from the checkpoint's, which "
                "changes the run (e.g. the learning-rate schedule); pass train.allow_change=true to "
                "resume with the new values, or resume with the saved ones"
            )
        log.warning("resuming with changed training settings (train.allow_change=true): %s", diff)

    def _log_setup(self) -> None:
        cfg = self.cfg
        log.info(
            "model=%s params=%s data=%s (%s tokens train, vocab %d) device=%s world=%d",
            cfg.model.name,
            f"{self.n_params:,}",
            cfg.data.name,
            f"{self.corpus.splits['train'].numel():,}",
            len(self.corpus.vocab),
            self.device,
            self.dist.world_size,
        )
        if self.model.has_cache:
            log.info(
                "crtn: query=%s summary=%s n_slot=%d top_k=%d (range m+N*L = %d tokens)",
                cfg.query.strategy,
                cfg.summary.name,
                cfg.cache.n_slot,
                cfg.cache.top_k,
                dependency_range(cfg.model.mem_len, cfg.cache.n_slot, cfg.model.tgt_len),
            )

    def checkpoint(self, with_states: bool = True) -> dict[str, Any]:
        """The checkpoint payload; ``with_states`` gathers every rank's streams and running loss sum
        on rank 0 (a collective; the other ranks' payloads have none).

        ``model``: the trained weights (``last.pt``); without ``with_states`` (``best.pt``) the
        weights evaluation uses (:attr:`eval_model`). ``averaged``: the :class:`WeightAverage`
        state (averaged weights and count), for an exact resume; None without averaging.
        """
        all_states = loss_sums = None
        if with_states:
            own = ([_cpu(st.state_dict()) for st in self.states], self.loss_sum.detach().cpu().clone())
            gathered = self.dist.gather(own)
            if gathered is not None:
                all_states, loss_sums = [g[0] for g in gathered], [g[1] for g in gathered]
        p = self.progress
        return {
            "config": self.config_dict,
            "vocab": self.corpus.vocab.idx2sym,
            "model": (self.model if with_states else self.eval_model).state_dict(),
            "averaged": None if self.average is None else self.average.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step": p.step,
            "epoch": p.epoch,
            "batch_index": p.batch_index,
            "states": all_states,
            "rng": rng_state(),
            "best_valid": p.best_valid,
            "elapsed": p.elapsed,
            "tokens_seen": p.tokens_seen,
            "n_params": self.n_params,
            "loss_sums": loss_sums,
            "loss_n": self.loss_n,
            "validate_pending": self.validate_pending,
        }

    def save_last(self) -> None:
        """Write ``last.pt`` (rank 0; every rank takes part in gathering the streams) after checking
        that the loss since the last record is finite."""
        self._check_finite()
        self.progress.elapsed = time.perf_counter() - self.t_start
        payload = self.checkpoint()
        if self.dist.is_main:
            save_checkpoint(self.last, payload)

    def _check_finite(self) -> None:
        if self.loss_n and not torch.isfinite(self.loss_sum).item():
            raise TrainingDiverged(
                f"training loss became non-finite by step {self.step}; stopping without saving. The last "
                f"good checkpoint is {str(self.last)!r}"
                + ("" if self.last.exists() else " (none was written yet)")
            )

    # ------------------------------------------------------------------ the loop
    def fit(self) -> str | None:
        """Train until ``train.max_step`` (or ``train.max_epoch``), ``train.max_time`` or a signal;
        returns what stopped the loop early (None: it reached the end)."""
        cfg, stop = self.cfg, self.stop
        ckpt_interval = cfg.train.checkpoint_interval
        self.t_start = time.perf_counter() - self.progress.elapsed
        self.tokens_window, self.t_window = 0, time.perf_counter()
        show = cfg.train.progress and self.dist.is_main
        self.model.train()
        batches = self.train_it.iterate(self.progress.batch_index)
        with ExitStack() as stack:
            catch_signals(stop, stack)
            if self.validate_pending and self.dist.is_main:  # stopped by a signal before: redo it
                self.validate()
            if show:
                stack.enter_context(logging_redirect_tqdm())
            bar = stack.enter_context(
                tqdm(
                    total=self.total_steps,
                    initial=self.step,
                    desc="train",
                    dynamic_ncols=True,
                    disable=not show,
                    mininterval=1.0,
                )
            )
            while self.step < self.total_steps:
                stopped_by = self._stop_reason(stop)
                if stopped_by:
                    return stopped_by
                batch = next(batches, None)
                if batch is None:  # end of an epoch: streams start again with empty memory
                    batches = self._next_epoch()
                    continue
                self.train_step(batch)
                bar.update(1)
                self._after_step(bar, ckpt_interval)
        return None

    def _stop_reason(self, stop: Stop) -> str | None:
        """Why the loop stops before this step, decided by all ranks together; None: go on."""
        max_time = self.cfg.train.max_time
        out_of_time = max_time is not None and time.perf_counter() - self.t_start >= max_time
        if not self.dist.any(stop.signal is not None or out_of_time):  # every rank stops at the same step
            return None
        if stop.signal is not None:
            return f"signal {signal.Signals(stop.signal).name}"
        return "a signal on another rank" if not out_of_time else f"train.max_time={max_time}s"

    def _next_epoch(self):
        p = self.progress
        p.epoch, p.batch_index = p.epoch + 1, 0
        self.states = [self.model.init_state(self.chunk_bs, self.device) for _ in range(self.chunks)]
        return self.train_it.iterate(0)

    def _after_step(self, bar: Any, ckpt_interval: int) -> None:
        """Log, validate and checkpoint when the step calls for it."""
        step, t = self.step, self.cfg.train
        if step % t.log_interval == 0 or step == self.total_steps:
            self.log_train(bar)
        if step % t.eval_interval == 0 and step < self.total_steps and self.dist.is_main:
            self.validate()
            self.tokens_window, self.t_window = 0, time.perf_counter()
        if step % ckpt_interval == 0:
            self.save_last()

    def train_step(self, batch: Any) -> None:
        """One optimizer step on ``batch``, chunk by chunk (gradient accumulation); the loss of
        each chunk: :func:`crtn.objective.chunk_loss`."""
        p, chunks, bs = self.progress, self.chunks, self.chunk_bs
        p.batch_index = batch.index + 1
        x = batch.input.to(self.device, non_blocking=True)
        y = batch.target.to(self.device, non_blocking=True)
        scored = self.corpus.task.loss_mask(batch.label, self.device)  # None: every token
        self.optimizer.zero_grad(set_to_none=True)
        for c in range(chunks):
            rows = slice(c * bs, (c + 1) * bs)
            with self.dist.no_sync(self.ddp_model, last=c == chunks - 1), self.amp:
                out = self.ddp_model(x[rows], y[rows], self.states[c])
                own = None if scored is None else (scored[0][rows], scored[1])
                loss, nll = chunk_loss(out.nll, out.hidden, chunks=chunks, tar=self.cfg.train.tar, scored=own)
            loss.backward()
            self.states[c] = out.state
            self.loss_sum += nll
        self.loss_n += 1
        if self.cfg.optim.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip)
        self.optimizer.step()
        self.scheduler.step()
        p.step += 1
        if self.average is not None:
            self.average.update(self.model, p.step)
        p.tokens_seen += self.tokens_per_step
        self.tokens_window += self.tokens_per_step

    def log_train(self, bar: Any) -> None:
        """Record the mean training loss since the last record (all ranks), throughput and lr.

        Raises:
            TrainingDiverged: the loss is not finite.
        """
        p, mname = self.progress, self.mname
        train_loss = self.dist.mean(self.loss_sum).item() / self.loss_n
        if not math.isfinite(train_loss):
            raise TrainingDiverged(
                f"training loss became {train_loss} by step {p.step}; stopping. The last good "
                f"checkpoint is {str(self.last)!r}"
                + ("" if self.last.exists() else " (none was written yet)")
            )
        now = time.perf_counter()
        tok_s = self.tokens_window / (now - self.t_window)
        p.elapsed = now - self.t_start
        rec = {
            "step": p.step,
            "epoch": p.epoch,
            "lr": self.scheduler.get_last_lr()[0],
            "train_loss": train_loss,
            f"train_{mname}": metric_value(train_loss, self.level),
            "tokens_per_s": tok_s,
            "elapsed": p.elapsed,
        }
        if self.dist.is_main:
            append_jsonl(self.metrics_path, rec)
            if self.tb:
                self.tb.add_scalar("train/loss", train_loss, p.step)
                self.tb.add_scalar("train/tokens_per_s", tok_s, p.step)
        bar.set_postfix_str(f"loss {train_loss:.3f} {mname} {rec[f'train_{mname}']:.3f} tok/s {tok_s:,.0f}")
        log.info(
            "step %d | epoch %d | lr %.3g | loss %.4f | %s %.3f | %.0f tok/s | %.0fs",
            p.step,
            p.epoch,
            rec["lr"],
            train_loss,
            mname,
            rec[f"train_{mname}"],
            tok_s,
            p.elapsed,
        )
        self.loss_sum.zero_()
        self.loss_n = 0
        self.tokens_window, self.t_window = 0, time.perf_counter()

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        split: str,
        max_step: int | None,
        stoppable: bool = False,
        model: torch.nn.Module | None = None,
    ) -> dict[str, Any]:
        """Metrics on ``split`` (eval-time lengths of ``cfg.eval``) of ``model``, by default
        :attr:`eval_model` (the averaged weights once averaging started).

        Raises:
            EvaluationStopped: ``stoppable`` and SIGINT/SIGTERM arrived meanwhile.
        """
        model = self.eval_model if model is None else model
        try:
            m = evaluate(
                self._for_evaluation(model),
                self.corpus,
                split,
                batch_size=self.eval_bs,
                device=self.device,
                max_step=max_step,
                progress=False,
                stop=(lambda: self.stop.signal is not None) if stoppable else None,
            )
        finally:
            self.model.train()
        return m

    def _for_evaluation(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model``'s weights in a model built for the evaluation settings (``eval.*``): the model
        itself when they are the trained ones, else a twin sharing its parameters, made once."""
        key = id(model)
        if key not in self._eval_twins:
            self._eval_twins[key] = with_spec(model, self.cfg.eval_spec)
        return self._eval_twins[key]

    def validate(self) -> None:
        """Evaluate on valid, record it, and save ``best.pt`` when it improves (rank 0).

        A signal during it abandons it (``validate_pending``: the checkpoint about to be written
        redoes it on resume, so that the resumed run equals an uninterrupted one)."""
        p, mname = self.progress, self.mname
        t_eval = time.perf_counter()
        self.validate_pending = True
        try:
            m = self.evaluate("valid", self.cfg.train.eval_max_step, stoppable=True)
        except EvaluationStopped as e:
            log.warning("%s by a signal; it is redone when the run resumes", e)
            return
        self.validate_pending = False
        p.elapsed = time.perf_counter() - self.t_start
        rec = {"step": p.step, "valid_loss": m["loss"], f"valid_{mname}": m[mname], "elapsed": p.elapsed}
        rec.update(self.corpus.task.record(m))  # the corpus' own metrics
        log.info("eval at step %d: %s (%.1fs)", p.step, format_metrics(m), time.perf_counter() - t_eval)
        append_jsonl(self.metrics_path, rec)
        if self.tb:
            self.tb.add_scalar(f"valid/{mname}", m[mname], p.step)
        loss = self.corpus.task.selection_loss(m)
        if loss is not None and loss < p.best_valid:
            p.best_valid = loss
            save_checkpoint(self.best, self.checkpoint(with_states=False))
            # the final evaluation reuses it when it read the same segments (eval.max_step)
            self.best_metrics = m if self.cfg.train.eval_max_step == self.cfg.eval.max_step else None
        self.last_validated = p.step

    def final_evaluation(self) -> dict[str, dict[str, Any]]:
        """Valid and test metrics of the best weights by validation loss (rank 0), as in the
        Transformer-XL release, over the first ``eval.max_step`` segments of each split (None:
        all); the final weights compete for ``best.pt`` first."""
        if self.last_validated != self.step and self.step > 0:
            self.validate()
        if self.best.exists():
            self.model.load_state_dict(load_checkpoint(self.best, map_location=self.device)["model"])
        final = {}
        for split in ("valid", "test"):
            # best.pt's validation from this process is exact (same weights, fresh memory, the
            # same segments)
            if split == "valid" and self.best_metrics is not None:
                final[split] = self.best_metrics
            else:
                final[split] = self.evaluate(split, self.cfg.eval.max_step, model=self.model)
            log.info("final %s", format_metrics(final[split]))
        return final

    def close(self) -> None:
        if self.tb:
            self.tb.close()
