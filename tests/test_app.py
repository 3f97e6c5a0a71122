"""The shared entry point of the Hydra apps (crtn/app.py): unknown keys are rejected in every
group, with or without ``+``, before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from crtn.app import unknown_keys
from crtn.app_config import ConvertAppSpec
from crtn.config import RunSpec
from tests.helpers import TINY_RUN, cli


@dataclass
class _Inner:
    a: int = 1


@dataclass
class _Root:
    inner: _Inner = field(default_factory=_Inner)
    maybe: _Inner | None = None
    b: str = "x"


def test_unknown_keys_walks_nested_and_optional_nodes():
    assert unknown_keys({"inner": {"a": 2}, "maybe": None, "b": "y"}, _Root) == []
    found = unknown_keys({"inner": {"a": 2, "z": 1}, "maybe": {"a": 1, "y": 2}, "c": 3}, _Root)
    assert found == ["inner.z", "maybe.y", "c"]
    assert unknown_keys({"data": {"name": "ptb", "synthetic": {"x": 1}}}, ConvertAppSpec) == [
        "data.synthetic.x"
    ]
    assert unknown_keys({"train": {"max_step": 1}, "x": 1}, RunSpec) == ["x"]


@pytest.mark.parametrize("key", ["+model.no_such_key=1", "+cache.x=1", "+train.x=1", "+x=1"])
def test_train_rejects_added_unknown_keys(tmp_path, key):
    run = tmp_path / "run"
    p = cli("crtn.train", [*TINY_RUN, key, f"hydra.run.dir={run}"], tmp_path)
    dotted = key[1:].split("=")[0]
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [f"crtn-train: error: unknown key '{dotted}' (not in the schema)"]
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


def test_train_rejects_unknown_keys_without_plus(tmp_path):
    run = tmp_path / "run"
    p = cli("crtn.train", [*TINY_RUN, "model.no_such_key=1", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "no_such_key" in p.stderr  # Hydra's own error names the key
    assert not (run / "checkpoints").exists()


@pytest.mark.parametrize(
    "module,prog,args,dotted",
    [
        ("crtn.eval_app", "crtn-eval", ["checkpoint=none.pt", "+eval.x=1"], "eval.x"),
        ("crtn.generate", "crtn-generate", ["checkpoint=none.pt", "+x=1"], "x"),
        ("crtn.convert", "crtn-convert", ["src=none", "out=OUT", "data=ptb", "+data.x=1"], "data.x"),
    ],
)
def test_every_app_rejects_unknown_keys(tmp_path, module, prog, args, dotted):
    args = [a.replace("OUT", str(tmp_path / "out")) for a in args]
    if module == "crtn.eval_app":
        args.append(f"hydra.run.dir={tmp_path / 'ev'}")
    p = cli(module, args, tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == [f"{prog}: error: unknown key '{dotted}' (not in the schema)"]
