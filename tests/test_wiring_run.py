"""Every option of the run's groups (``optim.*``, ``train.*``, ``eval.*``, ``seed``, ``init_from``)
reaches the run it documents: set on the command line, it shows in a tiny Trainer (its optimizer,
schedule, steps, records, checkpoints, validation) or in ``train_in``, and does not without it
(harness: tests/wiring.py)."""

from __future__ import annotations

import json
import math
import warnings
from unittest import mock

import pytest
import torch

import crtn.objective as objective
import crtn.trainer as trainer_module
from crtn.app import resolve_device
from crtn.errors import CheckpointError, ConfigError
from crtn.train import train_in
from tests.wiring import Ctx, Wire, run_wire, trainer, validate_calls


def start(ctx: Ctx, spec, name: str = "run"):
    t = trainer(spec, ctx.tmp / name)
    t.start()
    return t


def one_step(t) -> None:
    t.train_step(next(t.train_it.iterate(t.progress.batch_index)))


def factor(t, step: int) -> float:
    """The learning-rate multiplier of the trainer's schedule after ``step`` steps."""
    return t.scheduler.lr_lambdas[0](step)


def records(t, field: str) -> list[int]:
    """Steps of the ``metrics.jsonl`` records that hold ``field``."""
    lines = t.metrics_path.read_text().splitlines() if t.metrics_path.exists() else []
    return [r["step"] for r in map(json.loads, lines) if field in r]


class Reached(Exception):
    """train_in got as far as building its Trainer."""


def until_trainer(spec, run_dir) -> dict:
    """Run ``train_in`` up to its Trainer: the device name it resolved and the seed it set."""
    seen = {}

    def fake_trainer(cfg, dist, device, run_dir):
        seen.update(device=device, seed=torch.initial_seed())
        raise Reached

    with (
        mock.patch("crtn.train.Trainer", fake_trainer),
        mock.patch("crtn.train.resolve_device", wraps=resolve_device) as spy,
        pytest.raises(Reached),
    ):
        train_in(spec, run_dir)
    seen["device_name"] = spy.call_args.args[0]
    return seen


# ------------------------------------------------------------------ optim.*
def check_optim_name(ctx: Ctx) -> None:
    with pytest.raises(ConfigError, match=r"optim\.name='sgd'"):
        ctx.on  # noqa: B018
    assert type(start(ctx, ctx.off).optimizer) is torch.optim.Adam


def group(spec, ctx: Ctx, name: str = "run") -> dict:
    return trainer(spec, ctx.tmp / name).optimizer.param_groups[0]


def check_lr(ctx: Ctx) -> None:
    on, off = group(ctx.on, ctx), group(ctx.off, ctx)
    assert on["initial_lr"] == 5e-3 and on["lr"] == pytest.approx(5e-3 / 100)  # first warm-up step
    assert off["initial_lr"] == 1e-3


def check_betas(ctx: Ctx) -> None:
    assert group(ctx.on, ctx)["betas"] == (0.8, 0.99) and group(ctx.off, ctx)["betas"] == (0.9, 0.999)


def check_weight_decay(ctx: Ctx) -> None:
    assert group(ctx.on, ctx)["weight_decay"] == 0.01 and group(ctx.off, ctx)["weight_decay"] == 0.0


def check_scheduler(ctx: Ctx) -> None:
    assert factor(trainer(ctx.on, ctx.tmp), 16) == pytest.approx(math.sqrt(4 / 16))  # inv_sqrt
    cosine = 0.5 * (1 + math.cos(math.pi * (16 - 4) / (1500 - 4)))
    assert factor(trainer(ctx.off, ctx.tmp), 16) == pytest.approx(cosine)


def check_warmup_step(ctx: Ctx) -> None:
    t = trainer(ctx.on, ctx.tmp)
    assert [factor(t, s) for s in range(4)] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert factor(trainer(ctx.off, ctx.tmp), 3) == pytest.approx(4 / 100)


def check_eta_min(ctx: Ctx) -> None:  # cosine ends at eta_min / lr
    assert factor(trainer(ctx.on, ctx.tmp), 1500) == pytest.approx(0.2)
    assert factor(trainer(ctx.off, ctx.tmp), 1500) == pytest.approx(0.0)


