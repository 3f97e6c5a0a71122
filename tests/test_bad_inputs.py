"""Bad input to every console script, as a table: each case must exit non-zero with
exactly one line on stderr, ``PROG: error: ...``, that names the file, key or value at fault,
print no traceback, and change no file.

The entry points run in this process (``sys.argv`` patched, :func:`tests.helpers.run_main`).
Everything they read is built here, in a temporary "world": tiny corpora, checkpoints of tiny
models trained for 2 steps, run folders, report folders. Before and after each case every file
of the world is hashed, except what Hydra itself writes for each invocation (``.hydra/`` and the
log file of the run folder given as ``hydra.run.dir``) and the case's own output folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from crtn.bench import main as bench_main
from crtn.convert import main as convert_main
from crtn.data import load_corpus
from crtn.eval_app import main as eval_main
from crtn.generate import main as generate_main
from crtn.report.cli import main as report_main
from crtn.train import main as train_main
from crtn.train import train_in
from tests.helpers import TINY_RUN, compose_train, run_main

PROGS: dict[str, Callable[[], object]] = {
    "crtn-train": train_main,
    "crtn-eval": eval_main,
    "crtn-generate": generate_main,
    "crtn-convert": convert_main,
    "crtn-report": report_main,
    "crtn-bench": bench_main,
}

PTB_LINES = ["the cat sat on the mat", "a dog ran to the cat", "the mat was red and the dog sat"]


def _ptb(folder: Path, lines: list[str], valid: str | None = None) -> Path:
    folder.mkdir(parents=True)
    text = "\n".join(lines * 40) + "\n"
    (folder / "train.txt").write_text(text)
    (folder / "valid.txt").write_text(valid if valid is not None else text[: len(text) // 3])
    (folder / "test.txt").write_text(text[: len(text) // 3])
    return folder


def _train(world: Path, name: str, *overrides: str) -> Path:
    run = world / "ckpt" / name
    train_in(compose_train([*TINY_RUN, "train.max_step=2", "train.eval_max_step=2", *overrides]), run)
    return run / "checkpoints" / "last.pt"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """The files the cases read (module docstring); never the real corpora."""
    w = tmp_path_factory.mktemp("world")
    data = w / "data"
    _ptb(data / "ok" / "penn", PTB_LINES)
    _ptb(data / "other" / "penn", [line.upper() for line in PTB_LINES])  # another vocabulary
    _ptb(data / "short" / "penn", PTB_LINES, valid="the cat\n")  # valid: 3 tokens
    _ptb(data / "empty" / "penn", PTB_LINES)
    (data / "empty" / "penn" / "train.txt").write_text("")
    wrong = data / "wrong" / "penn"  # WikiText's file names in PTB's folder
    wrong.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (wrong / f"wiki.{split}.tokens").write_text("a b c\n" * 50)
    texts = w / "text"
    texts.mkdir()
    (texts / "binary.txt").write_bytes(bytes(range(256)) * 40)
    (texts / "truncated.txt").write_bytes("ab ü\n".encode() * 300 + "ü".encode()[:1])  # cut mid-character
    (texts / "chars.txt").write_text("the quick brown fox jumps over the lazy dog. " * 300)
    (texts / "empty.txt").write_text("")
    (w / "file").write_text("not a folder")
    ptb = ["data=ptb", f"data.root={data / 'ok'}", "data.batch_size=2", "data.eval_batch_size=2"]
    syn = _train(w, "syn")
    _train(w, "ptb", *ptb[:2])
    _train(w, "char", "data=text", f"data.path={texts / 'chars.txt'}", "data.level=char")
    _train(w, "vanilla", "model=vanilla")
    bad = w / "bad"
    bad.mkdir()
    raw = syn.read_bytes()
    (bad / "truncated.pt").write_bytes(raw[: len(raw) // 3])
    (bad / "random.pt").write_bytes(b"PK\x03\x04 not really a zip file" * 10)
    cut = shutil.copytree(syn.parents[1], w / "ckpt" / "cut")  # a run whose last checkpoint was cut short
    (cut / "checkpoints" / "last.pt").write_bytes(raw[: len(raw) // 3])
    torch.save([1, 2, 3], bad / "list.pt")
    ckpt = torch.load(syn, weights_only=True)
    torch.save({**ckpt, "version": 99}, bad / "newer.pt")
    sd = {k: v for k, v in ckpt["model"].items()}
    torch.save(sd, bad / "state_dict.pt")  # crtn's own weights, not a release state_dict
    _release_sources(bad)
    # crtn-report folders: empty, and a job killed while writing its metrics
    (w / "report" / "empty").mkdir(parents=True)
    half = w / "report" / "half" / "0"
    shutil.copytree(syn.parents[1], half)
    (half / ".hydra").mkdir(exist_ok=True)
    (half / ".hydra" / "config.yaml").write_text("model: {name: crtn\n")  # cut mid-file
    for name in ("other", "short"):  # their caches exist before the cases: reading adds no file
        load_corpus(compose_train([*ptb[:1], f"data.root={data / name}"]).data)
    for d in (w / "out", w / "cwd"):
        d.mkdir()
    return w


def _release_sources(bad: Path) -> None:
    """Release-format state dicts (``MemTransformerLM.state_dict()``) with a tensor missing and with
    a tensor of the wrong shape, made from crtn's own converter test builders."""
    from tests.test_convert import RELEASE, make_hf, release_state_dict

    sd = release_state_dict(make_hf(**RELEASE))
    missing = dict(sd)
    del missing[sorted(k for k in sd if k.startswith("layers.1."))[0]]
    torch.save(missing, bad / "release_missing.pt")
    shaped = dict(sd)
    key = sorted(k for k in sd if k.endswith("pos_ff.CoreNet.0.weight"))[0]
    shaped[key] = torch.zeros(shaped[key].shape[0] + 1, shaped[key].shape[1])
    torch.save(shaped, bad / "release_shape.pt")


