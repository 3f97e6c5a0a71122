"""tools/recall_diagnosis.py against crtn-eval's repeat metrics on the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from crtn.train import train_in
from tests.helpers import TINY_RUN, compose_train, load_tool


def _load_tool():
    return load_tool("recall_diagnosis")


def test_recall_diagnosis_counts_match_evaluation(tmp_path):
    """Its own hit test (copy source inside a selected slot) and argmax accuracy, computed in
    another way, give evaluate()'s repeat token count, accuracy and source_retrieved exactly."""
    run = tmp_path / "run"
    overrides = [
        *TINY_RUN,
        "query=token",  # the row match, whose copy the tool diagnoses
        "data.synthetic.repeat_skip=1",
        "cache.n_slot=12",  # 96 tokens: a copy's source and the source's own source (gaps 24-40)
        "train.max_step=40",
        "train.eval_interval=40",
    ]
    train_in(compose_train(overrides), run)  # crtn-train's run, in this process
    valid = json.loads((run / "results.json").read_text())["valid"]["repeat"]
    t = _load_tool().diagnose(str(run / "checkpoints/best.pt"), "valid", 4)
    keys = ("copy position", "distance // 32", "j // 8", "source row", "offset j - source row")
    for key in keys:  # each covers every token
        hits, correct, n = (sum(r[i] for r in t[key].values()) for i in range(3))
        assert n == valid["tokens"] > 0
        assert correct == round(valid["acc"] * n)
        assert hits == round(valid["source_retrieved"] * n)
    assert 0 < hits < n  # both outcomes occur, so the comparison says something
    assert (
        t["copy hits"] == round(valid["copy_retrieved"] * n) > hits
    )  # other copies of the text are found too
    ok_hit = sum(ok for ok, _ in t["alpha"].values())
    ok_miss, n_miss = t["misses"]["all"]
    assert n_miss == n - hits and ok_hit + ok_miss == correct
    assert sum(c for _, c in t["alpha"].values()) == hits
    assert set(t["copy position"]) <= set(range(2, 5))  # only tokens after repeat_skip=1 (passage_len 4)
    assert set(t["source row"]) <= set(range(8))  # the source's row in its slot: 0..tgt_len-1 (TINY_RUN: 8)
    # gaps are multiples of passage_len 4, so j - row = j - (j + 1 - gap) mod 8 is 3 or 7 mod 8
    assert set(t["offset j - source row"]) <= {-5, -1, 3, 7}

    # retrieved rows moved 3 positions farther: the same selection (made by the query pass,
    # before the attention), other predictions; moved back nearer than the memory: refused
    import crtn.model.attention as attention

    shifted = _load_tool().diagnose(str(run / "checkpoints/best.pt"), "valid", 4, shift=3)
    assert attention.rel_shift.__name__ == "rel_shift"  # restored
    for key in keys:
        assert [r[0] for r in shifted[key].values()] == [r[0] for r in t[key].values()]  # hits
        assert [r[2] for r in shifted[key].values()] == [r[2] for r in t[key].values()]  # tokens
    # the NLLs move where rows were retrieved, and only there
    from crtn.checkpoint import checkpoint_spec, load_checkpoint
    from crtn.data import load_corpus
    from crtn.model import build_model

    ckpt = load_checkpoint(run / "checkpoints/best.pt")
    cfg = checkpoint_spec(ckpt)
    corpus = load_corpus(cfg.data)
    model = build_model(cfg, len(corpus.vocab))
    model.load_state_dict(ckpt["model"])
    model.eval()

    def nlls(shift: int) -> list[tuple[bool, torch.Tensor]]:
        state, out = None, []
        with torch.no_grad(), _load_tool().shifted_distances(shift):
            for batch in corpus.iterator("valid", 4, model.tgt_len):
                o = model(batch.input, batch.target, state)
                state = o.state
                out.append((o.selection is not None, o.nll))
        return out

    moved = [(r, torch.equal(a, b)) for (r, a), (_, b) in zip(nlls(0), nlls(3), strict=True)]
    assert all(same for retrieved, same in moved if not retrieved)
    assert not any(same for retrieved, same in moved if retrieved) and any(r for r, _ in moved)
    with pytest.raises(ValueError, match="past the memory"):
        _load_tool().diagnose(str(run / "checkpoints/best.pt"), "valid", 4, shift=-9)  # mem_len 8


@pytest.mark.parametrize(("c", "m", "shift"), [(8, 8, 3), (8, 8, -5), (4, 0, 2), (16, 8, 0)])
def test_shifted_columns_are_the_concat_distances_moved(c, m, shift):
    """retrieved_columns picks, from the relative shift over an extended distance table, the
    columns whose distances are the concat layout's (docs/method.md §3 step 3), written out by
    hand: retrieved row r at c + M + i - r + shift from query i, key p of [memory; segment] at
    M + i - p (p <= M + i, the visible keys)."""
    import crtn.model.attention as attention

    L, extra = 5, max(shift, 0)
    R = extra + c + m + L
    x = (R - 1 - torch.arange(R, dtype=torch.float64)).expand(L, R)  # column j: distance R-1-j
    y = _load_tool().retrieved_columns(attention.rel_shift(x), c, extra, shift)
    assert y.shape == (L, c + m + L)
    for i in range(L):
        assert y[i, :c].tolist() == [c + m + i - r + shift for r in range(c)]
        assert y[i, c : c + m + i + 1].tolist() == [m + i - p for p in range(m + i + 1)]


def test_recall_diagnosis_rejects_txl(tmp_path):
    run = tmp_path / "run"
    txl = [a for a in TINY_RUN if not a.startswith("cache.")]  # txl has no cache: no cache.* settings
    train_in(compose_train([*txl, "model=txl", "train.max_step=2"]), run)  # crtn-train's run, in this process
    with pytest.raises(SystemExit, match="needs a crtn model"):
        _load_tool().diagnose(str(run / "checkpoints/best.pt"), "valid", 4)