def check_clip(ctx: Ctx) -> None:
    for spec, clip in ((ctx.on, 0.5), (ctx.off, 0.25)):
        t = start(ctx, spec)
        with mock.patch("torch.nn.utils.clip_grad_norm_", wraps=torch.nn.utils.clip_grad_norm_) as spy:
            one_step(t)
        assert spy.call_count == 1 and spy.call_args.args[1] == clip


def check_emb_lr_mult(ctx: Ctx) -> None:
    t = trainer(ctx.on, ctx.tmp)
    rest, emb = t.optimizer.param_groups
    assert (rest["initial_lr"], emb["initial_lr"]) == (1e-3, 2e-3)
    assert {id(p) for p in emb["params"]} == {id(p) for p in t.model.word_emb.parameters()}
    assert len(trainer(ctx.off, ctx.tmp).optimizer.param_groups) == 1


# ------------------------------------------------------------------ train.*
def check_max_step(ctx: Ctx) -> None:
    t = start(ctx, ctx.on)
    assert t.total_steps == 3 and t.fit() is None and t.step == 3
    assert trainer(ctx.off, ctx.tmp / "off").total_steps == 1500


def check_max_epoch(ctx: Ctx) -> None:
    # 2000 tokens in 4 streams: (2000 - 1) // 4 = 499 inputs per stream, 124 segments of 4
    assert trainer(ctx.on, ctx.tmp).total_steps == 124
    assert trainer(ctx.off, ctx.tmp).total_steps == 1500


def check_max_time(ctx: Ctx) -> None:
    t = start(ctx, ctx.on)
    assert t.fit() == "train.max_time=0.001s" and t.step < 20
    off = start(ctx, ctx.off, "off")
    assert off.fit() is None and off.step == 20


def check_tar(ctx: Ctx) -> None:
    for spec, beta in ((ctx.on, 0.5), (ctx.off, None)):
        t = start(ctx, spec)
        with mock.patch.object(objective, "tar_penalty", wraps=objective.tar_penalty) as spy:
            one_step(t)
        assert [c.args[1] for c in spy.call_args_list] == ([] if beta is None else [beta])


def check_avg_start(ctx: Ctx) -> None:
    t = start(ctx, ctx.on)
    assert t.average.start == 2
    t.fit()  # steps 1..3: the weights after step 3 are averaged
    assert int(t.average.averaged.n_averaged) == 1 and t.eval_model is t.average.module
    assert trainer(ctx.off, ctx.tmp / "off").average is None