@dataclass
class Case:
    """``prog args`` (``{w}`` is the world folder, ``{out}`` the case's own output folder) must fail
    with one line containing every string of ``needles`` (also formatted)."""

    name: str
    prog: str
    args: list[str]
    needles: list[str]


T = [*TINY_RUN, "hydra.run.dir={out}/run"]
T_TXL = [a for a in T if not a.startswith("cache.")]  # no cache options (refused for a model without one)
PTB = ["data=ptb", "data.root={w}/data/ok", "data.batch_size=2", "data.eval_batch_size=2"]
SYN = "{w}/ckpt/syn/checkpoints/last.pt"
PTB_CKPT = "{w}/ckpt/ptb/checkpoints/last.pt"
EV = ["hydra.run.dir={out}/ev", "progress=false"]
B = ["bench.smoke=true", "bench.sections=[config,table]", "hydra.run.dir={out}/run"]

CASES = [
    # ------------------------------------------------------------------ crtn-train: config
    Case("unknown key", "crtn-train", [*T, "model.nonsense=1"], ["model.nonsense"]),
    Case("unknown key with +", "crtn-train", [*T, "+model.nonsense=1"], ["model.nonsense"]),
    Case("unknown top-level key", "crtn-train", [*T, "+nonsense=1"], ["'nonsense'"]),
    Case(
        "unknown train key", "crtn-train", [*T, "+train.x=1"], ["unknown key 'train.x' (not in the schema)"]
    ),
    Case(
        "unknown cache key", "crtn-train", [*T, "+cache.x=1"], ["unknown key 'cache.x' (not in the schema)"]
    ),
    Case("wrong type", "crtn-train", [*T, "model.n_layer=abc"], ["model.n_layer=abc"]),
    Case("wrong type bool", "crtn-train", [*T, "train.resume=maybe"], ["train.resume=maybe"]),
    Case("unknown option", "crtn-train", [*T, "model=nope"], ["model/nope"]),
    Case("tgt_len 0", "crtn-train", [*T, "model.tgt_len=0"], ["model.tgt_len=0"]),
    Case("mem_len negative", "crtn-train", [*T, "model.mem_len=-1"], ["model.mem_len=-1 must be >= 0"]),
    Case(
        "mem_len not a multiple",
        "crtn-train",
        [*T, "model.mem_len=12"],
        ["model.mem_len=12 must be a multiple of model.tgt_len=8"],
    ),
    Case("top_k negative", "crtn-train", [*T, "cache.top_k=-1"], ["cache.top_k=-1"]),
    Case("n_slot negative", "crtn-train", [*T, "cache.n_slot=-1"], ["cache.n_slot=-1"]),
    Case("n_slot with txl", "crtn-train", [*T, "model=txl", "cache.n_slot=4"], ["cache.n_slot=4", "txl"]),
    Case(
        "pos=match without token_max",
        "crtn-train",
        [*T, "summary=mean", "cache.pos=match"],
        ["cache.pos=match", "needs summary=token_max, not summary=mean"],
    ),
    Case("query/summary pairing", "crtn-train", [*T, "query=token", "summary=identity"], ["identity"]),
    Case("data.name", "crtn-train", [*T, "data.name=foo"], ["data.name='foo'"]),
    Case("data.root missing", "crtn-train", [*T, "data=ptb", "data.root={w}/nope"], ["{w}/nope/penn"]),
    Case("lr 0", "crtn-train", [*T, "optim.lr=0"], ["optim.lr=0"]),
    Case(
        "batch_chunk", "crtn-train", [*T, "data.batch_size=3", "train.batch_chunk=2"], ["train.batch_chunk=2"]
    ),
    Case("max_step 0", "crtn-train", [*T, "train.max_step=0"], ["train.max_step=0"]),
    Case("eval length", "crtn-train", [*T, "eval.tgt_len=3"], ["eval.mem_len=8", "eval.tgt_len=3"]),
    Case(
        "same_length without memory",
        "crtn-train",
        [*T, "model.mem_len=0", "model.same_length=true"],
        ["model.same_length=true with model.mem_len=0 masks every position of every query"],
    ),
    Case(
        "same_length vanilla",
        "crtn-train",
        [*T_TXL, "model=vanilla", "model.same_length=true"],
        ["model.same_length=true masks every position of every query of model=vanilla"],
    ),
    Case(
        "summary option unread",
        "crtn-train",
        [*T, "query=last_l", "summary=mean", "summary.ngram=8"],
        ["summary.ngram=8 is ignored by summary=mean (only token_max reads it)"],
    ),
    Case("no cuda", "crtn-train", [*T, "train.device=cuda"], ["train.device='cuda'"]),
    # ------------------------------------------------------------------ crtn-train: corpora
    Case("corpus missing", "crtn-train", [*T, *PTB, "data.root={w}/nowhere"], ["{w}/nowhere/penn"]),
    Case("corpus empty", "crtn-train", [*T, *PTB, "data.root={w}/data/empty"], ["train.txt", "empty"]),
    Case("corpus binary", "crtn-train", [*T, "data=text", "data.path={w}/text/binary.txt"], ["binary.txt"]),
    Case(
        "text empty", "crtn-train", [*T, "data=text", "data.path={w}/text/empty.txt"], ["empty.txt", "empty"]
    ),
    Case(
        "corpus truncated",
        "crtn-train",
        [*T, "data=text", "data.path={w}/text/truncated.txt"],
        ["truncated.txt"],
    ),
    Case(
        "corpus layout",
        "crtn-train",
        [*T, *PTB, "data.root={w}/data/wrong"],
        ["{w}/data/wrong/penn/train.txt"],
    ),
    Case(
        "split < one batch",
        "crtn-train",
        [*T, *PTB, "data.root={w}/data/short"],
        ["valid' has 3 tokens", "batch_size=2"],
    ),
    Case(
        "synthetic split short", "crtn-train", [*T, "data.synthetic.valid_tokens=6"], ["valid' has 6 tokens"]
    ),
    Case(
        "cache_dir a file",
        "crtn-train",
        [*T, *PTB, "data.cache_dir={w}/file/sub"],
        ["data.cache_dir", "{w}/file/sub"],
    ),
    # ------------------------------------------------------------------ crtn-train: checkpoints
    Case(
        "init_from missing",
        "crtn-train",
        [*T, "init_from={w}/bad/nope.pt"],
        ["{w}/bad/nope.pt", "does not exist"],
    ),
    Case(
        "init_from truncated",
        "crtn-train",
        [*T, "init_from={w}/bad/truncated.pt"],
        ["{w}/bad/truncated.pt", "cannot be read: it is truncated or corrupt"],
    ),
    Case(
        "init_from not a checkpoint",
        "crtn-train",
        [*T, "init_from={w}/bad/list.pt"],
        ["{w}/bad/list.pt", "not a crtn checkpoint"],
    ),
    Case(
        "init_from newer",
        "crtn-train",
        [*T, "init_from={w}/bad/newer.pt"],
        ["{w}/bad/newer.pt", "version 99"],
    ),
    Case(
        "init_from other model",
        "crtn-train",
        [*T, "model.d_inner=64", f"init_from={SYN}"],
        ["init_from=", "has shape"],
    ),
    Case(
        "init_from other vocab",
        "crtn-train",
        [*T, *PTB, "data.root={w}/data/other", f"init_from={PTB_CKPT}"],
        ["init_from=", "vocabulary"],
    ),
    # ------------------------------------------------------------------ crtn-train: run folders
    Case(
        "resume other model",
        "crtn-train",
        [*TINY_RUN, "model.n_layer=2", "train.max_step=2", "hydra.run.dir={w}/ckpt/syn"],
        ["model.n_layer: 1 -> 2"],
    ),
    Case(
        "resume other max_step",
        "crtn-train",
        [*TINY_RUN, "train.max_step=5", "train.eval_max_step=2", "hydra.run.dir={w}/ckpt/syn"],
        ["train.max_step: 2 -> 5", "train.allow_change=true"],
    ),
    Case(
        "resume truncated",
        "crtn-train",
        [*TINY_RUN, "train.max_step=2", "train.eval_max_step=2", "hydra.run.dir={w}/ckpt/cut"],
        ["{w}/ckpt/cut/checkpoints/last.pt", "cannot be read"],
    ),
    Case(
        "resume=false on a run",
        "crtn-train",
        [*TINY_RUN, "train.resume=false", "hydra.run.dir={w}/ckpt/syn"],
        ["{w}/ckpt/syn", "train.overwrite=true"],
    ),
    # ------------------------------------------------------------------ crtn-eval
    Case("eval no checkpoint", "crtn-eval", [*EV], ["checkpoint is required"]),
    Case(
        "eval missing",
        "crtn-eval",
        [*EV, "checkpoint={w}/bad/nope.pt"],
        ["{w}/bad/nope.pt", "does not exist"],
    ),
    Case(
        "eval truncated",
        "crtn-eval",
        [*EV, "checkpoint={w}/bad/truncated.pt"],
        ["{w}/bad/truncated.pt", "cannot be read: it is truncated or corrupt"],
    ),
    Case(
        "eval garbage",
        "crtn-eval",
        [*EV, "checkpoint={w}/bad/random.pt"],
        ["{w}/bad/random.pt", "truncated or corrupt"],
    ),
    Case(
        "eval a text file",
        "crtn-eval",
        [*EV, "checkpoint={w}/file"],
        ["{w}/file", "not a torch checkpoint file"],
    ),
    Case("eval newer", "crtn-eval", [*EV, "checkpoint={w}/bad/newer.pt"], ["{w}/bad/newer.pt", "version 99"]),
    Case(
        "eval a state_dict",
        "crtn-eval",
        [*EV, "checkpoint={w}/bad/state_dict.pt"],
        ["{w}/bad/state_dict.pt", "not a crtn checkpoint"],
    ),
    Case("eval split", "crtn-eval", [*EV, f"checkpoint={SYN}", "splits=[nope]"], ["'nope'"]),
    Case("eval tgt_len", "crtn-eval", [*EV, f"checkpoint={SYN}", "eval.tgt_len=0"], ["eval.tgt_len=0"]),
    Case("eval mem_len", "crtn-eval", [*EV, f"checkpoint={SYN}", "eval.mem_len=5"], ["eval.mem_len=5"]),
    Case(
        "eval other vocab",
        "crtn-eval",
        [*EV, f"checkpoint={PTB_CKPT}", "data.root={w}/data/other"],
        ["{w}/data/other", "vocabulary"],
    ),
    Case(
        "eval cache.n_slot",
        "crtn-eval",
        [*EV, f"checkpoint={SYN}", "cache.n_slot=16"],
        ["cache.n_slot=16 is not read at evaluation: give eval.n_slot=16"],
    ),
    Case(
        "eval same_length vanilla",
        "crtn-eval",
        [*EV, "checkpoint={w}/ckpt/vanilla/checkpoints/last.pt", "eval.same_length=true"],
        ["eval.same_length=true masks every position of every query of model=vanilla"],
    ),
    Case("eval unknown key", "crtn-eval", [*EV, f"checkpoint={SYN}", "+eval.nonsense=1"], ["eval.nonsense"]),
    # ------------------------------------------------------------------ crtn-generate
    Case("generate missing", "crtn-generate", ["checkpoint={w}/bad/nope.pt"], ["{w}/bad/nope.pt"]),
    Case("generate unknown key", "crtn-generate", [f"checkpoint={SYN}", "+x=1"], ["unknown key 'x'"]),
    Case("generate not a checkpoint", "crtn-generate", ["checkpoint={w}/bad/list.pt"], ["{w}/bad/list.pt"]),
    Case("generate oov prompt", "crtn-generate", [f"checkpoint={PTB_CKPT}", "prompt=the zebra"], ["'zebra'"]),
    Case(
        "generate empty prompt",
        "crtn-generate",
        ["checkpoint={w}/ckpt/char/checkpoints/last.pt", "prompt="],
        ["prompt"],
    ),
    Case(
        "generate prompt_file",
        "crtn-generate",
        [f"checkpoint={SYN}", "prompt_file={w}/nope.txt"],
        ["{w}/nope.txt"],
    ),
    Case(
        "generate max_new_tokens",
        "crtn-generate",
        [f"checkpoint={SYN}", "max_new_tokens=-1"],
        ["max_new_tokens=-1"],
    ),
    Case(
        "generate temperature", "crtn-generate", [f"checkpoint={SYN}", "temperature=-1"], ["temperature=-1"]
    ),
    Case(
        "generate cache.top_k",
        "crtn-generate",
        [f"checkpoint={SYN}", "cache.top_k=1"],
        ["cache.top_k=1 is not read at evaluation: give eval.top_k=1"],
    ),
    Case(
        "generate eval length", "crtn-generate", [f"checkpoint={SYN}", "eval.tgt_len=0"], ["eval.tgt_len=0"]
    ),
    # ------------------------------------------------------------------ crtn-convert
    Case("convert missing", "crtn-convert", ["src={w}/bad/nope.pt", "out={out}/c"], ["{w}/bad/nope.pt"]),
    Case(
        "convert unknown key",
        "crtn-convert",
        ["src={w}/bad/nope.pt", "out={out}/c", "data=ptb", "+data.x=1"],
        ["unknown key 'data.x'"],
    ),
    Case(
        "convert not torch", "crtn-convert", ["src={w}/file", "out={out}/c"], ["{w}/file", "not a torch file"]
    ),
    Case(
        "convert missing tensor",
        "crtn-convert",
        ["src={w}/bad/release_missing.pt", "out={out}/c"],
        ["layers.1."],
    ),
    Case(
        "convert wrong shape",
        "crtn-convert",
        ["src={w}/bad/release_shape.pt", "out={out}/c"],
        ["pos_ff.CoreNet.0", "has shape"],
    ),
    Case(
        "convert a crtn checkpoint",
        "crtn-convert",
        [f"src={SYN}", "out={out}/c"],
        ["already a crtn checkpoint"],
    ),
    Case(
        "convert format",
        "crtn-convert",
        ["src={w}/bad/release_shape.pt", "out={out}/c", "format=nope"],
        ["format"],
    ),
    # ------------------------------------------------------------------ crtn-report
    Case("report nothing", "crtn-report", [], ["no directory given"]),
    Case("report missing", "crtn-report", ["{w}/report/nope"], ["{w}/report/nope"]),
    Case("report empty", "crtn-report", ["{w}/report/empty"], ["{w}/report/empty"]),
    Case("report out a file", "crtn-report", ["{w}/report/half", "out={w}/file"], ["{w}/file"]),
    Case("report option", "crtn-report", ["{w}/report/empty", "nonsense=1"], ["nonsense"]),
    Case("report option type", "crtn-report", ["{w}/report/half", "plots=maybe"], ["plots"]),
    # ------------------------------------------------------------------ crtn-bench
    Case("bench section", "crtn-bench", [*B, "bench.sections=[config,nope]"], ["bench.sections='nope'"]),
    Case("bench no section", "crtn-bench", [*B, "bench.sections=[]"], ["bench.sections"]),
    Case("bench strategy", "crtn-bench", [*B, "bench.strategies=[nope]"], ["bench.strategies='nope'"]),
    Case("bench batch 0", "crtn-bench", [*B, "bench.batch=0"], ["bench.batch=0"]),
    Case("bench batch type", "crtn-bench", [*B, "bench.batch=abc"], ["bench.batch", "abc"]),
    Case("bench rounds", "crtn-bench", [*B, "bench.rounds=-1"], ["bench.rounds=-1"]),
    Case("bench device", "crtn-bench", [*B, "bench.device=cuda"], ["bench.device='cuda'"]),
    Case("bench device name", "crtn-bench", [*B, "bench.device=tpu9"], ["bench.device='tpu9'"]),
    # the table's rows are composed before the output folder is made: bench.only=[txl] composes one
    Case(
        "bench out a file",
        "crtn-bench",
        [*B, "bench.only=[txl]", "bench.out={w}/file"],
        ["bench.out", "{w}/file"],
    ),
    Case("bench unknown key", "crtn-bench", [*B, "bench.nonsense=1"], ["bench.nonsense"]),
    Case("bench unknown key with +", "crtn-bench", [*B, "+bench.nonsense=1"], ["bench.nonsense"]),
    Case("bench model", "crtn-bench", [*B, "model.tgt_len=0"], ["model.tgt_len=0"]),
    Case("bench pairing", "crtn-bench", [*B, "query=token", "summary=identity"], ["identity"]),
    Case("bench data group", "crtn-bench", [*B, "data=ptb"], ["data"]),
    Case("bench reference", "crtn-bench", [*B, "bench.reference=nope"], ["bench.reference='nope'"]),
    # a bad row after every default row (composed first); the other rows' cases time only the bad
    # row and the reference (bench.only), whose composition fails in the same place
    Case(
        "bench row option",
        "crtn-bench",
        [*B, "+bench.rows.bad=['model=nope']", "bench.only=[bad]"],
        ["bench.rows.bad", "model/nope"],
    ),
    Case(
        "bench row key",
        "crtn-bench",
        [*B, "+bench.rows.bad=['cache.nonsense=1']", "bench.only=[bad]"],
        ["bench.rows.bad", "nonsense"],
    ),
    Case(
        "bench row value",
        "crtn-bench",
        [*B, "+bench.rows.bad=['cache.n_slot=-1']", "bench.only=[bad]"],
        ["bench.rows.bad", "cache.n_slot=-1"],
    ),
    Case(
        "bench row group",
        "crtn-bench",
        [*B, "+bench.rows.bad=['bench.batch=2']", "bench.only=[bad]"],
        ["bench.rows.bad", "bench.batch=2"],
    ),
]


