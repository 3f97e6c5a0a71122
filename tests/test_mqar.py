"""The multi-query associative recall corpus (crtn/data/mqar.py) and its answer metrics
(crtn/mqar_metrics.py): the layout read back token by token from tiny generated corpora, the
metrics against plain Python loops over a tiny model's outputs, crtn-train/crtn-eval end to end,
and the one-line errors of bad settings."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from crtn.config import train_config
from crtn.data import load_corpus
from crtn.data.mqar import AnswerSums, format_answers, gap_buckets, make_mqar, slot_distances
from crtn.data.task import scored_tokens
from crtn.errors import ConfigError
from crtn.evaluate import evaluate, format_metrics
from crtn.model.cache import Selection
from crtn.model.crtn import dependency_range
from crtn.objective import chunk_loss
from crtn.train import main as train_main
from tests.helpers import TINY_RUN, cli, compose_train, run_main, tiny_model

#: A tiny corpus: J = slot_len - spacing = 2, slot distances 5..11 (gaps 33..79 inside
#: [30, 80]), and doc_len = 140 = (11 + 2*5 - 1) slots of 7: exactly the schedule's bound.
TINY_MQAR = {
    "n_keys": 12,
    "n_values": 16,
    "n_filler": 9,
    "n_pairs": 5,
    "slot_len": 7,
    "spacing": 5,
    "min_gap": 30,
    "max_gap": 80,
    "doc_len": 140,
    "gap_dist": "uniform",
    "train_tokens": 6000,
    "valid_tokens": 1500,
    "test_tokens": 1500,
    "seed": 7,
}
#: A variant: pairs at fixed offsets (slot_len = spacing), slot distances 5..14, and documents of
#: 23 slots of 5 tokens (the bound) followed by a filler tail of 3 tokens.
NO_JITTER = {
    **TINY_MQAR,
    "slot_len": 5,
    "doc_len": 118,
    "min_gap": 25,
    "max_gap": 70,
    "gap_dist": "log_uniform",
}

# crtn-train overrides: TINY_RUN's model on the tiny corpus (tgt_len 4 <= spacing 5; the cache
# reaches m + N L = 4 + 20*4 = 84 >= max_gap)
TINY_MQAR_RUN = [
    *[
        o
        for o in TINY_RUN
        if not o.startswith(("data.synthetic", "model.tgt_len", "model.mem_len", "cache.n_slot"))
    ],
    "data=mqar",
    "model.tgt_len=4",
    "model.mem_len=4",
    "cache.n_slot=20",
    *(f"data.mqar.{k}={v}" for k, v in TINY_MQAR.items()),
]


def documents(tokens: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(start, tokens) of each document of a split, <eos> left out; the last may be truncated."""
    ends = np.flatnonzero(tokens == 0)
    starts = np.concatenate([[0], ends + 1])
    return [(int(s), tokens[s:e]) for s, e in zip(starts, [*ends, len(tokens)]) if e > s]


def read_pairs(doc: np.ndarray, n_keys: int) -> dict[int, list[int]]:
    """Each key id of a document -> the positions where it occurs (read from the tokens alone)."""
    where: dict[int, list[int]] = {}
    for p, t in enumerate(doc.tolist()):
        if 1 <= t <= n_keys:
            where.setdefault(t, []).append(p)
    return where


