"""The options of ``crtn-train`` are wired, documented and kept out of the model:

- every leaf key of the schema (``crtn.config.RunSpec``) has a row in a wiring table
  (tests/test_wiring_model.py, tests/test_wiring_data.py, tests/test_wiring_run.py), whose check
  shows the key's effect on what it configures; a new option without one fails here;
- docs/configuration.md documents every key, and each documented default is the one the default
  job resolves to (a changed default constant fails here), marked "from" exactly where it is derived;
- the model package holds no config node: every registered model (crtn with several query and
  summary pairs) built from a composed config stores plain values only, and ``crtn/model/*.py``
  import neither omegaconf nor hydra.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch
import yaml
from omegaconf import OmegaConf
from torch import nn

from crtn.config import STRATEGIES, RunSpec, load_spec, resolve, spec_dict
from crtn.model import MODELS, build_model, resolve_spec
from tests.helpers import compose_train
from tests.test_wiring_data import DATA_WIRING
from tests.test_wiring_model import MODEL_WIRING
from tests.test_wiring_run import RUN_WIRING
from tests.wiring import BASE, N_TOKEN, leaf_keys, plain, spec_value, tokens

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "configuration.md"
TABLES = (MODEL_WIRING, DATA_WIRING, RUN_WIRING)


# ------------------------------------------------------------------ every option has a wiring check
def test_every_schema_key_has_a_wiring_check():
    keys = [k for table in TABLES for k in table]
    assert len(keys) == len(set(keys)), "a key in two wiring tables"
    schema = leaf_keys(RunSpec)
    assert len(schema) > 100 and "data.synthetic.seed" in schema and "init_from" in schema
    missing, extra = sorted(set(schema) - set(keys)), sorted(set(keys) - set(schema))
    assert not missing, (
        f"options without a wiring check (add a row to a table of tests/test_wiring_*.py): {missing}"
    )
    assert not extra, f"wiring rows for keys the schema does not have: {extra}"


# ------------------------------------------------------------------ documented defaults
ROW = re.compile(r"^\| `([a-z_.]+)` \| (.*?) \| (.*) \|$")


def documented() -> dict[str, tuple[str, str]]:
    """Key -> (default cell, meaning) of every row of docs/configuration.md's tables."""
    rows: dict[str, tuple[str, str]] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} documented twice"
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def default_of(cell: str):
    """The value of a default cell: its first `code` span, read as YAML."""
    m = re.match(r"`([^`]*)`", cell)
    assert m, f"default cell without a value: {cell!r}"
    return yaml.safe_load(m.group(1))


def same(doc, value) -> bool:
    """Whether a documented default (read as YAML) is the resolved value: booleans only as booleans,
    floats by value (YAML reads ``1e-5`` as a string), lists and tuples alike."""
    if isinstance(value, bool) or isinstance(doc, bool):
        return type(doc) is type(value) and doc == value
    if isinstance(value, float):
        try:
            return float(doc) == value
        except (TypeError, ValueError):
            return False
    return plain(doc) == plain(value)


def test_every_key_is_documented():
    rows = documented()
    assert sorted(rows) == sorted(leaf_keys(RunSpec))
    assert all(meaning.strip() for _, meaning in rows.values())


def test_documented_defaults_are_the_resolved_ones():
    """Each default in docs/configuration.md is what ``crtn-train`` with no arguments resolves to,
    and says "from" exactly where the resolution derives it (the schema leaves it null)."""
    resolved, schema = resolve(compose_train([])), RunSpec()
    for key, (cell, _) in documented().items():
        value = spec_value(resolved, key)
        assert same(default_of(cell), value), f"{key}: documented {cell!r}, resolved {value!r}"
        derived = plain(spec_value(schema, key)) != plain(value)
        assert (" from " in cell) == derived, f"{key}: 'from' in {cell!r} but derived={derived}"