def world_hash(w: Path) -> dict[str, str]:
    """sha256 of every file of the world but the outputs and what Hydra writes per invocation."""
    out = {}
    for p in sorted(w.rglob("*")):
        rel = p.relative_to(w)
        if not p.is_file() or rel.parts[0] in ("out", "cwd") or ".hydra" in rel.parts:
            continue
        if p.name in ("train.log", ".lock"):
            continue
        out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def test_at_least_forty_cases_over_every_script():
    assert len(CASES) >= 40 and {c.prog for c in CASES} == set(PROGS)
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, world: Path, capfd, monkeypatch):
    out = world / "out" / re.sub(r"\W+", "_", case.name)
    fmt = {"w": str(world), "out": str(out)}
    args = [a.format(**fmt) for a in case.args]
    monkeypatch.chdir(world / "cwd")  # relative defaults (data/, outputs/) land outside the world
    before = world_hash(world)
    code, _, err = run_main(PROGS[case.prog], case.prog, args, capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{case.prog}: error: "), lines[0]
    for needle in case.needles:
        assert needle.format(**fmt) in lines[0], lines[0]
    assert world_hash(world) == before
    _record(case, lines[0].replace(str(world), "W"))


_SEEN: dict[str, str] = {}


def _record(case: Case, line: str) -> None:
    """With ``CRTN_BAD_INPUTS_LIST=FILE``, the last case writes every case's message there (JSON)."""
    _SEEN[case.name] = line
    target = os.environ.get("CRTN_BAD_INPUTS_LIST")
    if target and len(_SEEN) == len(CASES):
        Path(target).write_text(json.dumps({c.name: [c.prog, _SEEN[c.name]] for c in CASES}, indent=1))


def test_report_survives_a_half_written_job(world: Path, capfd):
    """A job killed while its files were written is listed as unreadable; the others are reported
    and the job folders are left as they were."""
    before = world_hash(world)
    out = world / "out" / "half_report"
    code, stdout, err = run_main(report_main, "crtn-report", [f"{world}/report/half", f"out={out}"], capfd)
    assert code == 0, err
    assert "| 0 | unreadable: .hydra/config.yaml |" in stdout
    assert world_hash(world) == before