@pytest.mark.parametrize("settings", [TINY_MQAR, NO_JITTER], ids=["jitter", "no_jitter"])
def test_layout_read_back_from_the_tokens(settings):
    """Every pair, answer, label and gap where the layout says, read from the tokens alone."""
    c = make_mqar(settings)
    K, V, F = settings["n_keys"], settings["n_values"], settings["n_filler"]
    assert len(c.vocab) == 1 + K + V + F and c.vocab.eos_idx == 0
    assert {c.vocab.idx2sym[i][0] for i in range(1, K + 1)} == {"k"}
    assert {c.vocab.idx2sym[i][0] for i in range(K + 1, K + V + 1)} == {"v"}
    assert {c.vocab.idx2sym[i][0] for i in range(K + V + 1, K + V + F + 1)} == {"f"}
    n_answers = 0
    for split in ("train", "valid", "test"):
        tokens, labels = c.splits[split].numpy(), c.labels[split].numpy()
        assert len(tokens) == settings[f"{split}_tokens"] and labels.dtype == np.int32
        assert c.repeat_gap[split] is c.labels[split]
        prev_keys: set[int] = set()
        docs = documents(tokens)
        for d, (start, doc) in enumerate(docs):
            complete = start + len(doc) < len(tokens)
            assert len(doc) == settings["doc_len"] or not complete
            if not complete and 1 <= doc[-1] <= K:
                doc = doc[:-1]  # the truncation cut a pair after its key
            where = read_pairs(doc, K)
            lab = labels[start : start + len(doc)]
            expect = np.zeros_like(lab)
            for pos in where.values():
                assert len(pos) <= 2 and all(K < doc[p + 1] <= K + V for p in pos)  # k then a value
                if len(pos) == 2:  # write, then query: the same value, gap inside the range
                    gap = pos[1] - pos[0]
                    assert settings["min_gap"] <= gap <= settings["max_gap"]
                    assert doc[pos[1] + 1] == doc[pos[0] + 1]
                    expect[pos[1] + 1] = gap
            assert np.array_equal(lab, expect)
            n_answers += int((lab > 0).sum())
            # everything else is filler; no two pairs closer than spacing
            in_pair = np.zeros(len(doc), dtype=bool)
            keys_at = sorted(p for pos in where.values() for p in pos)
            in_pair[keys_at] = True
            in_pair[[p + 1 for p in keys_at]] = True
            assert ((doc[~in_pair] > K + V) & (doc[~in_pair] <= K + V + F)).all()
            assert all(b - a >= settings["spacing"] for a, b in zip(keys_at, keys_at[1:]))
            if complete:
                assert len(where) == settings["n_pairs"] and all(len(p) == 2 for p in where.values())
            if d > 0:
                assert not set(where) & prev_keys  # keys unused by the previous document
            prev_keys = set(where)
        assert labels[tokens == 0].sum() == 0
    assert n_answers > 50


def test_consecutive_queries_need_different_segments():
    """With tgt_len <= spacing, the stored values of two consecutive queries (and of any two pairs)
    lie in different segments, for every alignment of the segments."""
    c = make_mqar(TINY_MQAR)
    tokens, labels = c.splits["train"].numpy(), c.labels["train"].numpy()
    answers = np.flatnonzero(labels > 0)
    stored = answers - labels[answers]  # stream position of each answer's stored value
    for L in (TINY_MQAR["spacing"], TINY_MQAR["spacing"] - 2):
        for offset in range(L):
            seg = (stored + offset) // L
            assert (seg[1:] != seg[:-1]).all()
            assert len(set(seg.tolist())) == len(seg)
    assert (tokens[stored] == tokens[answers]).all()


def test_determinism_and_seeds():
    a, b = make_mqar(TINY_MQAR), make_mqar(dict(TINY_MQAR))
    other = make_mqar({**TINY_MQAR, "seed": 8})
    for s in ("train", "valid", "test"):
        assert torch.equal(a.splits[s], b.splits[s]) and torch.equal(a.labels[s], b.labels[s])
        assert not torch.equal(a.splits[s], other.splits[s])
    assert not torch.equal(a.splits["valid"], a.splits["test"])
    via_loader = load_corpus({"name": "mqar", "mqar": TINY_MQAR})
    assert via_loader.name == "mqar" and torch.equal(via_loader.splits["train"], a.splits["train"])


