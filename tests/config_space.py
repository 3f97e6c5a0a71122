"""Valid model configurations drawn from the schema itself (hypothesis strategies).

Every field of the four spec groups of :class:`crtn.model.spec.Spec` (``model``, ``cache``,
``query``, ``summary``) gets a strategy derived from its type and from the rules that
:func:`crtn.model.resolve_spec` checks:

- ``bool``: both values;
- ``str``: the choices :func:`crtn.errors.check_choice` lists when resolution is handed an
  unknown value (probed: the registries :data:`crtn.model.MODELS`, ``STRATEGIES``,
  ``SUMMARIES`` and the option tuples of ``crtn/model/cache.py``, as resolution sees them);
- ``int``: small integers 0..4 and the field's default (the default first: hypothesis starts
  from the first value of a choice, so its first configuration is the schema's);
- ``X | None``: None half of the time, else X's strategy.

:data:`OVERRIDES` replaces the derived strategy where the type says too little (a model's sizes,
kept tiny; rates, kept at 0 so that training mode is deterministic; floats, which have no
derivable range; values that depend on another field). A field with neither a derivable type nor
an override raises :class:`Underivable`, and ``tests/test_causality_property.py`` asserts that no
schema field does, so a new option joins the sampling by being in the schema.

A drawn configuration is resolved; a refusal names its key (``ConfigError``: ``KEY=VALUE ...``),
and that key is reset to its :data:`BASE` value and the configuration resolved again (at most
:data:`REPAIRS` times), so mutually exclusive options (``query=gate`` and ``cache.key_layer``,
``summary.ngram`` off ``token_max``...) do not discard most draws. What stays refused is
discarded (``assume``); :class:`Tally` counts both, for the tests to bound.
"""

from __future__ import annotations

import re
import types
import typing
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from crtn.errors import ConfigError
from crtn.model import MODELS, Spec, resolve_spec
from tests.helpers import TINY

PROBE = "__probe__"
SMALL = range(5)
REPAIRS = 8
V = 11  # vocabulary of the sampled models

#: the four groups of a model spec and their dataclasses, from the schema
GROUPS: dict[str, type] = {f.name: typing.get_type_hints(Spec)[f.name] for f in fields(Spec)}


def _tgt(c: dict) -> int:
    return c["model.tgt_len"]


#: strategies where the type says too little; a callable receives the fields drawn so far
#: (groups in the order of :class:`Spec`, fields in declaration order)
OVERRIDES: dict[str, Any] = {
    # the registry, crtn drawn 4 times as often as vanilla and txl (the options are mostly its)
    "model.name": st.sampled_from(["crtn", "crtn", "crtn", *MODELS]),
    "model.n_layer": st.integers(1, 3),
    "model.n_head": st.integers(1, 2),
    "model.d_model": st.sampled_from([8, 12, 16]),
    "model.d_head": st.integers(2, 4),
    "model.d_inner": st.sampled_from([8, 16]),
    "model.d_embed": st.one_of(st.none(), st.sampled_from([6, 8])),
    # rates 0: the training-mode check needs deterministic passes
    "model.dropout": st.just(0.0),
    "model.dropatt": st.just(0.0),
    "model.dropemb": st.just(0.0),
    "model.dropinp": st.sampled_from([None, 0.0]),
    "model.dropfor": st.sampled_from([None, 0.0]),
    "model.dropatt_out": st.sampled_from([None, 0.0]),
    "model.tgt_len": st.integers(2, 4),
    "model.mem_len": lambda c: st.sampled_from([1, 0, 2]).map(lambda k: k * _tgt(c)),  # crtn: a multiple of L
    "model.clamp_len": st.sampled_from([-1, 1, 2, 5]),
    "model.cutoffs": st.sampled_from([(), (4,), (3, 7)]),  # adaptive softmax over V = 11 tokens
    "model.div_val": st.integers(1, 2),
    "model.tie_projs": lambda c: st.one_of(
        st.none(),
        st.lists(st.booleans(), min_size=len(c["model.cutoffs"]) + 1, max_size=len(c["model.cutoffs"]) + 1),
    ),
    # FlexAttention runs unfused on CPU, ~10x the plain path's cost: one draw in eight
    "model.flex": st.sampled_from([False] * 7 + [True]),
    "model.init_std": st.just(0.3),  # large weights: attention far from uniform, retrieval decisive
    "model.proj_init_std": st.just(0.3),
    "model.layer_norm_eps": st.just(1e-5),
    "cache.n_slot": st.sampled_from([3, 1, 2, 0]),  # each slot is a segment to run before the cache evicts
    "summary.ngram": lambda c: st.one_of(st.none(), st.integers(1, _tgt(c))),
}

