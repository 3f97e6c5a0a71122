"""The shared entry point of the Hydra apps (crtn/app.py): the walk that finds unknown keys in
every group, and crtn-train's console module refusing one before any work starts (every script's
unknown keys, with and without ``+``, are cases of tests/test_bad_inputs.py); the job's process
flushes denormal floats to zero in every CPU thread."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_train_rejects_added_unknown_keys(tmp_path):
    """``python -m crtn.train`` with a key added outside the schema exits 2 with one line before
    any work starts: the console module's own exit path (every script's unknown keys, with and
    without ``+``, are cases of ``tests/test_bad_inputs.py``'s table, run in this process; the
    other scripts' modules run as processes in their own tests)."""
    run = tmp_path / "run"
    p = cli("crtn.train", [*TINY_RUN, "+model.no_such_key=1", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert lines == ["crtn-train: error: unknown key 'model.no_such_key' (not in the schema)"]
    assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


_DENORMAL_PROBE = """
import sys, torch
from crtn.utils import flush_denormals
if sys.argv[1] == "threads-first":
    torch.ones(1 << 20).sum()  # the intra-op threads start here, before the mode is set
flushed = flush_denormals() if sys.argv[1] != "plain" else None
x = torch.full((1 << 21,), 3e-30)
y = x * 1e-10  # 3e-40: below float32's normal range; computed by both threads
print(flushed, int(y.count_nonzero()), float((x * 1e-10 * 1e10)[0]))
"""


def _probe(tmp_path, mode: str) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    p = subprocess.run(
        [sys.executable, "-c", _DENORMAL_PROBE, mode], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_flush_denormals_flushes_in_every_thread(tmp_path):
    flushed, nonzero, back = _probe(tmp_path, "plain")
    assert int(nonzero) == 1 << 21 and float(back) == pytest.approx(3e-30, rel=1e-3)  # kept without the mode
    flushed, nonzero, back = _probe(tmp_path, "first")
    assert flushed == "True" and int(nonzero) == 0 and float(back) == 0.0


def test_flush_denormals_says_so_when_threads_started_before(tmp_path):
    flushed, nonzero, _ = _probe(tmp_path, "threads-first")
    assert flushed == "False" and 0 < int(nonzero) < 1 << 21  # the main thread's half only


def test_a_training_job_flushes_denormals(tmp_path):
    run = tmp_path / "run"
    p = cli("crtn.train", [*TINY_RUN, "train.max_step=1", f"hydra.run.dir={run}"], tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "CPU arithmetic flushes denormal floats to zero" in (run / "train.log").read_text()