def check_batch_chunk(ctx: Ctx) -> None:
    for spec, chunks in ((ctx.on, 2), (ctx.off, 1)):
        t = start(ctx, spec)
        one_step(t)
        assert t.chunks == chunks and [s.mem.shape[1] for s in t.states] == [4 // chunks] * chunks


def check_log_interval(ctx: Ctx) -> None:
    for name, spec, steps in (("on", ctx.on, [2, 4]), ("off", ctx.off, [4])):
        t = start(ctx, spec, name)
        t.fit()
        assert records(t, "train_loss") == steps


def check_eval_interval(ctx: Ctx) -> None:
    """Validation every 2 steps (not at the last: the final evaluation does it), and a checkpoint
    every 2 steps (train.checkpoint_interval follows it)."""
    for name, spec, steps in (("on", ctx.on, [2]), ("off", ctx.off, [])):
        t = start(ctx, spec, name)
        t.fit()
        assert records(t, "valid_loss") == steps and t.last.exists() == bool(steps)


def check_eval_max_step(ctx: Ctx) -> None:
    assert (
        validate_calls(ctx.on, ctx.tmp / "on")["max_step"] == 1
        and validate_calls(ctx.off, ctx.tmp / "off")["max_step"] is None
    )


def check_checkpoint_interval(ctx: Ctx) -> None:
    for name, spec, steps in (("on", ctx.on, [2, 4]), ("off", ctx.off, [])):
        t, saved = start(ctx, spec, name), []
        save = t.save_last
        t.save_last = lambda t=t, save=save, saved=saved: (saved.append(t.step), save())
        t.fit()
        assert saved == steps


def check_device(ctx: Ctx) -> None:
    assert until_trainer(ctx.on, ctx.tmp / "on")["device_name"] == "auto"
    assert until_trainer(ctx.off, ctx.tmp / "off")["device_name"] == "cpu"


def check_amp(ctx: Ctx) -> None:
    """bf16 autocast on CUDA (the decision, checked here without a GPU), nothing elsewhere."""
    for spec, amp in ((ctx.on, True), (ctx.off, False)):
        with mock.patch.object(trainer_module, "amp_context", wraps=trainer_module.amp_context) as spy:
            trainer(spec, ctx.tmp)
        assert spy.call_args.args[0] is amp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": the object is still made
        cuda = trainer_module.amp_context(True, torch.device("cuda"))
    assert isinstance(cuda, torch.autocast) and cuda.fast_dtype == torch.bfloat16
    assert not isinstance(trainer_module.amp_context(False, torch.device("cuda")), torch.autocast)


def check_compile(ctx: Ctx) -> None:
    assert all(layer._compiled_call_impl is not None for layer in trainer(ctx.on, ctx.tmp).model.layers)
    assert all(layer._compiled_call_impl is None for layer in trainer(ctx.off, ctx.tmp).model.layers)


def check_progress(ctx: Ctx) -> None:
    for name, spec, hidden in (("on", ctx.on, True), ("off", ctx.off, False)):
        t = start(ctx, spec, name)
        with mock.patch.object(trainer_module, "tqdm", wraps=trainer_module.tqdm) as spy:
            t.fit()
        assert spy.call_args.kwargs["disable"] is hidden


def check_resume(ctx: Ctx) -> None:
    first = start(ctx, ctx.off)
    one_step(first)
    first.save_last()
    assert start(ctx, ctx.on).step == 0  # a fresh run in the same folder
    assert start(ctx, ctx.off).step == 1


def check_overwrite(ctx: Ctx) -> None:
    old = ctx.tmp / "run" / "metrics.jsonl"  # a folder holding a run
    old.parent.mkdir()
    old.write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"pass train\.overwrite=true"):
        train_in(ctx.off, old.parent)
    until_trainer(ctx.on, old.parent)
    assert not old.exists()


def check_allow_change(ctx: Ctx) -> None:
    first = start(ctx, ctx.spec("train.max_step=4", value=False))
    one_step(first)
    first.save_last()
    assert start(ctx, ctx.spec("train.max_step=6")).step == 1
    with pytest.raises(CheckpointError, match=r"train\.allow_change=true"):
        start(ctx, ctx.spec("train.max_step=6", value=False))


def check_tensorboard(ctx: Ctx) -> None:
    for spec, used in ((ctx.on, True), (ctx.off, False)):
        with mock.patch.object(trainer_module, "_tensorboard", return_value=None) as spy:
            t = start(ctx, spec)
        assert spy.called is used and (not used or spy.call_args.args[0] == t.run_dir)


# ------------------------------------------------------------------ eval.*
def eval_metrics(ctx: Ctx, spec) -> dict:
    """One segment of validation with the trainer's evaluation settings."""
    return start(ctx, spec).evaluate("valid", 1)


def twin(ctx: Ctx, spec):
    """The model that validation runs: the trained weights built for eval.*."""
    t = start(ctx, spec)
    return t._for_evaluation(t.eval_model), t.model


def reported(field: str, on: int, off: int):
    def check(ctx: Ctx) -> None:
        assert eval_metrics(ctx, ctx.on)[field] == on and eval_metrics(ctx, ctx.off)[field] == off

    return check


def twin_attribute(name: str, on, off):
    def check(ctx: Ctx) -> None:
        model, trained = twin(ctx, ctx.on)
        assert getattr(model, name) == on and getattr(trained, name) == off
        assert getattr(twin(ctx, ctx.off)[0], name) == off

    return check


def check_eval_batch_size(ctx: Ctx) -> None:
    assert (
        validate_calls(ctx.on, ctx.tmp / "on")["batch_size"] == 2
        and validate_calls(ctx.off, ctx.tmp / "off")["batch_size"] == 4
    )


