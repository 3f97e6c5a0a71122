"""RECL, the relative effective context length (crtn/analysis/recl.py; Dai et al. 2019, section
4.3): gains and RECL on per-token losses whose values are worked out by hand, and ``crtn-recl``
end to end on tiny trained checkpoints, bad input included.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from crtn.analysis.recl import AT_LEAST, BELOW_RANGE, FOUND, n_hardest, recl_of, relative_gains
from crtn.analysis.recl_app import context_lengths, main, per_token_nll
from crtn.checkpoint import checkpoint_spec, load_checkpoint
from crtn.data import load_corpus
from crtn.errors import ConfigError
from crtn.evaluate import evaluate
from crtn.model import build_model, evaluation_spec, with_spec
from crtn.train import train_in
from tests.helpers import TINY_RUN, compose_train, run_main

# ----------------------------------------------------------------------------- by hand

# 2 models (A, B) x 3 contexts (c0, c1, c2) x 10 tokens
A = [
    [5, 1, 2, 3, 3.5, 1, 1, 2, 2, 1],  # c0
    [3, 1, 2, 3, 3.5, 1, 1, 2, 2, 1],  # c1: token 0 from 5 to 3
    [3, 1, 2, 3, 3.5, 1, 1, 2, 2, 1],  # c2: no change
]
B = [
    [4, 2, 2, 2, 5, 1, 2, 1, 2, 1],  # c0
    [4, 2, 2, 2, 5, 1, 2, 1, 1, 1],  # c1: token 8 from 2 to 1
    [4, 2, 2, 2, 2, 1, 2, 1, 1, 1],  # c2: token 4 from 5 to 2
]
LOSSES = torch.tensor([A, B], dtype=torch.float64)
CONTEXTS = [64, 128, 192]
# base b(c0) = [4, 1, 2, 2, 3.5, 1, 1, 1, 2, 1] (sum 18.5), b(c1) = [3, 1, 2, 2, 3.5, 1, 1, 1, 1, 1] (16.5)
GAINS = {
    # r = 0.1: one token. tau(c0) = {0} (b = 4): A: min(4, 3) = 3 -> (4 - 3) / 4; B: min(4, 4) -> 0.
    #          tau(c1) = {4} (b = 3.5): A: min(3.5, 3.5) -> 0; B: min(3.5, 2) = 2 -> 1.5 / 3.5.
    0.1: [[0.25, 0.0], [0.0, 1.5 / 3.5]],
    # r = 1.0: every token. f(c0, c0) = 1.85; A at c1 saves 1 on token 0, B 1 on token 8: 17.5 / 10;
    #          f(c1, c1) = 1.65; A at c2: no change; B saves 1.5 on token 4: 15 / 10.
    1.0: [[0.1 / 1.85, 0.0], [0.1 / 1.85, 0.15 / 1.65]],
}


@pytest.mark.parametrize("ratio", [0.1, 1.0])
def test_relative_gains_by_hand(ratio):
    gains = relative_gains(LOSSES, ratio)
    assert gains.shape == (2, 2) and gains.dtype == torch.float64
    assert torch.allclose(gains, torch.tensor(GAINS[ratio], dtype=torch.float64), rtol=0, atol=1e-15)


def test_recl_by_hand_and_the_threshold():
    g01 = relative_gains(LOSSES, 0.1).tolist()
    g10 = relative_gains(LOSSES, 1.0).tolist()
    # r = 0.1: A gains 0.25 then 0 -> RECL c0; B's first gain is 0 -> below the range
    assert recl_of(g01[0], CONTEXTS, 0.01) == (64, FOUND)
    assert recl_of(g01[1], CONTEXTS, 0.01) == (None, BELOW_RANGE)
    # r = 1.0: A 0.054 then 0 -> c0; B 0.054 then 0.091 -> never below: at least c1
    assert recl_of(g10[0], CONTEXTS, 0.01) == (64, FOUND)
    assert recl_of(g10[1], CONTEXTS, 0.01) == (128, AT_LEAST)
    # the threshold: a gain equal to it counts (>=); above every gain, nothing counts
    assert recl_of(g01[0], CONTEXTS, 0.25) == (64, FOUND)
    assert recl_of(g01[0], CONTEXTS, 0.2500001) == (None, BELOW_RANGE)
    assert recl_of(g10[1], CONTEXTS, 0.06) == (None, BELOW_RANGE)
    assert recl_of(g10[1], CONTEXTS, 0.0) == (128, AT_LEAST)
    # the scan stops at the first gain below the threshold, even if a later one is above
    assert recl_of([0.5, 0.005, 0.5, 0.5], [10, 20, 30, 40, 50], 0.01) == (10, FOUND)
    assert recl_of([0.5, 0.5, 0.5, 0.005], [10, 20, 30, 40, 50], 0.01) == (30, FOUND)


def test_hardest_token_count_and_bad_arguments():
    assert [n_hardest(r, 10) for r in (0.1, 0.25, 0.5, 1.0, 0.01)] == [1, 3, 5, 10, 1]
    with pytest.raises(ValueError, match="ratio=0"):
        n_hardest(0, 10)
    with pytest.raises(ValueError, match="contexts >= 2"):
        relative_gains(LOSSES[:, :1], 0.1)
    with pytest.raises(ValueError, match="one fewer"):
        recl_of([0.1, 0.2], CONTEXTS[:2], 0.01)


def test_a_zero_base_gives_zero_gain():
    assert relative_gains(torch.zeros(2, 3, 4), 0.5).eq(0).all()


# ----------------------------------------------------------------------------- crtn-recl


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """Tiny checkpoints on the tiny synthetic corpus: txl, crtn (m = L = 8, N = 4) and vanilla."""
    root = tmp_path_factory.mktemp("recl")
    out = {}
    for name in ("txl", "crtn", "vanilla"):
        overrides = [*TINY_RUN, "train.max_step=3", "train.eval_max_step=1", f"model={name}"]
        train_in(compose_train(overrides), root / name)
        out[name] = root / name / "checkpoints" / "last.pt"
    return out


def _model(path: Path):
    ckpt = load_checkpoint(path)
    cfg = checkpoint_spec(ckpt)
    corpus = load_corpus(cfg.data)
    model = build_model(cfg, len(corpus.vocab))
    model.load_state_dict(ckpt["model"])
    return model.eval(), corpus


def test_context_lengths_per_kind(ckpts):
    crtn, _ = _model(ckpts["crtn"])
    txl, _ = _model(ckpts["txl"])
    vanilla, _ = _model(ckpts["vanilla"])
    assert (context_lengths(crtn, 40).n_slot, context_lengths(crtn, 40).mem_len) == (4, None)  # 8 + 4*8
    assert context_lengths(crtn, 8).n_slot == 0 and context_lengths(crtn, 8).same_length is True
    assert (context_lengths(txl, 37, False).mem_len, context_lengths(txl, 37, False).same_length) == (
        37,
        False,
    )
    assert context_lengths(vanilla, 64).mem_len is None and context_lengths(vanilla, 64).same_length is None
    for bad in (12, 4):
        with pytest.raises(ConfigError, match=f"context {bad} is not m"):
            context_lengths(crtn, bad)


def test_per_token_nll_is_the_evaluation_of_those_columns(ckpts):
    txl, corpus = _model(ckpts["txl"])
    got = per_token_nll(txl, corpus, "valid", context=24, columns=(40, 60), batch_size=4, device="cpu")
    at_24 = with_spec(txl, evaluation_spec(txl.spec, context_lengths(txl, 24)))
    assert at_24.mem_len == 24 and at_24.same_length
    full = evaluate(at_24, corpus, "valid", batch_size=4, device="cpu", per_token=True)["nll_tokens"]
    assert txl.mem_len == 8 and not txl.same_length  # the trained model is unchanged
    assert got.shape == (4, 20) and torch.equal(got, full[:, 40:60])


def test_crtn_recl_end_to_end(ckpts, tmp_path, capfd):
    run = tmp_path / "run"
    args = [
        f"checkpoints=[{ckpts['txl']},{ckpts['crtn']},{ckpts['vanilla']}]",
        "names=[xl,cr,va]",
        "delta=8",
        "c_max=40",
        "ratios=[0.1,1.0]",
        "max_tokens=200",
        "progress=false",
        f"hydra.run.dir={run}",
    ]
    code, out, err = run_main(main, "crtn-recl", args, capfd)
    assert code == 0, err
    result = json.loads((run / "recl.json").read_text())
    assert result["contexts"] == [8, 16, 24, 32, 40]  # c0: the crtn's m = 8, a multiple of delta
    assert (result["batch_size"], result["tokens"]) == (4, 200)  # data.eval_batch_size=4, 50 per stream
    assert result["columns"] == [48, 98]  # warm-up c_max + L = 48
    assert (result["corpus"], result["split"], result["delta"], result["threshold"]) == (
        "synthetic",
        "valid",
        8,
        0.01,
    )
    assert [(m["name"], m["model"], m["context"]) for m in result["models"]] == [
        ("xl", "txl", "mem_len"),
        ("cr", "crtn", "n_slot"),
        ("va", "vanilla", "fixed"),
    ]
    assert all(len(m["loss"]) == 5 for m in result["models"])
    assert len(set(result["models"][2]["loss"])) == 1  # no memory: the same losses at every c
    assert set(result["recl"]) == {"0.1", "1.0"}
    for per_model in result["recl"].values():
        assert set(per_model) == {"xl", "cr", "va"}
        for e in per_model.values():
            assert set(e) == {"recl", "status", "gains"} and len(e["gains"]) == 4
            assert e["status"] in (FOUND, AT_LEAST, BELOW_RANGE) and min(e["gains"]) >= 0
        assert per_model["va"] == {"recl": None, "status": BELOW_RANGE, "gains": [0.0] * 4}
    md = (run / "recl.md").read_text()
    assert "| va | fixed | < 8 | < 8 |" in md and "## Relative gain g(c, c + Δ), r = 0.1" in md
    assert (run / "recl_gain.png").read_bytes()[:4] == b"\x89PNG"
    assert "RECL r=0.1: xl " in out


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["checkpoints=[{w}/none.pt]"], "{w}/none.pt"),
        (["checkpoints=[{crtn}]", "delta=12"], "delta=12 is not a multiple of tgt_len=8"),
        (["checkpoints=[{crtn}]", "delta=8", "c0=12"], "c0=12"),
        (["checkpoints=[{crtn}]", "delta=8", "c_max=44"], "c_max=44"),
        (["checkpoints=[{crtn},{txl}]", "names=[a]"], "names has 1 entries for 2 checkpoints"),
        (["checkpoints=[{crtn}]", "max_tokens=100000"], "max_tokens"),
        (["checkpoints=[{crtn}]", "ratios=[0.1,2.0]"], "ratios: 2.0"),
        (["checkpoints=[{crtn}]", "split=dev"], "split='dev'"),
    ],
)
def test_bad_input_is_one_line(ckpts, tmp_path, capfd, extra, needle):
    fmt = {"w": str(tmp_path), "crtn": str(ckpts["crtn"]), "txl": str(ckpts["txl"])}
    given = dict(a.format(**fmt).split("=", 1) for a in extra)
    base = {"delta": "8", "c_max": "40", "progress": "false", "hydra.run.dir": str(tmp_path / "run")}
    args = [f"{k}={v}" for k, v in {**base, **given}.items()]
    code, _, err = run_main(main, "crtn-recl", args, capfd)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and lines[0].startswith("crtn-recl: error: "), err
    assert needle.format(**fmt) in lines[0], lines[0]
    assert not (tmp_path / "run" / "recl.json").exists()