def test_gap_distribution_weights():
    """log_uniform (weight 1/d) puts about a third of the answers in each doubling of the gap;
    uniform favours the long gaps (the reservations tilt both a little further toward them)."""
    base = {"valid_tokens": 1000, "test_tokens": 1000}
    shares = {}
    for dist in ("uniform", "log_uniform"):
        s = make_mqar({**base, "gap_dist": dist}).info["splits"]["train"]
        shares[dist] = [n / s["answers"] for n in s["answers_by_gap"].values()]
    assert all(0.25 < x < 0.42 for x in shares["log_uniform"])
    # uniform over slot distances 13..102: 13/90, 26/90, 51/90 of the answers
    assert shares["uniform"][0] == pytest.approx(13 / 90, abs=0.03)
    assert shares["uniform"][2] == pytest.approx(51 / 90, abs=0.06)


def test_gap_buckets_and_slot_distances_by_hand():
    assert gap_buckets(1024, 8192) == [(1024, 2047), (2048, 4095), (4096, 8192)]
    assert gap_buckets(20, 100) == [(20, 39), (40, 79), (80, 100)]
    assert gap_buckets(100, 150) == [(100, 150)]
    assert gap_buckets(5, 5) == [(5, 5)]
    # J = 80 - 64 = 16: d >= (1024 + 16) / 80 = 13, d <= (8192 - 16) / 80 = 102.2
    assert slot_distances({"slot_len": 80, "spacing": 64, "min_gap": 1024, "max_gap": 8192}) == (13, 102)
    assert slot_distances(TINY_MQAR) == (5, 11)


def reference_answers(model, corpus, split, batch_size):
    """The answer metrics by plain Python loops over the model's outputs, segment by segment:
    gaps read from the split itself (not the batches' labels), buckets by comparisons."""
    it = corpus.iterator(split, batch_size, model.tgt_len)
    gaps = corpus.labels[split][: it.stream_len * batch_size].view(batch_size, -1).tolist()
    buckets = corpus.info["gap_buckets"]
    state = model.init_state(batch_size, "cpu")
    acc = {"all": [0, 0], "cut": 0, "where": [0, 0, 0, 0, 0]}
    per_bucket = {f"{lo}-{hi}": [0.0, 0, 0] for lo, hi in buckets}
    with torch.no_grad():
        for batch in it:
            out = model(batch.input, batch.target, state)
            state = out.state
            pred = model.crit.log_prob(out.hidden).argmax(-1)
            t0 = batch.index * model.tgt_len
            cache = getattr(state, "cache", None)
            for b in range(batch_size):
                for j in range(batch.seq_len):
                    right = int(pred[b, j]) == int(batch.target[b, j])
                    acc["all"][0] += right
                    acc["all"][1] += 1
                    gap = gaps[b][t0 + j + 1]
                    if gap == 0:
                        continue
                    src = t0 + j + 1 - gap
                    if src < 0:
                        acc["cut"] += 1
                        continue
                    name = next(f"{lo}-{hi}" for lo, hi in buckets if lo <= gap <= hi)
                    per_bucket[name][0] += float(out.nll[b, j])
                    per_bucket[name][1] += right
                    per_bucket[name][2] += 1
                    acc["where"][0] += src >= max(t0 - model.mem_len, 0)
                    if cache is not None and cache.n_valid > 0:
                        slots = cache.pos[b, : cache.n_valid].tolist()
                        acc["where"][1] += any(p <= src < p + cache.seg_len for p in slots)
                        if out.selection is not None:
                            picked = [t0 - int(a) for a in out.selection.age[b, j]]
                            acc["where"][2] += any(p <= src < p + cache.seg_len for p in picked)
                            layers = [[t0 - int(a) for a in s.age[b, j]] for s in out.layer_selections]
                            acc["where"][4] += any(
                                p <= src < p + cache.seg_len for layer in layers or [picked] for p in layer
                            )
                    acc["where"][3] += 1
    return acc, per_bucket


