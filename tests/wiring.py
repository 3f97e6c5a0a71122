"""The harness of the wiring tests (tests/test_wiring*.py): each option of ``crtn-train``'s schema
is set on the command line, composed and resolved as ``crtn-train`` does, and its documented
effect is read back from what the option should change (a module, the cache, a corpus, a
Trainer, a run).

A table maps each dotted key to a :class:`Wire`: a value other than the default, and a check
that receives a :class:`Ctx` holding the run spec with the value (``ctx.on``) and without it
(``ctx.off``), both composed from the same base overrides. A check asserts the effect on the
built object and, where the default shows, that it is absent without the value, so that it fails
when the key is read from the wrong place or not at all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import crtn.trainer as trainer_module
from crtn.config import RunSpec, resolve
from crtn.distributed import DistributedContext
from crtn.model import build_model
from crtn.trainer import Trainer
from tests.helpers import compose_train

#: vocabulary of the models built without a corpus (the base corpus has as many symbols)
N_TOKEN = 20
#: the query of the wiring rows: the row match of the token's own state, which reads the options
#: of the query pass and the summaries; the rows of the lookup's own option set query.strategy
#: (tests/test_wiring_model.py, ``LOOKUP``)
ROW_MATCH = ("query=token",)
#: a tiny CRTN (two layers, so that layer choices show) on a tiny synthetic corpus
BASE = (
    "model.n_layer=2",
    "model.d_model=16",
    "model.n_head=2",
    "model.d_head=8",
    "model.d_inner=32",
    "model.tgt_len=4",
    "cache.n_slot=4",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    f"data.synthetic.vocab_size={N_TOKEN}",
    "data.synthetic.branching=4",
    "data.synthetic.passage_len=4",
    "data.synthetic.doc_passages=16",
    "data.synthetic.min_gap=24",
    "data.synthetic.max_gap=40",
    "data.synthetic.train_tokens=2000",
    "data.synthetic.valid_tokens=256",
    "data.synthetic.test_tokens=256",
)


@dataclass(frozen=True)
class Wire:
    """One row of a wiring table: ``value`` (not the default; ``{tmp}`` stands for the test's
    temporary folder), the ``check`` of its effect, and ``extra`` overrides added to :data:`BASE`
    (with and without the value). ``refused``: the value is one the rules refuse (the check
    asserts the error); ``required``: the base is refused without the key (``ctx.off`` does not
    resolve; the check asserts that)."""

    value: Any
    check: Callable[[Ctx], None]
    extra: tuple[str, ...] = ()
    refused: bool = False
    required: bool = False


def cli(value: Any) -> str:
    """``value`` as the command line writes it (Hydra's override grammar)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(cli(v) for v in value) + "]"
    return str(value)


@cache
def _composed(args: tuple[str, ...]):
    return compose_train(list(args))


def compose_spec(args: list[str] | tuple[str, ...]) -> RunSpec:
    """The run spec ``crtn-train ARGS`` resolves to."""
    return resolve(_composed(tuple(args)))


class Ctx:
    """What a check works with: the key, its value, the temporary folder, and the run specs."""

    def __init__(self, key: str, wire: Wire, tmp: Path):
        self.key, self.tmp = key, tmp
        self.value = self.sub(wire.value)
        self.base = [*ROW_MATCH, *BASE, *(self.sub(o) for o in wire.extra)]

    def sub(self, value: Any) -> Any:
        return value.replace("{tmp}", str(self.tmp)) if isinstance(value, str) else value

    def spec(self, *extra: str, value: bool = True) -> RunSpec:
        """The run spec of the base, ``extra`` overrides and (``value``) the key set to the value."""
        given = [f"{self.key}={cli(self.value)}"] if value else []
        return compose_spec([*self.base, *(self.sub(o) for o in extra), *given])

    @cached_property
    def on(self) -> RunSpec:
        return self.spec()

    @cached_property
    def off(self) -> RunSpec:
        return self.spec(value=False)


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """The dotted keys of every leaf field of a schema dataclass (nested groups walked)."""
    keys = []
    for f in dataclasses.fields(cls):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            keys += leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


def spec_value(spec: Any, key: str) -> Any:
    for part in key.split("."):
        spec = getattr(spec, part)
    return spec


def plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def run_wire(table: dict[str, Wire], key: str, tmp_path: Path) -> None:
    """Compose the key's value as the command line does, check that it reaches the run spec, then
    run the row's check."""
    wire = table[key]
    ctx = Ctx(key, wire, tmp_path)
    if not wire.refused:
        assert plain(spec_value(ctx.on, key)) == plain(ctx.value)
    if not (wire.refused or wire.required):
        assert plain(spec_value(ctx.off, key)) != plain(ctx.value)
    wire.check(ctx)


# ------------------------------------------------------------------ building what a key affects
def build(spec: RunSpec, seed: int = 0) -> Any:
    """The model of ``spec`` with ``N_TOKEN`` symbols, initialised from ``seed``."""
    torch.manual_seed(seed)
    return build_model(spec, N_TOKEN)


def tokens(n_seg: int, batch: int = 2, seg: int = 4, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, N_TOKEN, (batch, seg), generator=g) for _ in range(n_seg)]


def steps(model: Any, segments: list[torch.Tensor]) -> list[Any]:
    """Run ``model`` over consecutive segments of the same streams; the outputs of every step."""
    state, outs = None, []
    for x in segments:
        out = model(x, torch.roll(x, -1, 1), state)
        state = out.state
        outs.append(out)
    return outs


def trainer(spec: RunSpec, run_dir: Path) -> Trainer:
    """A Trainer of ``spec`` on the CPU writing into ``run_dir`` (seeded as crtn-train seeds it)."""
    torch.manual_seed(spec.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    return Trainer(spec, dist=DistributedContext(), device=torch.device("cpu"), run_dir=run_dir)


def validate_calls(spec: RunSpec, run_dir: Path) -> dict[str, Any]:
    """The keywords of the ``evaluate`` call of one validation by a Trainer of ``spec``."""
    t = trainer(spec, run_dir)
    t.start()
    with mock.patch.object(trainer_module, "evaluate", wraps=trainer_module.evaluate) as spy:
        t.validate()
    return spy.call_args.kwargs
