"""RECL, the relative effective context length (crtn/analysis/recl.py; Dai et al. 2019, section
4.3 and appendix, and the CRTN authors' variant): gains and RECL of both definitions on per-token
losses whose values are worked out by hand, and ``crtn-recl`` end to end on tiny trained
checkpoints, bad input included.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from crtn.analysis.recl import AT_LEAST, AT_MOST, FOUND, THRESHOLDS, n_hardest, recl_of, relative_gains
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
# base b(c0) = [4, 1, 2, 2, 3.5, 1, 1, 1, 2, 1] (sum 18.5), b(c1) = [3, 1, 2, 2, 3.5, 1, 1, 1, 1, 1] (16.5);
# b(c1) <= b(c0) everywhere, so the crtn_authors base (carried forward) is the same here.
# r = 0.1: one token. tau(c0) = {0} (b = 4): A: min(4, 3) = 3, f 4 -> 3; B: min(4, 4), f 4 -> 4.
#          tau(c1) = {4} (b = 3.5): A: min(3.5, 3.5), f 3.5 -> 3.5; B: min(3.5, 2) = 2, f 3.5 -> 2.
# r = 1.0: every token. f(c0, c0) = 1.85; A at c1 saves 1 on token 0, B 1 on token 8: f -> 1.75;
#          f(c1, c1) = 1.65; A at c2: no change; B saves 1.5 on token 4: f -> 1.5.
GAINS = {
    # dai: 1 - exp(f' - f)
    ("dai", 0.1): [[1 - math.exp(-1), 0.0], [0.0, 1 - math.exp(-1.5)]],
    ("dai", 1.0): [[1 - math.exp(-0.1), 0.0], [1 - math.exp(-0.1), 1 - math.exp(-0.15)]],
    # crtn_authors: (f - f') / f
    ("crtn_authors", 0.1): [[0.25, 0.0], [0.0, 1.5 / 3.5]],
    ("crtn_authors", 1.0): [[0.1 / 1.85, 0.0], [0.1 / 1.85, 0.15 / 1.65]],
}


@pytest.mark.parametrize("definition,ratio", list(GAINS))
def test_relative_gains_by_hand(definition, ratio):
    gains = relative_gains(LOSSES, ratio, definition)
    assert gains.shape == (2, 2) and gains.dtype == torch.float64
    want = torch.tensor(GAINS[definition, ratio], dtype=torch.float64)
    assert torch.allclose(gains, want, rtol=0, atol=1e-15)


def test_recl_by_hand_and_the_threshold():
    g = {key: relative_gains(LOSSES, key[1], key[0]).tolist() for key in GAINS}
    for definition in ("dai", "crtn_authors"):
        t = THRESHOLDS[definition]
        # r = 0.1: A gains, then not at c1 -> RECL c1 = 128 (the c before it, 64, was the old
        # off-by-one answer); B's first gain is 0 -> the scan stops at c0: at most 64
        assert recl_of(g[definition, 0.1][0], CONTEXTS, t) == (128, FOUND)
        assert recl_of(g[definition, 0.1][1], CONTEXTS, t) == (64, AT_MOST)
        # r = 1.0: A as at 0.1; B never below inside the range: the scan reaches c2 = 192
        assert recl_of(g[definition, 1.0][0], CONTEXTS, t) == (128, FOUND)
        assert recl_of(g[definition, 1.0][1], CONTEXTS, t) == (192, AT_LEAST)
    # the threshold: a gain equal to it passes (>=); above every gain, nothing passes
    assert recl_of([0.25, 0.0], CONTEXTS, 0.25) == (128, FOUND)
    assert recl_of([0.25, 0.0], CONTEXTS, 0.2500001) == (64, AT_MOST)
    assert recl_of([0.1, 0.15], CONTEXTS, 0.0) == (192, AT_LEAST)
    # the scan stops at the first gain below the threshold, even if a later one is above
    assert recl_of([0.5, 0.005, 0.5, 0.5], [10, 20, 30, 40, 50], 0.01) == (20, FOUND)
    assert recl_of([0.5, 0.5, 0.5, 0.005], [10, 20, 30, 40, 50], 0.01) == (40, FOUND)
    assert recl_of([0.5, 0.5, 0.5, 0.5], [10, 20, 30, 40, 50], 0.01) == (50, AT_LEAST)


# One model, 2 tokens, r = 1 (the base is the model itself). At a loss of 20 nats a step that
# takes 0.015 off the mean is a perplexity reduction of 1 - exp(-0.015) = 0.01489 (>= 0.01) but a
# loss reduction of 0.015 / 20 = 0.00075 (< 0.001); at 5 nats, 0.008 off is 1 - exp(-0.008) =
# 0.00797 (< 0.01) but 0.008 / 5 = 0.0016 (>= 0.001).
HIGH = [[20, 20], [19.97, 20], [19.97, 19.99]]  # f: 20 -> 19.985; then 19.985 -> 19.98
LOW = [[5, 5], [4.984, 5], [4.984, 4.999]]  # f: 5 -> 4.992; then 4.992 -> 4.9915
STEPS = [100, 200, 300]


def test_the_definitions_differ_by_hand():
    high = torch.tensor([HIGH], dtype=torch.float64)
    low = torch.tensor([LOW], dtype=torch.float64)
    dai_high, auth_high = relative_gains(high, 1.0, "dai")[0], relative_gains(high, 1.0, "crtn_authors")[0]
    dai_low, auth_low = relative_gains(low, 1.0, "dai")[0], relative_gains(low, 1.0, "crtn_authors")[0]
    want = {
        "dai_high": [1 - math.exp(-0.015), 1 - math.exp(-0.005)],  # 0.014888, 0.0049875
        "auth_high": [0.015 / 20, 0.005 / 19.985],  # 0.00075, 0.00025
        "dai_low": [1 - math.exp(-0.008), 1 - math.exp(-0.0005)],  # 0.0079681, 0.00049988
        "auth_low": [0.008 / 5, 0.0005 / 4.992],  # 0.0016, 0.00010016
    }
    for name, got in [
        ("dai_high", dai_high),
        ("auth_high", auth_high),
        ("dai_low", dai_low),
        ("auth_low", auth_low),
    ]:
        assert torch.allclose(got, torch.tensor(want[name], dtype=torch.float64), rtol=1e-9, atol=0), name
    # high losses: Dai's RECL is 200 (gain 0.0149 passes, then 0.0050 fails); the authors' stops
    # at once (0.00075 < 0.001): at most 100; the old rule (loss ratio, threshold 0.01, the c
    # before the failing one) had no RECL at all (< 100)
    assert recl_of(dai_high.tolist(), STEPS, THRESHOLDS["dai"]) == (200, FOUND)
    assert recl_of(auth_high.tolist(), STEPS, THRESHOLDS["crtn_authors"]) == (100, AT_MOST)
    # low losses: the other way round
    assert recl_of(dai_low.tolist(), STEPS, THRESHOLDS["dai"]) == (100, AT_MOST)
    assert recl_of(auth_low.tolist(), STEPS, THRESHOLDS["crtn_authors"]) == (200, FOUND)


def test_the_authors_base_is_carried_forward_by_hand():
    # one model, 2 tokens, r = 1: token 1 gets worse at c1 and back at c2
    losses = torch.tensor([[[4, 2], [3, 3], [3, 2], [3, 2]]], dtype=torch.float64)
    # dai: b(c0) = [4, 2], f 3 -> mean(min([4, 2], [3, 3])) = 2.5; b(c1) = [3, 3], f 3 -> 2.5;
    #      b(c2) = [3, 2], f 2.5 -> 2.5
    dai = relative_gains(losses, 1.0, "dai")[0]
    want_dai = [1 - math.exp(-0.5), 1 - math.exp(-0.5), 0.0]
    assert torch.allclose(dai, torch.tensor(want_dai, dtype=torch.float64), rtol=0, atol=1e-15)
    # crtn_authors: the base at c1 is min([4, 2], [3, 3]) = [3, 2], f 2.5, and c2 gains nothing
    auth = relative_gains(losses, 1.0, "crtn_authors")[0]
    assert torch.allclose(auth, torch.tensor([0.5 / 3, 0.0, 0.0], dtype=torch.float64), rtol=0, atol=1e-15)
    assert recl_of(dai.tolist(), [10, 20, 30, 40], 0.01) == (30, FOUND)
    assert recl_of(auth.tolist(), [10, 20, 30, 40], 0.001) == (20, FOUND)


def test_hardest_token_count_and_bad_arguments():
    assert [n_hardest(r, 10, "dai") for r in (0.1, 0.21, 0.25, 0.3, 0.5, 1.0, 0.01)] == [1, 2, 3, 3, 5, 10, 1]
    assert [n_hardest(r, 10, "crtn_authors") for r in (0.1, 0.21, 0.25, 0.3, 0.5, 1.0, 0.01)] == [
        1, 3, 3, 3, 5, 10, 1,
    ]  # fmt: skip
    # r = 0.21 of 10 tokens: dai keeps the 2 hardest (b = 9, 8), crtn_authors 3 (and 7)
    one = torch.tensor(
        [[[9, 8, 7, 1, 1, 1, 1, 1, 1, 1], [8, 7, 6, 1, 1, 1, 1, 1, 1, 1]]], dtype=torch.float64
    )
    assert relative_gains(one, 0.21, "dai").item() == pytest.approx(1 - math.exp(-1), abs=1e-15)
    assert relative_gains(one, 0.21, "crtn_authors").item() == pytest.approx(3 / 24, abs=1e-15)
    with pytest.raises(ValueError, match="ratio=0"):
        n_hardest(0, 10, "dai")
    with pytest.raises(ValueError, match="contexts >= 2"):
        relative_gains(LOSSES[:, :1], 0.1, "dai")
    with pytest.raises(ValueError, match="one fewer"):
        recl_of([0.1, 0.2], CONTEXTS[:2], 0.01)
    with pytest.raises(ConfigError, match="definition='xl' is not one of: dai, crtn_authors"):
        relative_gains(LOSSES, 0.1, "xl")


@pytest.mark.parametrize("definition", ["dai", "crtn_authors"])
def test_a_zero_base_gives_zero_gain(definition):
    assert relative_gains(torch.zeros(2, 3, 4), 0.5, definition).eq(0).all()


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
    assert (result["corpus"], result["split"], result["delta"]) == ("synthetic", "valid", 8)
    assert (result["definition"], result["threshold"]) == ("dai", 0.01)  # Dai et al. 2019 by default
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
            assert e["status"] in (FOUND, AT_LEAST, AT_MOST) and min(e["gains"]) >= 0
            assert e["recl"] in result["contexts"]
        # no memory: no gain, so the scan stops at c0
        assert per_model["va"] == {"recl": 8, "status": AT_MOST, "gains": [0.0] * 4}
    md = (run / "recl.md").read_text()
    assert "| va | fixed | <= 8 | <= 8 |" in md and "## Relative gain g(c, c + Δ), r = 0.1" in md
    assert "definition `dai`" in md
    assert (run / "recl_gain.png").read_bytes()[:4] == b"\x89PNG"
    assert "RECL (dai) r=0.1: xl " in out
    # the authors' variant: its own threshold, the same losses
    run2 = tmp_path / "run2"
    code, out, err = run_main(
        main, "crtn-recl", [*args[:-1], "definition=crtn_authors", f"hydra.run.dir={run2}"], capfd
    )
    assert code == 0, err
    other = json.loads((run2 / "recl.json").read_text())
    assert (other["definition"], other["threshold"]) == ("crtn_authors", 0.001)
    assert [m["loss"] for m in other["models"]] == [m["loss"] for m in result["models"]]
    assert "RECL (crtn_authors) r=0.1: xl " in out


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
        (["checkpoints=[{crtn}]", "definition=paper"], "definition='paper' is not one of: dai, crtn_authors"),
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