def check_final_max_step(ctx: Ctx) -> None:
    """The final evaluation (valid and test of the best weights) reads eval.max_step segments."""
    for spec, limited in ((ctx.on, True), (ctx.off, False)):
        final = start(ctx, spec).final_evaluation()
        assert [final[s]["segments"] == 2 for s in ("valid", "test")] == [limited] * 2


# ------------------------------------------------------------------ seed, init_from
def check_seed(ctx: Ctx) -> None:
    assert until_trainer(ctx.on, ctx.tmp / "on")["seed"] == 7
    assert until_trainer(ctx.off, ctx.tmp / "off")["seed"] == 1111


def check_init_from(ctx: Ctx) -> None:
    source = start(ctx, ctx.off, "a")
    one_step(source)
    source.save_last()
    loaded = dict(trainer(ctx.on, ctx.tmp / "b").model.state_dict())
    fresh = dict(trainer(ctx.off, ctx.tmp / "c").model.state_dict())
    for name, value in source.model.state_dict().items():
        assert torch.equal(loaded[name], value), name
    assert not all(torch.equal(fresh[n], v) for n, v in source.model.state_dict().items())


SHORT = ("train.max_step=4",)
RUN_WIRING: dict[str, Wire] = {
    "optim.name": Wire("sgd", check_optim_name, refused=True),
    "optim.lr": Wire(5e-3, check_lr),
    "optim.betas": Wire([0.8, 0.99], check_betas),
    "optim.weight_decay": Wire(0.01, check_weight_decay),
    "optim.scheduler": Wire("inv_sqrt", check_scheduler, extra=("optim.warmup_step=4",)),
    "optim.warmup_step": Wire(10, check_warmup_step),
    "optim.eta_min": Wire(2e-4, check_eta_min),
    "optim.clip": Wire(0.5, check_clip),
    "optim.emb_lr_mult": Wire(2.0, check_emb_lr_mult),
    "train.max_step": Wire(3, check_max_step),
    "train.max_epoch": Wire(1, check_max_epoch),
    "train.max_time": Wire(0.001, check_max_time, extra=("train.max_step=20",)),
    "train.tar": Wire(0.5, check_tar),
    "train.avg_start": Wire(2, check_avg_start, extra=("train.max_step=3",)),
    "train.batch_chunk": Wire(2, check_batch_chunk),
    "train.log_interval": Wire(2, check_log_interval, extra=SHORT),
    "train.eval_interval": Wire(2, check_eval_interval, extra=SHORT),
    "train.eval_max_step": Wire(1, check_eval_max_step),
    "train.checkpoint_interval": Wire(2, check_checkpoint_interval, extra=SHORT),
    "train.device": Wire("auto", check_device),
    "train.amp": Wire(True, check_amp),
    "train.compile": Wire(True, check_compile),
    "train.progress": Wire(False, check_progress, extra=("train.max_step=1",)),
    "train.resume": Wire(False, check_resume),
    "train.overwrite": Wire(True, check_overwrite, extra=("train.resume=false",)),
    "train.allow_change": Wire(True, check_allow_change),
    "train.tensorboard": Wire(True, check_tensorboard),
    "eval.tgt_len": Wire(2, reported("tgt_len", 2, 4), extra=("summary.name=last_state",)),
    "eval.mem_len": Wire(8, reported("mem_len", 8, 4)),
    "eval.clamp_len": Wire(3, twin_attribute("clamp_len", 3, -1)),
    "eval.same_length": Wire(True, twin_attribute("same_length", True, False)),
    "eval.n_slot": Wire(6, reported("n_slot", 6, 4)),
    "eval.top_k": Wire(2, reported("top_k", 2, 1)),
    "eval.batch_size": Wire(2, check_eval_batch_size),
    "eval.max_step": Wire(2, check_final_max_step),
    "seed": Wire(7, check_seed),
    "init_from": Wire("{tmp}/a/checkpoints/last.pt", check_init_from),
}


@pytest.mark.parametrize("key", list(RUN_WIRING))
def test_run_option_is_wired(key, tmp_path):
    run_wire(RUN_WIRING, key, tmp_path)
