"""Reliability of crtn-train's run folder and checkpoints: exact resume with the running
loss, no silent overwrite, no silent change of the schedule, compact checkpoints, atomic writes,
faults (SIGKILL while writing, a full disk, a second run at once, SIGTERM during evaluation) and
safe loading. Runs are in-process (:func:`crtn.train.train_in`) where the situation allows it."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import crtn.checkpoint as checkpoint_mod
import crtn.trainer as trainer_mod
from crtn.checkpoint import load_checkpoint
from crtn.errors import CheckpointError, ConfigError, UserError
from crtn.train import train_in
from crtn.utils import atomic_write, atomic_write_text
from tests.helpers import TINY_RUN, compose_train

RUN = [*TINY_RUN, "train.eval_max_step=2"]


def cfg_of(*overrides: str):
    return compose_train([*RUN, *overrides])


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def comparable(run_dir: Path) -> list[dict]:
    """metrics.jsonl without the wall-clock fields."""
    drop = ("elapsed", "tokens_per_s")
    return [{k: v for k, v in r.items() if k not in drop} for r in records(run_dir)]


def tree_hash(*roots: Path) -> dict[str, str]:
    """sha256 of every file under ``roots`` (path -> digest)."""
    out = {}
    for root in roots:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


class Killed(Exception):
    """Stands for SIGKILL in an in-process run: the run stops where it is, nothing more is written."""


def kill_before_step(monkeypatch, step: int) -> None:
    real = trainer_mod.Trainer.train_step

    def train_step(self, batch):
        if self.step + 1 == step:
            raise Killed
        return real(self, batch)

    monkeypatch.setattr(trainer_mod.Trainer, "train_step", train_step)


def train_killed(monkeypatch, cfg, run_dir: Path, step: int) -> None:
    """Train ``cfg`` in ``run_dir`` and kill the process's training before ``step``."""
    with monkeypatch.context() as m:
        kill_before_step(m, step)
        with pytest.raises(Killed):
            train_in(cfg, run_dir)


# ---------------------------------------------------------------------- exact resume, refusals
def test_resume_restores_the_running_loss_sum(tmp_path, monkeypatch):
    """log_interval=2 does not divide checkpoint_interval=3: the record of step 10 after a kill
    before step 10 (last.pt at step 9) averages steps 9 and 10, exactly as in an uninterrupted run."""
    args = ("model.dropout=0.1", "train.max_step=12", "train.log_interval=2", "train.eval_interval=4")
    cfg = cfg_of(*args, "train.checkpoint_interval=3")
    train_in(cfg, tmp_path / "full")
    part = tmp_path / "part"
    train_killed(monkeypatch, cfg, part, 10)
    assert load_checkpoint(part / "checkpoints/last.pt")["loss_n"] == 1  # step 9, not yet logged
    assert max(r["step"] for r in records(part)) == 8
    train_in(cfg, part)
    assert comparable(part) == comparable(tmp_path / "full")  # exact floats, every record


def test_resume_false_on_a_run_refuses_unless_overwrite(tmp_path):
    run = tmp_path / "run"
    train_in(cfg_of("train.max_step=2"), run)
    before = tree_hash(run)
    with pytest.raises(ConfigError, match=r"train.resume=false .* holds a run .* train.overwrite=true"):
        train_in(cfg_of("train.max_step=2", "train.resume=false"), run)
    assert tree_hash(run) == before
    # overwrite: the old run's files go, the new run equals a run in a fresh folder
    train_in(cfg_of("train.max_step=3", "train.resume=false", "train.overwrite=true"), run)
    train_in(cfg_of("train.max_step=3"), tmp_path / "fresh")
    assert comparable(run) == comparable(tmp_path / "fresh")
    assert load_checkpoint(run / "checkpoints/last.pt")["step"] == 3


