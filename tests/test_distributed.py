"""Data-parallel training: 2 gloo processes under torchrun == 1 process with the same global batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from crtn.checkpoint import load_checkpoint
from tests.test_train import TINY, cli, train_losses

ARGS = [
    *TINY,
    "model.dropout=0.0",
    "data.batch_size=4",
    "train.max_step=10",
    "train.log_interval=1",
    "train.eval_interval=5",
    "train.eval_max_step=2",
]


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        "-m",
        "crtn.train",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_two_gloo_processes_match_one_process(tmp_path):
    single = tmp_path / "single"
    p = cli("crtn.train", [*ARGS, f"hydra.run.dir={single}"], tmp_path)
    assert p.returncode == 0, p.stderr
    ddp = tmp_path / "ddp"
    p = torchrun([*ARGS, f"hydra.run.dir={ddp}"], tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = train_losses(single), train_losses(ddp)
    assert sorted(a) == sorted(b) == list(range(1, 11))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6 * max(1.0, abs(a[step])), (step, a[step], b[step])
    # the checkpoint holds every rank's streams: 2 ranks x 1 chunk, 2 streams each, caches filled
    ckpt = load_checkpoint(ddp / "checkpoints/last.pt")
    assert len(ckpt["states"]) == 2 and all(len(r) == 1 for r in ckpt["states"])
    assert all(r[0]["cache"]["n_insert"] > 0 and r[0]["mem"].shape[1] == 2 for r in ckpt["states"])
    ra = json.loads((single / "results.json").read_text())["test"]["loss"]
    rb = json.loads((ddp / "results.json").read_text())["test"]["loss"]
    assert abs(ra - rb) < 1e-5