@pytest.mark.parametrize("name", ["crtn", "txl"])
def test_answer_metrics_match_a_plain_loop(name):
    corpus = make_mqar(TINY_MQAR)
    # tgt_len 3, mem_len 3, 12 slots: the cache reaches 3 + 36 = 39 tokens, so some pairs
    # (gaps 33..39) are cached and others are not
    model = tiny_model(len(corpus.vocab), **{"model.name": name, "cache.n_slot": 12})
    m = evaluate(model, corpus, "valid", batch_size=2, device="cpu")
    ref, per_bucket = reference_answers(model, corpus, "valid", 2)
    a = m["answers"]
    assert m["acc"] == pytest.approx(ref["all"][0] / ref["all"][1])
    assert a["cut"] == ref["cut"] > 0  # stream 2 starts mid-document: some pairs lie before it
    n = sum(v[2] for v in per_bucket.values())
    assert a["tokens"] == n == ref["where"][3] > 20
    assert a["loss"] == pytest.approx(sum(v[0] for v in per_bucket.values()) / n, rel=1e-9)
    assert a["ppl"] == pytest.approx(math.exp(a["loss"]))
    assert a["acc"] == pytest.approx(sum(v[1] for v in per_bucket.values()) / n)
    assert a["chance_acc"] == 1 / 16 and a["chance_loss"] == pytest.approx(math.log(16))
    assert list(a["by_gap"]) == list(per_bucket) == ["30-59", "60-80"]
    for key, (nll, right, count) in per_bucket.items():
        assert a["by_gap"][key]["tokens"] == count > 0
        assert a["by_gap"][key]["loss"] == pytest.approx(nll / count, rel=1e-9)
        assert a["by_gap"][key]["acc"] == pytest.approx(right / count)
    assert a["pair_in_memory"] == 0.0 == ref["where"][0]  # gaps >= 30 > m + L
    if name == "crtn":
        assert a["pair_in_cache"] == pytest.approx(ref["where"][1] / n) and 0 < a["pair_in_cache"] < 1
        assert a["pair_retrieved"] == pytest.approx(ref["where"][2] / n)
        assert 0 < ref["where"][2] <= ref["where"][1]
    else:
        assert "pair_in_cache" not in a and "pair_retrieved" not in a
    assert "repeat" not in m and "freq_buckets" not in m
    assert "pair_retrieved_any_layer" not in a  # one selection serves every layer, or none


def test_gate_answer_metrics_count_the_slots_of_every_retrieving_layer():
    """With selection inside attention (query=gate, both layers retrieving) ``pair_retrieved``
    reads the top layer's slots and ``pair_retrieved_any_layer`` the slots of either layer, each
    recomputed by the plain loop from the model's outputs."""
    torch.manual_seed(0)
    corpus = make_mqar(TINY_MQAR)
    options = {"query.strategy": "gate", "cache.layers": None, "cache.top_k": 2}
    # 24 slots of 3 tokens: the cache holds most stored values (gaps 33..79)
    model = tiny_model(len(corpus.vocab), **{"model.name": "crtn", "cache.n_slot": 24, **options})
    a = evaluate(model, corpus, "valid", batch_size=2, device="cpu")["answers"]
    ref, _ = reference_answers(model, corpus, "valid", 2)
    n = ref["where"][3]
    assert a["tokens"] == n > 20
    assert a["pair_retrieved"] == pytest.approx(ref["where"][2] / n)
    assert a["pair_retrieved_any_layer"] == pytest.approx(ref["where"][4] / n)
    # the layers disagree: the any-layer count is not the top layer's
    assert 0 < ref["where"][2] < ref["where"][4] <= ref["where"][1]


def _selection(age: torch.Tensor, found: torch.Tensor | None = None) -> Selection:
    """A selection of the slots ``age`` [B, L, k] back (only ``age`` and ``found`` are read)."""
    zero = torch.zeros_like(age)
    return Selection(slot=zero, flat_index=zero, alpha=torch.ones(age.shape), age=age, found=found)