def test_changing_train_keys_on_resume_refuses_unless_allowed(tmp_path):
    run = tmp_path / "run"
    train_in(cfg_of("train.max_step=2"), run)
    before = tree_hash(run)
    with pytest.raises(CheckpointError) as e:
        train_in(cfg_of("train.max_step=4"), run)
    msg = str(e.value)
    assert "train.max_step: 2 -> 4" in msg and "train.allow_change=true" in msg and "\n" not in msg
    assert tree_hash(run) == before
    # keys that do not change the run may change (log_interval, progress...)
    train_in(cfg_of("train.max_step=2", "train.log_interval=7"), run)
    train_in(cfg_of("train.max_step=4", "train.allow_change=true"), run)
    assert load_checkpoint(run / "checkpoints/last.pt")["step"] == 4


def test_checkpoint_of_one_stream_is_compact(tmp_path):
    """Batch 1: prev_tokens and the memory are slices of larger tensors (the 400k-token split...);
    the checkpoint holds only their elements."""
    cfg = cfg_of(
        "query=fixed_length_1",  # carries prev_tokens, a slice of the training split
        "data.batch_size=1",
        "data.synthetic.train_tokens=400000",
        "train.max_step=2",
    )
    run = tmp_path / "run"
    train_in(cfg, run)
    path = run / "checkpoints/last.pt"
    ckpt = load_checkpoint(path)
    tensors: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)

    walk(ckpt)
    state = ckpt["states"][0][0]
    assert state["prev_tokens"] is not None and state["prev_tokens"].shape == (1, 8)
    for t in tensors:  # every tensor owns exactly its elements
        assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    payload = sum(t.numel() * t.element_size() for t in tensors)
    split_bytes = 400_000 * 8
    assert path.stat().st_size < payload + 200_000 < split_bytes / 4


def test_atomic_write_keeps_the_old_file_on_error(tmp_path):
    path = tmp_path / "results.json"
    atomic_write_text(path, "old")

    def full_disk(f):
        f.write(b"new and partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        atomic_write(path, full_disk)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]


# ---------------------------------------------------------------------- faults
SLOW_WRITER = """
import sys, time
import torch
import crtn.checkpoint as ck
from crtn.train import main

marker = sys.argv.pop(1)
real = ck.torch.save
calls = [0]

def slow_save(obj, f):
    calls[0] += 1
    if calls[0] == 1:  # the first checkpoint is written normally
        return real(obj, f)
    real(obj, f)
    f.flush()
    open(marker, "w").write("half")  # the file is written, not yet synced nor renamed
    time.sleep(600)

ck.torch.save = slow_save
main()
"""


def test_sigkill_while_writing_a_checkpoint_leaves_a_loadable_one(tmp_path):
    run, marker = tmp_path / "run", tmp_path / "writing"
    script = tmp_path / "slow.py"
    script.write_text(SLOW_WRITER)
    args = [*RUN, "train.max_step=4", "train.checkpoint_interval=2", "train.eval_interval=100"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script), str(marker), *args, f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 120
        while not marker.exists() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert marker.exists(), "the second checkpoint was never being written"
        torn = list((run / "checkpoints").glob(".last.pt.*.tmp"))
        assert len(torn) == 1 and torn[0].stat().st_size > 0  # caught in the middle of the write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    ckpt = load_checkpoint(run / "checkpoints/last.pt")  # the previous one, whole
    assert ckpt["step"] == 2
    # the resumed run ends as an uninterrupted one
    train_in(cfg_of("train.max_step=4", "train.checkpoint_interval=2", "train.eval_interval=100"), run)
    train_in(
        cfg_of("train.max_step=4", "train.checkpoint_interval=2", "train.eval_interval=100"),
        tmp_path / "full",
    )
    assert comparable(run) == comparable(tmp_path / "full")


def _enospc_after(monkeypatch, module, n_ok: int, match: str) -> None:
    """``module.atomic_write`` fails with ENOSPC mid-write for paths containing ``match``, after
    ``n_ok`` successful writes of such paths."""
    real = module.atomic_write
    seen = [0]

    def writer(path, write, *a, **kw):
        if match in str(path):
            seen[0] += 1
            if seen[0] > n_ok:

                def half(f):
                    f.write(b"\0" * 1000)
                    raise OSError(errno.ENOSPC, "No space left on device")

                return real(path, half, *a, **kw)
        return real(path, write, *a, **kw)

    monkeypatch.setattr(module, "atomic_write", writer)


def test_full_disk_while_checkpointing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    cfg = cfg_of("train.max_step=4", "train.checkpoint_interval=2", "train.eval_interval=100")
    _enospc_after(monkeypatch, checkpoint_mod, n_ok=1, match="last.pt")
    with pytest.raises(CheckpointError) as e:
        train_in(cfg, run)
    msg = str(e.value)
    assert "\n" not in msg and str(run / "checkpoints/last.pt") in msg and "No space left" in msg
    assert load_checkpoint(run / "checkpoints/last.pt")["step"] == 2
    assert sorted(os.listdir(run / "checkpoints")) == ["last.pt"]  # no temporary file left


def test_full_disk_while_caching_a_vocabulary_keeps_the_previous_cache(tmp_path, monkeypatch):
    import crtn.data.corpus as corpus_mod
    from crtn.data import load_corpus
    from crtn.errors import DataError
    from tests.test_data import _tiny_ptb, data_cfg

    root = _tiny_ptb(tmp_path)
    cfg = data_cfg(name="ptb", root=str(root), cache_dir=str(tmp_path / "cache"))
    load_corpus(cfg)
    before = tree_hash(tmp_path / "cache")
    (root / "penn" / "valid.txt").write_text("a b\nc c\n")  # a new cache key: a new cache is built
    _enospc_after(monkeypatch, corpus_mod, n_ok=1, match=".npy")  # vocab written, then train.npy fails
    with pytest.raises(DataError) as e:
        load_corpus(cfg)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "cache") in msg and "No space left" in msg
    assert "data.cache_dir" in msg
    after = tree_hash(tmp_path / "cache")
    assert {k: v for k, v in after.items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")
    }