def test_the_defaults_check_can_fail():
    assert not same(default_of("`1`"), 0) and not same(default_of("`[false]`"), (False, True))
    assert same(default_of("`1e-5`"), 1e-05) and same(default_of("`null`"), None)
    assert not same(default_of("`true`"), 1.0) and same(default_of("`[0.9, 0.999]`"), (0.9, 0.999))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resolving_a_run_spec_again_changes_nothing(strategy):
    """The Trainer resolves the spec train_in resolved, and a checkpoint stores a resolved spec:
    resolution must accept its own output, for every query option (with its default summary)."""
    run = resolve(compose_train([f"query={strategy}"]))
    assert resolve(run) == run and load_spec(spec_dict(run)) == run


# ------------------------------------------------------------------ no config node in the model
FOREIGN = ("omegaconf", "hydra")


def foreign(value) -> bool:
    return type(value).__module__.split(".")[0] in FOREIGN


def stored(value, path: str, depth: int = 3):
    """``(path, value)`` of ``value`` and of what it holds, ``depth`` levels into containers and
    dataclasses (modules are walked on their own, tensors hold no objects)."""
    yield path, value
    if depth == 0 or isinstance(value, (nn.Module, torch.Tensor, ModuleType, type)) or foreign(value):
        return
    if isinstance(value, dict):
        items = [(f"[{k!r}]", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = [(f".{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:  # any other object: its attributes
        items = [(f".{k}", v) for k, v in getattr(value, "__dict__", {}).items()]
    for name, item in items:
        yield from stored(item, path + name, depth - 1)


def config_nodes(model: nn.Module, state) -> list[str]:
    """Where a model (every module's attributes) or its stream state stores an omegaconf or hydra object."""
    found = [
        f"{name or 'model'}.{attr}{sub}"
        for name, module in model.named_modules()
        for attr, value in vars(module).items()
        for sub, v in stored(value, "")
        if foreign(v)
    ]
    return found + [f"state{sub}" for sub, v in stored(state, "") if foreign(v)]


def test_config_nodes_are_found():
    """The walk finds a config node stored in a module, in a dataclass it holds, in a list."""
    node = OmegaConf.create({"n_layer": 2})
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].cfg = node
    model.spec = dataclasses.make_dataclass("S", ["model"])(node)
    model.parts = [1, OmegaConf.create([1, 2])]
    assert sorted(config_nodes(model, None)) == ["0.cfg", "model.parts[1]", "model.spec.model"]


#: every registered model, the model group's options, and crtn with several query/summary pairs
BUILDS = {
    **{name: [f"model.name={name}"] for name in MODELS},
    "model=vanilla": ["model=vanilla"],
    "model=txl_long": ["model=txl_long"],
    "model=crtn_original": ["model=crtn_original"],
    "last_l-identity": ["+pair=last_l-identity"],
    "linear-linear": ["+pair=linear-linear"],
    "single_linear-weighted_sum": ["+pair=single_linear-weighted_sum"],
    "fixed_length_1-conv": ["+pair=fixed_length_1-conv"],
    "fixed_length_2-sum": ["+pair=fixed_length_2-sum", "cache.layers=1"],
    "middle_l-max": ["+pair=middle_l-max", "cache.backend=faiss", "cache.alpha_norm=topk"],
    "token_max-d_key": ["query=token", "summary.d_key=8", "cache.dtype=float16"],
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_models_built_from_a_composed_config_hold_no_config_node(name):
    """Built from the spec the composed config resolves to: nothing of the config is kept, in the
    modules or in the stream state after a few steps (the cache, the faiss index)."""
    cfg = compose_train([*BASE, *BUILDS[name]])
    model = build_model(resolve_spec(cfg), N_TOKEN).eval()
    state = None
    with torch.no_grad():
        for x in tokens(4):
            state = model(x, None, state).state
    assert config_nodes(model, state) == []


def test_model_package_imports_no_config_library():
    for path in sorted((REPO / "crtn" / "model").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [n for n in names if n.split(".")[0] in FOREIGN], (
                f"{path.name}:{node.lineno} imports {names}"
            )