def test_a_token_that_retrieves_nothing_retrieves_no_pair():
    """A lookup's token without a match reports slot 0 with found False: the stored value that
    slot holds is not counted as retrieved."""
    corpus = SimpleNamespace(name="mqar", info={"gap_buckets": [[30, 59], [60, 80]], "n_values": 16})
    cache = SimpleNamespace(pos=torch.tensor([[0, 3, 6, 9]]), n_valid=4, seg_len=3)
    answer, src = torch.tensor([[True, True]]), torch.tensor([[1, 4]])  # in the slots at 0 and 3
    age = 30 - torch.tensor([[[0], [3]]])
    sums = AnswerSums(corpus, "cpu")
    sums.has_cache = True
    sums.locate(
        answer, src, 30, mem_len=3, cache=cache, selection=_selection(age, torch.tensor([[[False], [True]]]))
    )
    assert sums.where.tolist() == [0, 2, 1, 2, 1]


def test_pair_retrieved_any_layer_by_hand():
    """Two retrieving layers select apart: a stored value in a slot only the bottom layer
    retrieved counts in ``pair_retrieved_any_layer`` and not in ``pair_retrieved`` (the top
    layer's); one a non-answer's slots hold counts in neither."""
    corpus = SimpleNamespace(name="mqar", info={"gap_buckets": [[30, 59], [60, 80]], "n_values": 16})
    # four cached slots of 3 tokens at stream positions 0, 3, 6, 9; the step starts at t0 = 30
    cache = SimpleNamespace(pos=torch.tensor([[0, 3, 6, 9]]), n_valid=4, seg_len=3)
    t0 = 30
    answer = torch.tensor([[True, True, True, False]])
    src = torch.tensor([[1, 4, 10, 7]])  # stored values in the slots at 0, 3, 9 and 6
    # slot starts t0 - age; top (k = 1): 0, 9, 6, 6; bottom (k = 2): (6, 9), (3, 0), (0, 3), (6, 6)
    top = _selection(t0 - torch.tensor([[[0], [9], [6], [6]]]))
    bottom = _selection(t0 - torch.tensor([[[6, 9], [3, 0], [0, 3], [6, 6]]]))
    layered = AnswerSums(corpus, "cpu")
    layered.has_cache = True
    layered.locate(answer, src, t0, mem_len=3, cache=cache, selection=top, layer_selections=(bottom, top))
    # in memory (src >= 27): none; cached: 3 answers; top: src 1; either layer: src 1 and 4
    assert layered.where.tolist() == [0, 3, 1, 3, 2]
    assert layered.layered
    a = layered.metrics()["answers"]
    assert a["pair_in_cache"] == 1.0
    assert a["pair_retrieved"] == pytest.approx(1 / 3)
    assert a["pair_retrieved_any_layer"] == pytest.approx(2 / 3)

    single = AnswerSums(corpus, "cpu")  # one selection serves every layer: no any-layer entry
    single.has_cache = True
    single.locate(answer, src, t0, mem_len=3, cache=cache, selection=top)
    assert single.where.tolist() == [0, 3, 1, 3, 1] and not single.layered
    assert "pair_retrieved_any_layer" not in single.metrics()["answers"]


def test_answer_sums_by_hand():
    """Gaps on the bucket edges (59 | 60, the last bucket closed at 80) and a pair before the
    stream's start, worked out by hand."""
    corpus = SimpleNamespace(name="mqar", info={"gap_buckets": [[30, 59], [60, 80]], "n_values": 16})
    sums = AnswerSums(corpus, "cpu")
    label = torch.tensor([[0, 59, 60], [30, 80, 0]], dtype=torch.int32)
    target = torch.tensor([[1, 2, 3], [4, 5, 6]])
    pred = torch.tensor([[1, 0, 3], [4, 5, 0]])  # right, wrong, right / right, right, wrong
    nll = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    # t0 = 60: stored values at 62-59 = 3, 63-60 = 3, 61-30 = 31, and 62-80 = -18 (cut)
    answer, src = sums.update(label, target, nll, pred, t0=60)
    assert answer.tolist() == [[False, True, True], [True, False, False]]
    assert src[answer].tolist() == [3, 3, 31]
    m = sums.metrics()
    assert m["acc"] == pytest.approx(4 / 6)
    a = m["answers"]
    assert (a["tokens"], a["cut"], a["loss"], a["acc"]) == (3, 1, pytest.approx(3.0), pytest.approx(2 / 3))
    assert a["by_gap"] == {
        "30-59": {"tokens": 2, "loss": pytest.approx(3.0), "acc": pytest.approx(0.5)},
        "60-80": {"tokens": 1, "loss": pytest.approx(3.0), "acc": pytest.approx(1.0)},
    }
    assert "pair_in_memory" not in a  # locate() was not called


