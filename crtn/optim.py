"""Training features of the CRTN authors' recipe (xyz961014/longterm, ``CRTN/main.py``), each off
by default: the embedding learning-rate multiplier (``optim.emb_lr_mult``), temporal activation
regularisation (``train.tar``), Polyak averaging of the weights (``train.avg_start``) and the
training length in epochs (``train.max_epoch``).

Sources: Merity et al. 2018, "Regularizing and Optimizing LSTM Language Models" (AWD-LSTM:
TAR, averaged SGD); Polyak & Juditsky 1992 (iterate averaging). The averaging is
``torch.optim.swa_utils.AveragedModel`` (its default: the equal-weight mean of every update).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn
from torch.optim.swa_utils import AveragedModel

from crtn.errors import ConfigError


def param_groups(model: nn.Module, lr: float, emb_lr_mult: float) -> list[dict[str, Any]]:
    """Adam's parameter groups: everything at ``lr``, or with ``emb_lr_mult != 1`` two groups,
    the rest at ``lr`` and the word embedding's parameters (``model.word_emb``: its tables and
    projections, hence the output layer's tied weights too) at ``lr * emb_lr_mult``.

    As the authors' ``main.py`` (``--emb_mult``): ``[non-embedding, embedding]``; the learning-rate
    schedule multiplies both alike. Every parameter is in exactly one group.
    """
    params = list(model.parameters())
    if emb_lr_mult == 1.0:
        return [{"params": params, "lr": lr}]
    emb_ids = {id(p) for p in model.word_emb.parameters()}
    emb = [p for p in params if id(p) in emb_ids]
    rest = [p for p in params if id(p) not in emb_ids]
    return [{"params": rest, "lr": lr}, {"params": emb, "lr": lr * emb_lr_mult}]


def tar_penalty(hidden: Tensor, beta: float) -> Tensor:
    """Temporal activation regularisation: ``beta * mean((h[:, t+1] - h[:, t])**2)``.

    Args:
        hidden: [B, L, d] top-layer outputs of one segment (as fed to the softmax: after the final
            dropout, as the authors' ``main.py`` applies it to ``output``).
        beta: the weight (``train.tar``).

    Returns:
        A scalar: beta times the mean over B * (L-1) * d squared differences of consecutive
        positions; 0 for L < 2.
    """
    if hidden.shape[1] < 2:
        return hidden.new_zeros(())
    return beta * (hidden[:, 1:] - hidden[:, :-1]).pow(2).mean()


def total_steps(max_step: int, max_epoch: int | None, steps_per_epoch: int) -> int:
    """Optimizer steps of a run: ``max_step``, or ``max_epoch`` epochs if that comes first."""
    if max_epoch is None:
        return max_step
    return min(max_step, max_epoch * steps_per_epoch)


def avg_start_step(avg_start: float | None, total: int) -> int | None:
    """The step after which averaging starts: the average holds the weights after every step
    ``n > avg_start_step`` (as the authors' ``mu = 1 / (step - decay_steps)``).

    ``avg_start`` in [0, 1): a fraction of the ``total`` steps (rounded); >= 1: a step number;
    None: no averaging.

    Raises:
        ConfigError: negative, or >= 1 and not a whole number.
    """
    if avg_start is None:
        return None
    if avg_start < 0:
        raise ConfigError(f"train.avg_start={avg_start} must be >= 0 (a fraction < 1 or a step)")
    if avg_start < 1:
        return round(avg_start * total)
    if not float(avg_start).is_integer():
        raise ConfigError(f"train.avg_start={avg_start} must be a fraction < 1 or a whole step number")
    return int(avg_start)


class WeightAverage:
    """Polyak averaging of a model's parameters after ``start`` steps (``train.avg_start``).

    ``averaged`` is an :class:`AveragedModel` (a copy of the model whose parameters are the
    equal-weight mean of the updates so far); :meth:`update` adds the current weights when
    ``step > start``. :attr:`active`: at least one update, i.e. evaluation should use
    :attr:`module`. Buffers are not averaged (the models' buffers are constants).
    """

    def __init__(self, model: nn.Module, start: int):
        self.start = start
        self.averaged = AveragedModel(model)

    @property
    def active(self) -> bool:
        return int(self.averaged.n_averaged.item()) > 0

    @property
    def module(self) -> nn.Module:
        """The averaged model (same class as the trained one)."""
        return self.averaged.module

    def update(self, model: nn.Module, step: int) -> None:
        """Add ``model``'s weights to the mean if ``step`` (steps done) is past the start."""
        if step > self.start:
            self.averaged.update_parameters(model)

    def state_dict(self) -> dict[str, Any]:
        return self.averaged.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.averaged.load_state_dict(sd)


def validate_training(train: Any, optim: Any) -> None:
    """Check the keys of this module (:class:`crtn.config.TrainSpec`, ``OptimSpec``).

    Raises:
        ConfigError: naming the key and value.
    """
    if train.tar < 0 or not math.isfinite(train.tar):
        raise ConfigError(f"train.tar={train.tar} must be >= 0")
    if train.max_epoch is not None and train.max_epoch <= 0:
        raise ConfigError(f"train.max_epoch={train.max_epoch} must be > 0 (or null)")
    if optim.emb_lr_mult <= 0:
        raise ConfigError(f"optim.emb_lr_mult={optim.emb_lr_mult} must be > 0")
    avg_start_step(train.avg_start, 1)


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