#: what a refused key is reset to: the schema's defaults with the tiny sizes of the unit tests
BASE: dict[str, Any] = {
    **{f"{g}.{f.name}": getattr(cls(), f.name) for g, cls in GROUPS.items() for f in fields(cls)},
    **TINY,
    "model.name": "crtn",
    # FlexAttention runs unfused on CPU, ~10x the plain path's cost: one draw in eight
    "model.flex": st.sampled_from([False] * 7 + [True]),
    "model.init_std": 0.3,
}


def _default(key: str) -> Any:
    group, name = key.split(".")
    return getattr(GROUPS[group](), name)


class Underivable(AssertionError):
    """A schema field whose strategy can be neither derived from its type nor found in OVERRIDES."""


def schema_keys() -> list[str]:
    """Every field of the four spec groups as ``group.field``, in declaration order."""
    return [f"{g}.{f.name}" for g, cls in GROUPS.items() for f in fields(cls)]


def probed_choices(key: str) -> tuple[str, ...] | None:
    """The choices resolution lists for an unknown value of ``key`` (``check_choice``'s message),
    or None when it does not refuse one with such a list."""
    group, name = key.split(".")
    spec = Spec()
    bad = replace(spec, **{group: replace(getattr(spec, group), **{name: PROBE})})
    try:
        resolve_spec(bad)
    except ConfigError as e:
        m = re.fullmatch(rf"{re.escape(key)}='{PROBE}' is not one of: (.*)", str(e))
        if m:
            return tuple(m.group(1).split(", "))
    return None


def derived(key: str, hint: Any) -> st.SearchStrategy:
    """The strategy of a field from its type (module docstring); raises :class:`Underivable`."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return st.one_of(st.none(), derived(key, inner[0]))
    if hint is bool:
        return st.booleans()
    if hint is int:
        default = _default(key)
        return st.sampled_from(list(dict.fromkeys([default, *SMALL] if isinstance(default, int) else SMALL)))
    if hint is str:
        choices = probed_choices(key)
        if choices:
            return st.sampled_from(choices)
    raise Underivable(f"{key} ({hint}): no strategy derives from its type; add it to OVERRIDES")


def field_strategy(key: str) -> st.SearchStrategy | Callable[[dict], st.SearchStrategy]:
    """The strategy of schema field ``key``: its override, else the derived one."""
    if key in OVERRIDES:
        return OVERRIDES[key]
    group, name = key.split(".")
    return derived(key, typing.get_type_hints(GROUPS[group])[name])


def spec_from(values: dict[str, Any]) -> Spec:
    """The :class:`Spec` of dotted ``values`` (every schema key)."""
    groups = {g: cls(**{f.name: values[f"{g}.{f.name}"] for f in fields(cls)}) for g, cls in GROUPS.items()}
    return Spec(**groups)


@dataclass
class Tally:
    """What the sampler did: ``drawn`` configurations, ``repairs`` (keys reset after a refusal),
    ``discarded`` (still refused), ``accepted``; ``seen`` the values of every key that were accepted."""

    counts: Counter = field(default_factory=Counter)
    seen: dict[str, set] = field(default_factory=dict)

    def accept(self, values: dict[str, Any]) -> None:
        self.counts["accepted"] += 1
        for k, v in values.items():
            self.seen.setdefault(k, set()).add(v if not isinstance(v, list) else tuple(v))


@st.composite
def configs(
    draw: Callable,
    tally: Tally | None = None,
    fixed: dict[str, Any] | None = None,
    where: Callable[[Spec], bool] | None = None,
):
    """A resolved :class:`Spec` drawn from the schema (module docstring) and the dotted values it
    came from; ``fixed`` dotted values are taken as given (never reset), ``where`` (a predicate on
    the resolved spec) narrows what is kept."""
    tally = tally if tally is not None else Tally()
    fixed = fixed or {}
    values: dict[str, Any] = {}
    for key in schema_keys():
        strategy = field_strategy(key)
        values[key] = (
            fixed[key] if key in fixed else draw(strategy(values) if callable(strategy) else strategy)
        )
    tally.counts["drawn"] += 1
    for _ in range(REPAIRS):
        try:
            spec = resolve_spec(spec_from(values))
            break
        except ConfigError as e:
            key = re.match(r"([a-z_]+\.[a-z_]+)=", str(e))
            name = None if key is None else key.group(1)
            if name not in values or name in fixed or values[name] == BASE[name]:
                tally.counts["discarded"] += 1
                assume(False)
            values[name] = BASE[name]
            tally.counts["repairs"] += 1
    else:
        tally.counts["discarded"] += 1
        assume(False)
    if where is not None and not where(spec):
        tally.counts["outside"] += 1
        assume(False)
    tally.accept(values)
    return spec, values
