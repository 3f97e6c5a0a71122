"""Loss by distance to the previous occurrence (crtn/analysis/distance.py; Rae & Razavi 2020,
Sun et al. 2021): distances and buckets written out by hand, against a naive loop over tokens,
the evaluation's per-bucket sums against a Python loop over a tiny model's per-token losses, the
on-disk cache, and crtn-report's figure and table from fabricated job folders.
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import crtn.analysis.distance as distance_mod
from crtn.analysis.distance import (
    BUCKETS,
    MAX_NGRAM,
    bucket_summary,
    previous_occurrences,
    split_occurrences,
    stream_codes,
)
from crtn.config import schema_node
from crtn.data import load_corpus
from crtn.data.spec import DataSpec
from crtn.evaluate import evaluate
from crtn.report import write_report
from crtn.report.distance import KINDS
from tests.helpers import tiny_model
from tests.test_report import assert_png

# ----------------------------------------------------------------------------- by hand

# a 20-token split cut into 2 streams of 10:
#   stream 0: a b c a b c d a b e     (positions 0-9)
#   stream 1: f a b c e f a b c g     (positions 10-19)
TEXT = "a b c a b c d a b e f a b c e f a b c g".split()
SYM = {s: i for i, s in enumerate("abcdefg")}
IDS = np.array([SYM[s] for s in TEXT])


def test_previous_occurrences_by_hand():
    prev = previous_occurrences(IDS)
    assert prev.shape == (MAX_NGRAM, 20) and prev.dtype == np.int32
    # symbols, in the whole split (streams ignored here)
    #        a   b   c  a  b  c   d  a  b   e   f  a  b  c  e   f   a   b   c   g
    sym = [-1, -1, -1, 0, 1, 2, -1, 3, 4, -1, -1, 7, 8, 5, 9, 10, 11, 12, 13, -1]
    assert prev[0].tolist() == sym
    # bigrams ending at each position: ab bc ca ab bc cd da ab be ef fa ab bc ce ef fa ab bc cg
    big = [-1, -1, -1, -1, 1, 2, -1, -1, 4, -1, -1, -1, 8, 5, -1, 10, 11, 12, 13, -1]
    assert prev[1].tolist() == big
    # trigrams: "a b c" at 3-5 and 11-13 repeat 0-2 and 3-5; "e f a", "f a b", "a b c" at 14-16,
    # 15-17, 16-18 repeat 9-11, 10-12, 11-13
    tri = [-1] * 20
    tri[5], tri[13], tri[16], tri[17], tri[18] = 2, 5, 11, 12, 13
    assert prev[2].tolist() == tri
    # 4-grams: "e f a b" at 14-17 repeats 9-12 (across the streams), "f a b c" at 15-18 repeats 10-13
    four = [-1] * 20
    four[17], four[18] = 12, 13
    assert prev[3].tolist() == four


def test_stream_codes_by_hand():
    """Two streams of 10: occurrences in the other stream do not count, nor n-grams that straddle
    the stream start."""
    symbol, ngram = stream_codes(previous_occurrences(IDS), n_stream=2, stream_len=10)
    F = 0  # first occurrence; every distance here is in bucket 1 (1-31)
    # stream 0: a b c a b c d a b e -> distances 3 3 3 at 3-5, 4 4 at 7-8
    # stream 1: f a b c e f a b c g -> a (11), b, c, e (14) occurred only in stream 0: first
    assert symbol.tolist() == [[F, F, F, 1, 1, 1, F, 1, 1, F], [F, F, F, F, F, 1, 1, 1, 1, F]]
    # longest previous n-gram, code = bucket * (MAX_NGRAM + 1) + n:
    #   3: "a" (1), 4: "a b" (2), 5: "a b c" (3), 7: "a" (1), 8: "a b" (2);
    #   15: "f" (1): the bigram "e f" occurred at 9-10, across the stream start;
    #   16: "f a" (2): "e f a" at 9-11 straddles; 17: "f a b" (3): "e f a b" at 9-12 straddles;
    #   18: "f a b c" (4) at 10-13, inside stream 1
    c = lambda n: 1 * (MAX_NGRAM + 1) + n  # noqa: E731
    assert ngram.tolist() == [
        [F, F, F, c(1), c(2), c(3), F, c(1), c(2), F],
        [F, F, F, F, F, c(1), c(2), c(3), c(4), F],
    ]


@pytest.mark.parametrize(
    "d,bucket",
    [(1, 1), (31, 1), (32, 2), (127, 2), (128, 3), (511, 3), (512, 4), (2047, 4), (2048, 5)]
    + [(8191, 5), (8192, 6), (20000, 6)],
)
def test_bucket_edges(d, bucket):
    ids = np.arange(d + 1)
    ids[d] = ids[0]  # one repeat, d tokens back; everything else is new
    symbol, ngram = stream_codes(previous_occurrences(ids), n_stream=1, stream_len=d + 1)
    assert symbol[0, d] == bucket and ngram[0, d] == bucket * (MAX_NGRAM + 1) + 1
    assert (
        BUCKETS[bucket] == ["first", "1-31", "32-127", "128-511", "512-2047", "2048-8191", ">=8192"][bucket]
    )
    assert (symbol[0, :d] == 0).all()


# ----------------------------------------------------------------------------- naive reference


def naive_bucket(d: int | None) -> int:
    if d is None:
        return 0
    for i, (lo, hi) in enumerate([(1, 31), (32, 127), (128, 511), (512, 2047), (2048, 8191)], start=1):
        if lo <= d <= hi:
            return i
    return 6


def naive_distances(ids: list[int], p: int, start: int) -> tuple[int | None, int, int | None]:
    """(symbol distance, longest n, its distance) of position p in a stream starting at ``start``,
    by scanning back token by token."""
    d_sym = next((p - q for q in range(p - 1, start - 1, -1) if ids[q] == ids[p]), None)
    best_n, best_d = 0, None
    for n in range(1, MAX_NGRAM + 1):
        if p - n + 1 < start:
            continue
        gram = ids[p - n + 1 : p + 1]
        q = next((q for q in range(p - 1, start + n - 2, -1) if ids[q - n + 1 : q + 1] == gram), None)
        if q is not None:
            best_n, best_d = n, p - q
    return d_sym, best_n, best_d


@pytest.mark.parametrize("seed,vocab,n_stream", [(0, 3, 1), (1, 5, 3), (2, 40, 2), (3, 2, 4)])
def test_stream_codes_match_a_naive_scan(seed, vocab, n_stream):
    rng = random.Random(seed)
    ids = [rng.randrange(vocab) for _ in range(301)]
    stream_len = len(ids) // n_stream
    symbol, ngram = stream_codes(previous_occurrences(np.array(ids)), n_stream, stream_len)
    for p in range(n_stream * stream_len):
        d_sym, n, d = naive_distances(ids, p, p - p % stream_len)
        row, col = divmod(p, stream_len)
        assert symbol[row, col] == naive_bucket(d_sym), p
        assert ngram[row, col] == naive_bucket(d) * (MAX_NGRAM + 1) + n, p


# ----------------------------------------------------------------------------- evaluation


def _corpus_dir(root: Path) -> Path:
    rng = random.Random(7)
    words = "the cat sat on a mat and dog ran far".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randrange(3, 9))) for _ in range(60)]
    folder = root / "penn"
    folder.mkdir(parents=True)
    for name in ("train.txt", "valid.txt", "test.txt"):
        (folder / name).write_text("\n".join(lines) + "\n")
    return root


def _ptb(root: Path):
    return load_corpus(DataSpec(name="ptb", root=str(root)))


def assert_sums_match_a_loop(m: dict, ids: list[int], n_stream: int) -> None:
    """``m["distance_buckets"]`` of an evaluation against sums over its per-token NLL (a Python
    loop over the tokens, distances by :func:`naive_distances`)."""
    nll = m["nll_tokens"]  # [n_stream, columns]; column j predicts stream position j + 1
    stream_len = len(ids) // n_stream
    sums = {k: {b: [0.0, 0] for b in range(7)} for k in ("symbol", "ngram")}
    per_n = {b: [0] * (MAX_NGRAM + 1) for b in range(7)}
    for row in range(n_stream):
        for j in range(nll.shape[1]):
            p = row * stream_len + j + 1
            d_sym, n, d = naive_distances(ids, p, row * stream_len)
            for kind, bucket in (("symbol", naive_bucket(d_sym)), ("ngram", naive_bucket(d))):
                sums[kind][bucket][0] += nll[row, j].item()
                sums[kind][bucket][1] += 1
            per_n[naive_bucket(d)][n] += 1
    db = m["distance_buckets"]
    assert db["tokens"] == m["tokens"] == nll.numel()
    for kind in ("symbol", "ngram"):
        for b, name in enumerate(BUCKETS):
            entry = db[kind][name]
            total, count = sums[kind][b]
            assert entry["tokens"] == count, (kind, name)
            if count:
                assert entry["loss"] == pytest.approx(total / count, rel=1e-6)  # per_token NLL is float32
                assert entry["loss_share"] == pytest.approx(total / nll.sum().item(), rel=1e-6)
            else:
                assert entry["loss"] is None
    for b, name in enumerate(BUCKETS):
        assert db["ngram"][name]["ngram_tokens"] == {str(n): per_n[b][n] for n in range(1, MAX_NGRAM + 1)}


@pytest.mark.parametrize("model_name,max_step", [("crtn", None), ("txl", 2)])
def test_evaluation_sums_match_a_python_loop(tmp_path, model_name, max_step):
    corpus = _ptb(_corpus_dir(tmp_path))
    model = tiny_model(n_token=len(corpus.vocab), **{"model.name": model_name})
    m = evaluate(model, corpus, "valid", batch_size=3, device="cpu", per_token=True, max_step=max_step)
    assert_sums_match_a_loop(m, corpus.splits["valid"].tolist(), n_stream=3)
    if max_step is not None:
        assert m["tokens"] == 3 * max_step * 3  # 3 streams x 2 segments x tgt_len 3
    db = m["distance_buckets"]
    # reach: m + N*L + L = 3 + 3*3 + 3 for crtn (N = 3 slots), 3 + 3 for txl, whose layers reach 2*3 + 3
    assert (db["reach_tokens"], db["layer_reach_tokens"]) == ((15, None) if model_name == "crtn" else (6, 9))
    assert db["corpus"] == "ptb" and db["split"] == "valid" and db["model"] == model_name
    marks = [db["symbol"][b]["reach"] for b in BUCKETS]
    assert marks == [None, "partly", "beyond", "beyond", "beyond", "beyond", "beyond"]


@pytest.mark.parametrize("corpus_kind", ["char", "synthetic"])
def test_evaluation_on_character_and_synthetic_corpora(tmp_path, corpus_kind):
    cfg = schema_node(DataSpec)
    if corpus_kind == "char":
        (tmp_path / "chars.txt").write_text("the quick brown fox jumps over the lazy dog.\n" * 30)
        cfg.name, cfg.path, cfg.level, cfg.split = (
            "text",
            str(tmp_path / "chars.txt"),
            "char",
            [0.6, 0.2, 0.2],
        )
    else:
        cfg.synthetic.train_tokens, cfg.synthetic.valid_tokens, cfg.synthetic.test_tokens = 2000, 600, 600
    corpus = load_corpus(cfg)
    model = tiny_model(n_token=len(corpus.vocab), **{"model.name": "txl"})
    m = evaluate(model, corpus, "test", batch_size=2, device="cpu", per_token=True)
    assert_sums_match_a_loop(m, corpus.splits["test"].tolist(), n_stream=2)
    assert m["distance_buckets"]["corpus"] == ("text" if corpus_kind == "char" else "synthetic")


def test_reach_marks_by_hand():
    sums = torch.zeros(2, len(BUCKETS) * (MAX_NGRAM + 2), dtype=torch.float64)
    sums[:, 1] = torch.tensor([6.0, 3.0])  # 3 tokens at 1-31 with NLL 2
    sums[:, len(BUCKETS) + 1 * (MAX_NGRAM + 1) + 2] = torch.tensor([6.0, 3.0])  # the same, bigrams
    out = bucket_summary(sums, reach=512, layer_reach=127)
    assert [out["symbol"][b]["reach"] for b in BUCKETS] == [None, "within", "within", "within"] + [
        "partly",
        "beyond",
        "beyond",
    ]
    assert [out["symbol"][b]["layer_reach"] for b in BUCKETS[1:4]] == ["within", "within", "beyond"]
    assert out["symbol"]["1-31"] == {
        "lo": 1,
        "hi": 31,
        "tokens": 3,
        "loss": 2.0,
        "loss_share": 1.0,
        "reach": "within",
        "layer_reach": "within",
    }
    assert out["ngram"]["1-31"]["ngram_tokens"] == {"1": 0, "2": 3, "3": 0, "4": 0}
    assert out["symbol"]["first"]["loss"] is None and out["tokens"] == 3 and out["loss"] == 2.0


# ----------------------------------------------------------------------------- cache


def test_cache_is_reused_and_a_corrupt_file_rebuilt(tmp_path, monkeypatch):
    corpus = _ptb(_corpus_dir(tmp_path))
    folder = Path(corpus.info["cache_dir"])
    calls = []
    real = distance_mod.previous_occurrences
    monkeypatch.setattr(distance_mod, "previous_occurrences", lambda ids: calls.append(1) or real(ids))
    expected = real(corpus.splits["test"].numpy())

    first = split_occurrences(corpus, "test")
    files = list(folder.glob("prevocc-*.npy"))
    assert len(calls) == 1 and len(files) == 1 and (first == expected).all()
    mtime = files[0].stat().st_mtime_ns
    again = split_occurrences(corpus, "test")
    assert len(calls) == 1 and files[0].stat().st_mtime_ns == mtime and (again == expected).all()
    # valid and test hold the same text here: the content key shares the file
    split_occurrences(corpus, "valid")
    assert len(calls) == 1 and len(list(folder.glob("prevocc-*.npy"))) == 1

    files[0].write_bytes(files[0].read_bytes()[:100])  # torn
    assert (split_occurrences(corpus, "test") == expected).all() and len(calls) == 2
    np.save(files[0], np.zeros_like(expected))  # readable, but not this split's
    assert (split_occurrences(corpus, "test") == expected).all() and len(calls) == 3
    assert (np.load(files[0]) == expected).all()
    assert (split_occurrences(corpus, "test") == expected).all() and len(calls) == 3


def test_a_corpus_without_a_cache_folder_is_computed(monkeypatch, tmp_path):
    from crtn.data import make_synthetic

    corpus = make_synthetic({"train_tokens": 2000, "valid_tokens": 500, "test_tokens": 500})
    assert "cache_dir" not in corpus.info
    prev = split_occurrences(corpus, "valid")
    assert (prev == previous_occurrences(corpus.splits["valid"].numpy())).all()


# ----------------------------------------------------------------------------- crtn-report


def _buckets(corpus: str, model: str, base: float, reach: int, layer: int | None) -> dict:
    out = {"corpus": corpus, "split": "test", "model": model, "reach_tokens": reach}
    out["layer_reach_tokens"] = layer
    for k, kind in enumerate(("symbol", "ngram")):
        table = {}
        for i, b in enumerate(BUCKETS):
            loss = None if b == ">=8192" else base + 0.25 * i + 0.125 * k
            table[b] = {"tokens": 0 if loss is None else 100 * (i + 1), "loss": loss}
            table[b]["reach"] = None if i == 0 else ("within" if i <= 2 else "beyond")
        out[kind] = table
    return out


def _job(root: Path, name: str, model_override: str, data: str, db: dict, extra: tuple = ()) -> dict:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(
        json.dumps({"model": {"name": db["model"]}, "data": {"name": data}})
    )
    (d / ".hydra" / "overrides.yaml").write_text(
        json.dumps([f"model={model_override}", f"data={data}", *extra])
    )
    (d / "status.json").write_text(json.dumps({"state": "done"}))
    results = {"model": db["model"], "data": data, "metric": "ppl"}
    results["valid"] = {"split": "valid", "loss": 3.1, "ppl": 22.2}
    results["test"] = {"split": "test", "loss": 3.0, "ppl": 20.0, "distance_buckets": db}
    (d / "results.json").write_text(json.dumps(results))
    return db


def test_report_figure_and_table_from_fabricated_jobs(tmp_path):
    sweep = tmp_path / "sweep"
    dbs = {
        "0": _job(sweep, "0", "crtn", "wt2", _buckets("wt2", "crtn", 3.0, 304, None)),
        "1": _job(sweep, "1", "txl", "wt2", _buckets("wt2", "txl", 3.5, 128, 320)),
        "2": _job(sweep, "2", "txl_long", "wt2", _buckets("wt2", "txl", 3.25, 320, 1088)),
        "3": _job(sweep, "3", "crtn", "ptb", _buckets("ptb", "crtn", 4.0, 304, None)),
    }
    files = write_report(sweep)
    for name in ("distance_nll_wt2.png", "distance_nll_ptb.png"):
        assert name in files
        assert_png(files[name])
    with open(files["distance_nll.csv"], newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["job"], r["analysis"]) for r in rows] == [
        (j, k) for j in ("0", "1", "2", "3") for k in ("symbol", "ngram")
    ]
    for r in rows:
        db, base = dbs[r["job"]], dbs["1"]
        assert r["model"] == {"0": "crtn", "1": "txl", "2": "txl_long", "3": "crtn"}[r["job"]]
        for b in BUCKETS:
            mine = db[r["analysis"]][b]["loss"]
            assert r[f"nll_{b}"] == ("" if mine is None else repr(mine))
            if r["corpus"] == "wt2" and mine is not None:
                assert r["baseline"] == "1"
                assert float(r[f"diff_{b}"]) == mine - base[r["analysis"]][b]["loss"]
            else:
                assert r[f"diff_{b}"] == ""
    md = files["report.md"].read_text()
    assert "### wt2 (test split): minus txl (job 1)" in md
    assert "### ptb (test split): mean NLL; none: no txl job for corpus ptb, no differences" in md
    # job 0 (crtn) against job 1 (txl): 3.0 - 3.5 at 'first', beyond the reach from bucket 3 on
    assert "| 0 | crtn | symbol | -0.500 | -0.500 | -0.500 | -0.500† | -0.500† | -0.500† |  |" in md
    assert "| 3 | crtn | ngram | 4.125 | 4.375 | 4.625 | 4.875† | 5.125† | 5.375† |  |" in md


def _eval_job(root: Path, name: str, db: dict) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "config.yaml").write_text(json.dumps({"checkpoint": "ckpt.pt", "eval": {}}))
    (d / ".hydra" / "overrides.yaml").write_text(json.dumps(["checkpoint=ckpt.pt"]))
    split = db["split"]
    (d / "eval.json").write_text(
        json.dumps({"checkpoint": "ckpt.pt", split: {"split": split, "loss": 3.0, "distance_buckets": db}})
    )


def test_report_baseline_prefers_a_training_job_and_the_same_split(tmp_path):
    """A crtn-eval job of a txl checkpoint listed before the txl training job is not the baseline;
    a job that evaluated another split than the baseline gets no differences."""
    sweep = tmp_path / "sweep"
    _eval_job(sweep, "0", _buckets("wt2", "txl", 3.75, 128, 320))
    _job(sweep, "1", "txl", "wt2", _buckets("wt2", "txl", 3.5, 128, 320))
    valid = {**_buckets("wt2", "crtn", 3.0, 304, None), "split": "valid"}
    _eval_job(sweep, "2", valid)
    files = write_report(sweep, plots=False)
    with open(files["distance_nll.csv"], newline="") as f:
        rows = {(r["job"], r["analysis"]): r for r in csv.DictReader(f)}
    assert {r["baseline"] for r in rows.values()} == {"1"}
    assert float(rows[("0", "symbol")]["diff_first"]) == 0.25
    assert rows[("2", "symbol")]["nll_first"] == "3.0" and rows[("2", "symbol")]["diff_first"] == ""


def test_report_across_seeds_gives_mean_differences_and_their_standard_errors(tmp_path):
    """Jobs that differ only in seed: per bucket the mean over seeds minus the txl configuration's
    mean, with the standard error sqrt(s_a^2/n_a + s_b^2/n_b). By hand: txl's bucket losses are
    _buckets(3.5) + {0, 0.5, 1} (mean +0.5, variance 0.25), crtn's _buckets(3.0) + {0, 1} (mean
    +0.5, variance 0.5): difference -0.5 everywhere, standard error sqrt(0.25/3 + 0.5/2). Runs with
    train.max_step=4000 are compared with the txl configuration of that length, in a figure of
    their own."""
    sweep = tmp_path / "sweep"
    runs = [("txl", 3.5, 1), ("txl", 4.0, 2), ("txl", 4.5, 3), ("crtn", 3.0, 1), ("crtn", 4.0, 2)]
    for i, (model, base, seed) in enumerate(runs):
        _job(sweep, str(i), model, "wt2", _buckets("wt2", model, base, 304, None), (f"seed={seed}",))
    _job(sweep, "5", "vanilla", "wt2", _buckets("wt2", "vanilla", 9.0, 64, None), ("seed=1",))  # alone
    for i, seed in enumerate((1, 2)):  # a corpus without a txl configuration: a table, no figure
        _job(sweep, str(6 + i), "crtn", "ptb", _buckets("ptb", "crtn", 4.0 + i, 304, None), (f"seed={seed}",))
    longer = [("txl", 2.0, 1), ("txl", 2.5, 2), ("crtn", 2.25, 1), ("crtn", 2.75, 2)]
    for i, (model, base, seed) in enumerate(longer):  # compared with the txl runs of the same length
        extra = (f"seed={seed}", "train.max_step=4000")
        _job(sweep, str(8 + i), model, "wt2", _buckets("wt2", model, base, 304, None), extra)
    files = write_report(sweep)
    assert_png(files["distance_seeds_wt2.png"])
    assert_png(files["distance_seeds_wt2_2.png"])
    assert "distance_seeds_ptb.png" not in files
    with open(files["distance_seeds.csv"], newline="") as f:
        rows = {(r["configuration"], r["analysis"]): r for r in csv.DictReader(f)}
    confs = ("data=wt2 model=txl", "data=wt2 model=crtn", "data=ptb model=crtn")
    confs += ("data=wt2 model=txl train.max_step=4000", "data=wt2 model=crtn train.max_step=4000")
    assert set(rows) == {(c, k) for c in confs for k in KINDS}
    row = rows[("data=wt2 model=crtn train.max_step=4000", "symbol")]
    assert row["baseline"] == "data=wt2 model=txl train.max_step=4000"
    assert float(row["diff_first"]) == pytest.approx(0.25)
    assert float(row["se_first"]) == pytest.approx((0.125 / 2 + 0.125 / 2) ** 0.5)
    ptb = rows[("data=ptb model=crtn", "symbol")]
    assert float(ptb["nll_first"]) == 4.5 and ptb["diff_first"] == ptb["se_first"] == ptb["baseline"] == ""
    se = (0.25 / 3 + 0.5 / 2) ** 0.5
    for k, kind in enumerate(("symbol", "ngram")):
        crtn, txl = rows[("data=wt2 model=crtn", kind)], rows[("data=wt2 model=txl", kind)]
        assert crtn["seeds"] == "2" and txl["seeds"] == "3" and crtn["baseline"] == "data=wt2 model=txl"
        for i, b in enumerate(BUCKETS):
            if b == ">=8192":  # the jobs left it empty
                assert crtn[f"nll_{b}"] == crtn[f"diff_{b}"] == crtn[f"se_{b}"] == txl[f"diff_{b}"] == ""
                continue
            assert float(crtn[f"nll_{b}"]) == pytest.approx(3.5 + 0.25 * i + 0.125 * k)
            assert float(txl[f"nll_{b}"]) == pytest.approx(4.0 + 0.25 * i + 0.125 * k)
            assert float(crtn[f"diff_{b}"]) == pytest.approx(-0.5)
            assert float(crtn[f"se_{b}"]) == pytest.approx(se)
            assert float(txl[f"diff_{b}"]) == 0.0 and txl[f"se_{b}"] == ""
    md = files["report.md"].read_text()
    assert "### wt2: minus txl (data=wt2 model=txl)" in md
    assert f"| data=wt2 model=crtn | 2 | symbol | -0.500 ± {se:.3f} |" in md
    assert (
        "### ptb: mean NLL; no txl configuration" in md
        and "| data=ptb model=crtn | 2 | symbol | 4.500 |" in md
    )