def test_format_answers_by_hand():
    m = {
        "split": "test",
        "loss": 2.0,
        "ppl": math.exp(2.0),
        "tokens": 1000,
        "acc": 0.25,
        "answers": {
            "tokens": 10,
            "ppl": 3.5,
            "acc": 0.6,
            "chance_acc": 0.125,
            "by_gap": {"30-59": {"tokens": 6, "acc": 0.5}, "60-80": {"tokens": 0}},
            "pair_retrieved": 0.9,
        },
    }
    assert format_answers(m) == [
        "acc 0.250",
        "answers ppl 3.50 acc 0.600 (chance 0.125; by gap 30-59 0.500), pair retrieved 0.90",
    ]
    assert format_metrics(m) == "test: ppl 7.39 (loss 2.0000, 1,000 tokens) | " + " | ".join(
        format_answers(m)
    )
    assert format_answers({"split": "test"}) == []
    m["answers"]["pair_retrieved_any_layer"] = 0.95
    assert format_answers(m)[1].endswith("pair retrieved 0.90; by any layer 0.95")


def test_train_and_eval_report_the_answer_metrics(tmp_path):
    run = tmp_path / "run"
    p = cli(
        "crtn.train",
        [
            *TINY_MQAR_RUN,
            "train.max_step=8",
            "train.eval_interval=4",
            "train.log_interval=4",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    res = json.loads((run / "results.json").read_text())
    assert res["data"] == "mqar"
    for split in ("valid", "test"):
        a = res[split]["answers"]
        assert a["tokens"] > 0 and 0 <= a["acc"] <= 1 and a["chance_acc"] == 1 / 16
        assert list(a["by_gap"]) == ["30-59", "60-80"] and "pair_retrieved" in a
        assert 0 <= res[split]["acc"] <= 1
    assert "final test: ppl" in p.stdout and "answers ppl" in p.stdout
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert any("valid_answers_acc" in r for r in recs)
    e = cli(
        "crtn.eval_app",
        [
            f"checkpoint={run / 'checkpoints/best.pt'}",
            "splits=[test]",
            "progress=false",
            f"hydra.run.dir={tmp_path / 'ev'}",
        ],
        tmp_path,
    )
    assert e.returncode == 0, e.stderr
    ev = json.loads((tmp_path / "ev/eval.json").read_text())["test"]
    assert ev["answers"]["loss"] == pytest.approx(res["test"]["answers"]["loss"], rel=1e-6)
    assert ev["answers"]["tokens"] == res["test"]["answers"]["tokens"]
    assert "answers ppl" in e.stdout


def test_answers_only_run_survives_a_validation_without_answers(tmp_path):
    """Trained on the answers, a run whose periodic validation reads no answer (one segment of 4
    tokens: every answer lies 30 or more tokens after its pair, so none is scored) keeps best.pt
    as it is, says why, and is judged by its final evaluation over the whole split."""
    run = tmp_path / "run"
    p = cli(
        "crtn.train",
        [
            *TINY_MQAR_RUN,
            "data.mqar.train_loss=answers",
            "train.max_step=6",
            "train.eval_interval=3",
            "train.eval_max_step=1",
            f"hydra.run.dir={run}",
        ],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    out = p.stdout + p.stderr
    assert out.count("validation scored no answers") == 2  # steps 3 and 6
    assert not (run / "checkpoints/best.pt").exists()
    res = json.loads((run / "results.json").read_text())
    assert res["valid"]["answers"]["tokens"] > 0 and res["test"]["answers"]["tokens"] > 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "valid_loss" in r] == [3, 6]


@pytest.mark.parametrize(
    "override, key",
    [
        ({"min_gap": 90, "max_gap": 80}, "data.mqar.min_gap=90 and max_gap=80"),
        ({"doc_len": 139}, "data.mqar.doc_len=139 is too short"),
        ({"min_gap": 31, "max_gap": 36}, "no slot distance"),  # d = 5: gaps 33..37; d = 4: 26..30
        ({"n_keys": 9}, "data.mqar.n_keys=9"),
        ({"spacing": 8}, "data.mqar.slot_len=7 must be >= spacing=8"),
        ({"spacing": 1}, "data.mqar.spacing=1"),
        ({"n_values": 0}, "data.mqar.n_values=0"),
        ({"n_pairs": 0}, "data.mqar.n_pairs=0"),
        ({"valid_tokens": 0}, "data.mqar.valid_tokens=0"),
        ({"gap_dist": "zipf"}, "data.mqar.gap_dist='zipf'"),
        ({"train_loss": "keys"}, "data.mqar.train_loss='keys' is not one of: all, answers"),
    ],
)
def test_config_errors(override, key):
    with pytest.raises(ConfigError, match=key) as e:
        make_mqar({**TINY_MQAR, **override})
    assert "\n" not in str(e.value)


def test_bad_setting_is_one_line_on_the_command_line(capfd, tmp_path):
    code, _, err = run_main(
        train_main,
        "crtn-train",
        [
            *(o for o in TINY_MQAR_RUN if "doc_len" not in o),
            "data.mqar.doc_len=100",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        capfd,
    )
    assert code == 2
    assert err.strip().splitlines() == [
        "crtn-train: error: data.mqar.doc_len=100 is too short for n_pairs=5 pairs queried up to "
        "max_gap=80 tokens later: needs at least 140 tokens (20 slots of slot_len=7)"
    ]


def test_experiment_reaches_the_longest_gap():
    """+experiment=mqar: CRTN's range m + N L covers max_gap, Transformer-XL's n_layer m + L stays
    below min_gap, and tgt_len <= spacing (each query's pair in a segment of its own)."""
    cfg = compose_train(["+experiment=mqar"])
    m, data = cfg.model, cfg.data.mqar
    assert cfg.data.name == "mqar" and cfg.model.name == "crtn"
    assert dependency_range(m.mem_len, cfg.cache.n_slot, m.tgt_len) >= data.max_gap
    assert m.n_layer * m.mem_len + m.tgt_len < data.min_gap
    assert m.tgt_len <= data.spacing
    assert train_config().data.mqar == data  # the experiment keeps the schema's corpus


def test_answer_loss_of_chunks_by_hand():
    """Two chunks of a step: with answers only, each chunk's NLL sum over its answers is divided
    by the step's count, so the parts add up to the mean over the step's answers; without, each
    chunk's mean is halved; a step without an answer has loss 0."""
    nll = torch.tensor([[[1.0, 2.0], [3.0, 4.0]], [[5.0, 6.0], [7.0, 8.0]]])  # [chunk, B, L]
    label = torch.tensor([[0, 70], [45, 0], [0, 0], [0, 33]])  # [B = 4, L]: answers 2, 3 and 8
    hidden = torch.zeros(2, 2, 8)
    mask, count = scored_tokens(label)
    assert int(count) == 3
    parts = [
        chunk_loss(nll[c], hidden, chunks=2, scored=(mask[2 * c : 2 * c + 2], count))[1].item()
        for c in (0, 1)
    ]
    assert parts == pytest.approx([5 / 3, 8 / 3]) and sum(parts) == pytest.approx(13 / 3)
    every = [chunk_loss(nll[c], hidden, chunks=2)[1].item() for c in (0, 1)]
    assert every == pytest.approx([2.5 / 2, 6.5 / 2])  # the step's mean, 4.5
    none = scored_tokens(torch.zeros(2, 2, dtype=torch.int32))
    assert int(none[1]) == 1 and chunk_loss(nll[0], hidden, scored=none)[1].item() == 0.0
    with pytest.raises(ValueError, match="carries no labels"):
        scored_tokens(None)