def test_a_second_run_on_a_folder_in_use_refuses(tmp_path, capfd):
    from crtn.rundir import lock_run_dir, unlock_run_dir
    from crtn.train import main
    from tests.helpers import run_main

    run = tmp_path / "run"
    code, _, err = run_main(main, "crtn-train", [*RUN, "train.max_step=2", f"hydra.run.dir={run}"], capfd)
    assert code == 0, err
    unlock_run_dir(run)  # the first run's process (this one) is over
    holder = subprocess.Popen(  # another process holds the lock
        [
            sys.executable,
            "-c",
            "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); "
            "f.truncate(0); f.write('4242'); f.flush(); print('locked', flush=True); time.sleep(600)",
            str(run / ".lock"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree_hash(run)
        code, _, err = run_main(main, "crtn-train", [*RUN, "train.max_step=2", f"hydra.run.dir={run}"], capfd)
    finally:
        holder.kill()
        holder.wait()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert f"run folder {str(run)!r} is in use by another crtn-train (pid 4242)" in lines[0]
    after = tree_hash(run)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert {Path(k).relative_to(run).parts[0] for k in changed} <= {".hydra"}  # Hydra's own record
    assert json.loads((run / "status.json").read_text())["state"] == "done"
    # once the holder is gone the lock is free again
    lock_run_dir(run)
    unlock_run_dir(run)


def test_sigterm_during_evaluation_saves_and_resumes_exactly(tmp_path, monkeypatch):
    """SIGTERM arrives while the validation of step 4 runs: it is abandoned, last.pt is saved at step
    4, the process exits with 130; the resumed run redoes the validation and ends as an
    uninterrupted one."""
    args = ("model.dropout=0.1", "train.max_step=8", "train.log_interval=2", "train.eval_interval=4")
    cfg = cfg_of(*args)
    train_in(cfg, tmp_path / "full")
    real = trainer_mod.evaluate
    calls = []

    def evaluate_with_signal(*a, **kw):
        calls.append(kw.get("stop"))
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **kw)

    part = tmp_path / "part"
    with monkeypatch.context() as m:
        m.setattr(trainer_mod, "evaluate", evaluate_with_signal)
        with pytest.raises(SystemExit) as e:
            train_in(cfg, part)
    assert e.value.code == 130 and calls[0] is not None
    ckpt = load_checkpoint(part / "checkpoints/last.pt")
    assert ckpt["step"] == 4 and ckpt["validate_pending"] is True
    assert not any("valid_loss" in r for r in records(part))  # abandoned, not recorded
    assert not (part / "checkpoints/best.pt").exists()
    train_in(cfg, part)
    assert comparable(part) == comparable(tmp_path / "full")


# ---------------------------------------------------------------------- safe loading
class _Payload:
    """Unpickling this creates the file ``path`` (what a malicious checkpoint could do)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def malicious_checkpoint(tmp_path: Path, marker: Path, good: Path) -> Path:
    """A copy of the checkpoint ``good`` with a pickle payload next to its weights."""
    ckpt = torch.load(good, weights_only=True)
    ckpt["model"]["zz_payload"] = _Payload(marker)
    bad = tmp_path / "bad.pt"
    torch.save(ckpt, bad)
    return bad


def test_a_pickle_payload_is_refused_everywhere_without_running_it(tmp_path, capfd):
    from crtn.convert import main as convert_main
    from crtn.eval_app import main as eval_main
    from crtn.generate import main as generate_main
    from crtn.train import main as train_main
    from tests.helpers import run_main

    train_in(cfg_of("train.max_step=2"), tmp_path / "run")
    marker = tmp_path / "pwned"
    bad = malicious_checkpoint(tmp_path, marker, tmp_path / "run/checkpoints/last.pt")
    # the payload works: an unsafe load would create the file
    torch.load(bad, weights_only=False)
    assert marker.exists()
    marker.unlink()
    out = tmp_path / "o"
    cases = [
        (eval_main, "crtn-eval", [f"checkpoint={bad}", f"hydra.run.dir={out}/e"]),
        (generate_main, "crtn-generate", [f"checkpoint={bad}", f"hydra.run.dir={out}/g"]),
        (train_main, "crtn-train", [*RUN, f"init_from={bad}", f"hydra.run.dir={out}/t"]),
        (convert_main, "crtn-convert", [f"src={bad}", f"out={out}/c"]),
    ]
    for main, prog, args in cases:
        code, _, err = run_main(main, prog, args, capfd)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), (prog, err)
        assert str(bad) in lines[0], (prog, lines[0])
        assert not marker.exists(), f"{prog} ran the payload"
        if prog == "crtn-convert":
            assert "trust_pickle=true" in lines[0]  # the opt-in that exists
        else:
            assert "weights_only" in lines[0]
    with pytest.raises(UserError):
        load_checkpoint(bad)
    assert not marker.exists()


def test_a_corrupt_or_foreign_vocabulary_cache_is_rebuilt(tmp_path):
    """The corpus cache is only a cache: a vocabulary file that is garbage, or another corpus' of the
    same size, is detected (the meta file holds its digest) and the cache rebuilt from the text."""
    from crtn.data import load_corpus
    from tests.test_data import _tiny_ptb, data_cfg

    root = _tiny_ptb(tmp_path / "a")
    cfg = data_cfg(name="ptb", root=str(root), cache_dir=str(tmp_path / "cache"))
    fresh = load_corpus(cfg)
    vocab_file = next((tmp_path / "cache").glob("*.vocab.json"))
    good = vocab_file.read_bytes()
    swapped = json.loads(good)  # the same symbols in another order: same size, other ids
    swapped["idx2sym"] = swapped["idx2sym"][::-1]
    for bad in (b"\x00garbage{", json.dumps(swapped).encode()):
        vocab_file.write_bytes(bad)
        c = load_corpus(cfg)
        assert c.info["cache"] == "built" and c.vocab == fresh.vocab
        assert all(torch.equal(c.splits[s], fresh.splits[s]) for s in fresh.splits)
        assert vocab_file.read_bytes() == good


def test_resume_drops_a_torn_metrics_record(tmp_path, monkeypatch):
    """A kill in the middle of appending to metrics.jsonl leaves half a line; the resumed run drops
    it (with the records after the checkpoint) and ends as an uninterrupted run."""
    cfg = cfg_of("train.max_step=6", "train.log_interval=1", "train.checkpoint_interval=3")
    train_in(cfg, tmp_path / "full")
    part = tmp_path / "part"
    train_killed(monkeypatch, cfg, part, 5)
    with open(part / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train_lo')
    train_in(cfg, part)
    assert comparable(part) == comparable(tmp_path / "full")
