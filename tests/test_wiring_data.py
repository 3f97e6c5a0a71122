"""Every option of the data group (``data.*``, ``data.synthetic.*``, ``data.mqar.*``) reaches the
corpus or the batches it documents: set on the command line, it shows in the corpus that
``load_corpus`` (the Trainer's loader) reads or generates from the resolved spec, and does not
without it (harness: tests/wiring.py). File corpora are tiny folders written by the test."""

from __future__ import annotations

import copy
import json
import math
from itertools import islice

import numpy as np
import pytest
import torch

from crtn.data import load_corpus
from crtn.data.synthetic import make_source
from crtn.errors import ConfigError, DataError
from crtn.evaluate import evaluate
from tests.wiring import Ctx, Wire, run_wire, trainer, validate_calls

PENN = {"train": "the cat sat\nthe dog ran\n", "valid": "the cat ran\n", "test": "a dog sat\n"}
#: a word corpus under {tmp}/corpora/penn, its cache under {tmp}/cache
PTB = ("data.name=ptb", "data.root={tmp}/corpora", "data.cache_dir={tmp}/cache")
BOOK = "{tmp}/book.txt"
TEXT = ("data.name=text", f"data.path={BOOK}", "data.cache_dir={tmp}/cache")
#: the tiny corpus of tests/test_mqar.py (slot distances 5..11 slots of 7, gaps 33..79)
MQAR = (
    "data.name=mqar",
    "data.mqar.n_keys=12",
    "data.mqar.n_values=16",
    "data.mqar.n_filler=9",
    "data.mqar.n_pairs=5",
    "data.mqar.slot_len=7",
    "data.mqar.spacing=5",
    "data.mqar.min_gap=30",
    "data.mqar.max_gap=80",
    "data.mqar.doc_len=140",
    "data.mqar.gap_dist=uniform",
    "data.mqar.train_tokens=6000",
    "data.mqar.valid_tokens=1500",
    "data.mqar.test_tokens=1500",
    "data.mqar.seed=7",
)


def write_penn(folder) -> None:
    folder.mkdir(parents=True)
    for split, text in PENN.items():
        (folder / f"{split}.txt").write_text(text)


def write_book(ctx: Ctx) -> None:
    """20 lines of 4 words: 100 tokens with the <eos> of each line."""
    (ctx.tmp / "book.txt").write_text("".join(f"w{i} x y z\n" for i in range(20)))


def corpus(spec):
    return load_corpus(spec.data)


def words(c) -> set[str]:
    return set(c.vocab.idx2sym)


# ------------------------------------------------------------------ data.*
def check_name(ctx: Ctx) -> None:
    assert trainer(ctx.on, ctx.tmp / "on").corpus.name == "mqar"
    assert trainer(ctx.off, ctx.tmp / "off").corpus.name == "synthetic"


def check_root(ctx: Ctx) -> None:
    write_penn(ctx.tmp / "corpora" / "penn")
    c = corpus(ctx.on)
    assert words(c) == {"the", "cat", "sat", "dog", "ran", "<eos>", "<unk>"}
    assert c.info["files"][0] == str(ctx.tmp / "corpora" / "penn" / "train.txt")


def check_dir(ctx: Ctx) -> None:
    write_penn(ctx.tmp / "corpora" / "mypenn")
    assert corpus(ctx.on).info["files"][0] == str(ctx.tmp / "corpora" / "mypenn" / "train.txt")
    with pytest.raises(DataError, match=r"corpora/penn' for data\.name=ptb"):  # the standard folder: absent
        corpus(ctx.off)


def check_path(ctx: Ctx) -> None:
    write_book(ctx)
    c = corpus(ctx.on)
    assert c.info["files"] == [str(ctx.tmp / "book.txt")] and {"w0", "x", "<eos>"} <= words(c)
    with pytest.raises(ConfigError, match=r"data\.path"):
        ctx.off  # noqa: B018


def check_level(ctx: Ctx) -> None:
    write_penn(ctx.tmp / "corpora" / "penn")
    on, off = corpus(ctx.on), corpus(ctx.off)
    assert on.level == "char" and words(on) == set(PENN["train"])  # every character, newline included
    assert [len(on.splits[s]) for s in ("train", "valid", "test")] == [len(t) for t in PENN.values()]
    assert off.level == "word" and "the" in words(off)


def check_split(ctx: Ctx) -> None:
    write_book(ctx)
    assert [len(corpus(ctx.on).splits[s]) for s in ("train", "valid", "test")] == [50, 25, 25]
    assert [len(corpus(ctx.off).splits[s]) for s in ("train", "valid", "test")] == [90, 5, 5]


def check_cache_dir(ctx: Ctx) -> None:
    write_penn(ctx.tmp / "corpora" / "penn")
    assert corpus(ctx.on).info["cache_dir"] == str(ctx.tmp / "mine")
    assert any(p.name.startswith("ptb-") for p in (ctx.tmp / "mine").iterdir())
    assert corpus(ctx.off).info["cache_dir"] == str(ctx.tmp / "corpora" / "penn" / ".crtn-cache")


def batch_shape(spec, run_dir):
    return tuple(next(trainer(spec, run_dir).train_it.iterate(0)).input.shape)


def check_batch_size(ctx: Ctx) -> None:
    assert batch_shape(ctx.on, ctx.tmp / "on") == (2, 4) and batch_shape(ctx.off, ctx.tmp / "off") == (4, 4)


def check_eval_batch_size(ctx: Ctx) -> None:  # eval.batch_size follows it
    assert validate_calls(ctx.on, ctx.tmp / "on")["batch_size"] == 2
    assert validate_calls(ctx.off, ctx.tmp / "off")["batch_size"] == 4


# ------------------------------------------------------------------ data.synthetic.*
def split(spec, name: str = "train") -> np.ndarray:
    return corpus(spec).splits[name].numpy()


def gaps(spec) -> set[int]:
    g = corpus(spec).repeat_gap["train"].numpy()
    return set(g[g > 0].tolist())


def synthetic(check):
    """``check(corpus with the value, corpus without)``."""
    return lambda ctx: check(corpus(ctx.on), corpus(ctx.off))


def check_vocab_size(on, off) -> None:
    assert len(on.vocab) == 30 and 20 <= on.splits["train"].max() < 30 and len(off.vocab) == 20


def check_branching(on, off) -> None:
    """Every fresh token follows its predecessor among the predecessor's 2 successors."""
    assert on.source.succ.shape == (20, 2) and off.source.succ.shape == (20, 4)
    t, label = on.splits["train"].numpy(), on.labels["train"].numpy()
    fresh = (label[1:] == 0) & (t[1:] != 0) & (t[:-1] != 0)
    prev, cur = t[:-1][fresh], t[1:][fresh]
    assert len(cur) > 100 and (on.source.succ[prev] == cur[:, None]).any(1).all()


def check_concentration(ctx: Ctx) -> None:
    """The source's successor probabilities are Dirichlet(0.2) draws from the source's seed stream."""
    rng = np.random.default_rng(np.random.SeedSequence(1234).spawn(4)[0])
    want = make_source(20, 4, 0.2, rng).prob
    assert np.array_equal(corpus(ctx.on).source.prob, want)
    assert not np.array_equal(corpus(ctx.off).source.prob, want)


def check_passage_len(on, off) -> None:  # labels count the tokens of a copied passage 1..P
    assert on.labels["train"].max() == 8 and off.labels["train"].max() == 4


def eos_every(c, n: int) -> bool:
    t = c.splits["train"].numpy()
    return np.array_equal(np.flatnonzero(t == 0), np.arange(n - 1, len(t), n))


def check_doc_passages(on, off) -> None:  # documents of 8 passages of 4, then <eos>
    assert eos_every(on, 33) and eos_every(off, 65)


def check_p_repeat(on, off) -> None:
    assert on.labels["train"].max() == 0 and off.labels["train"].max() > 0


def check_min_gap(ctx: Ctx) -> None:
    assert gaps(ctx.on) == {36, 40} and min(gaps(ctx.off)) == 24


def check_max_gap(ctx: Ctx) -> None:
    assert gaps(ctx.on) == {24, 28} and max(gaps(ctx.off)) == 40


def check_aligned(ctx: Ctx) -> None:  # copies from any token: distances that are not multiples of P = 4
    assert {g % 4 for g in gaps(ctx.on)} == {0, 1, 2, 3} and {g % 4 for g in gaps(ctx.off)} == {0}


def tokens_of(name: str, on_n: int, off_n: int):
    def check(ctx: Ctx) -> None:
        assert len(split(ctx.on, name)) == on_n and len(split(ctx.off, name)) == off_n

    return check


def check_seed(ctx: Ctx) -> None:
    assert np.array_equal(split(ctx.on), split(ctx.on)) and not np.array_equal(split(ctx.on), split(ctx.off))


def check_repeat_skip(ctx: Ctx) -> None:
    """The repeat metrics leave out the first repeat_skip tokens of each copied passage: the
    evaluation's repeat tokens are the valid targets whose label exceeds it."""
    for spec, skip in ((ctx.on, 2), (ctx.off, 4)):
        c = corpus(spec)
        model = trainer(spec, ctx.tmp / str(skip)).model
        m = evaluate(model, c, "valid", batch_size=4, device="cpu")
        it = c.iterator("valid", 4, 4, drop_last=False)
        assert m["repeat"]["tokens"] == sum(int((b.label > skip).sum()) for b in it.iterate(0)) > 0


# ------------------------------------------------------------------ data.mqar.*
def documents(c, K: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(key positions, labels) of every complete document of the train split."""
    t, label = c.splits["train"].numpy(), c.labels["train"].numpy()
    ends = np.flatnonzero(t == 0)
    starts = np.r_[0, ends[:-1] + 1]
    return [(np.flatnonzero((t[s:e] >= 1) & (t[s:e] <= K)), label[s:e]) for s, e in zip(starts, ends)]


def mqar(check):
    return lambda ctx: check(corpus(ctx.on), corpus(ctx.off))


def symbols(prefix: str, on_n: int, off_n: int):
    """The vocabulary holds ``on_n`` symbols of a kind (k: keys, v: values, f: filler), ``off_n``
    without the value."""

    def count(c) -> int:
        return sum(s[0] == prefix for s in c.vocab.idx2sym[1:])

    def check(on, off) -> None:
        assert (count(on), count(off)) == (on_n, off_n)

    return mqar(check)


def check_n_pairs(on, off) -> None:
    assert {int((label > 0).sum()) for _, label in documents(on, 12)} == {4}
    assert {int((label > 0).sum()) for _, label in documents(off, 12)} == {5}


def offsets_within(c, slot_len: int, jitter: int) -> bool:
    """Every key lies at offset 0..jitter of its slot."""
    return all((pos % slot_len <= jitter).all() for pos, _ in documents(c, 12))


def check_slot_len(on, off) -> None:  # slots of 6, spacing 5: offsets 0..1
    assert offsets_within(on, 6, 1) and not offsets_within(off, 6, 1)


def check_spacing(on, off) -> None:  # slots of 7, spacing 6: offsets 0..1
    assert offsets_within(on, 7, 1) and not offsets_within(off, 7, 1)


def answer_gaps(c) -> np.ndarray:
    label = c.labels["train"].numpy()
    return label[label > 0]


def check_mqar_min_gap(on, off) -> None:
    assert answer_gaps(on).min() >= 40 and answer_gaps(off).min() < 40


def check_mqar_max_gap(on, off) -> None:
    assert answer_gaps(on).max() <= 60 and answer_gaps(off).max() > 60


def check_gap_dist(on, off) -> None:
    """log_uniform weights a slot distance d by 1/d: with the same draws, shorter gaps on average."""
    assert answer_gaps(on).mean() < answer_gaps(off).mean()


def check_doc_len(on, off) -> None:
    assert eos_every(on, 151) and eos_every(off, 141)


def step_losses(t, n_steps: int) -> list[tuple[float, float, float, int]]:
    """Train ``n_steps`` steps; per step the trainer's loss, the mean NLL of the batch's answers
    (0 without one) and of all its tokens from an independent forward pass of the same weights
    and streams before the step, and the number of answers."""
    out = []
    for batch in islice(t.train_it.iterate(0), n_steps):
        with torch.no_grad():
            nll = t.model(batch.input, batch.target, copy.deepcopy(t.states[0])).nll
        answers = batch.label > 0
        before = float(t.loss_sum)
        t.train_step(batch)
        out.append(
            (
                float(t.loss_sum) - before,
                float(nll[answers].mean()) if answers.any() else 0.0,
                float(nll.mean()),
                int(answers.sum()),
            )
        )
    return out


def check_train_loss(ctx) -> None:
    """answers: each step's loss is the mean NLL of its answers only, 0 in a batch without one;
    all (the default): of every token."""
    for spec, answers_only in ((ctx.on, True), (ctx.off, False)):
        t = trainer(spec, ctx.tmp / str(answers_only))
        t.start()
        rows = step_losses(t, 12)
        assert {n > 0 for *_, n in rows} == {True, False}  # batches with and without answers
        for loss, answers, every, _ in rows:
            assert loss == pytest.approx(answers if answers_only else every, rel=1e-5, abs=1e-7)
        t.validate()  # best.pt is picked by the validation loss of the same tokens
        rec = json.loads(t.metrics_path.read_text().splitlines()[-1])
        chosen = math.log(rec["valid_answers_ppl"]) if answers_only else rec["valid_loss"]
        assert t.progress.best_valid == pytest.approx(chosen, rel=1e-6) and t.best.exists()


SYNTHETIC_WIRING: dict[str, Wire] = {
    "data.synthetic.vocab_size": Wire(30, synthetic(check_vocab_size)),
    "data.synthetic.branching": Wire(2, synthetic(check_branching)),
    "data.synthetic.concentration": Wire(0.2, check_concentration),
    "data.synthetic.passage_len": Wire(8, synthetic(check_passage_len)),
    "data.synthetic.doc_passages": Wire(8, synthetic(check_doc_passages)),
    "data.synthetic.p_repeat": Wire(0.0, synthetic(check_p_repeat)),
    "data.synthetic.min_gap": Wire(36, check_min_gap),
    "data.synthetic.max_gap": Wire(28, check_max_gap),
    "data.synthetic.aligned": Wire(False, check_aligned),
    "data.synthetic.train_tokens": Wire(3000, tokens_of("train", 3000, 2000)),
    "data.synthetic.valid_tokens": Wire(300, tokens_of("valid", 300, 256)),
    "data.synthetic.test_tokens": Wire(320, tokens_of("test", 320, 256)),
    "data.synthetic.seed": Wire(7, check_seed),
    "data.synthetic.repeat_skip": Wire(2, check_repeat_skip, extra=("data.synthetic.passage_len=8",)),
}
MQAR_WIRING: dict[str, Wire] = {
    "data.mqar.n_keys": Wire(20, symbols("k", 20, 12), extra=MQAR),
    "data.mqar.n_values": Wire(20, symbols("v", 20, 16), extra=MQAR),
    "data.mqar.n_filler": Wire(12, symbols("f", 12, 9), extra=MQAR),
    "data.mqar.n_pairs": Wire(4, mqar(check_n_pairs), extra=MQAR),
    "data.mqar.slot_len": Wire(6, mqar(check_slot_len), extra=MQAR),
    "data.mqar.spacing": Wire(6, mqar(check_spacing), extra=MQAR),
    "data.mqar.min_gap": Wire(40, mqar(check_mqar_min_gap), extra=MQAR),
    "data.mqar.max_gap": Wire(60, mqar(check_mqar_max_gap), extra=MQAR),
    "data.mqar.gap_dist": Wire("log_uniform", mqar(check_gap_dist), extra=MQAR),
    "data.mqar.doc_len": Wire(150, mqar(check_doc_len), extra=MQAR),
    "data.mqar.train_tokens": Wire(3000, tokens_of("train", 3000, 6000), extra=MQAR),
    "data.mqar.valid_tokens": Wire(700, tokens_of("valid", 700, 1500), extra=MQAR),
    "data.mqar.test_tokens": Wire(800, tokens_of("test", 800, 1500), extra=MQAR),
    "data.mqar.seed": Wire(8, check_seed, extra=MQAR),
    "data.mqar.train_loss": Wire("answers", check_train_loss, extra=MQAR),
}
DATA_WIRING: dict[str, Wire] = {
    "data.name": Wire("mqar", check_name, extra=MQAR[1:]),
    "data.root": Wire("{tmp}/corpora", check_root, extra=PTB[:1] + PTB[2:]),
    "data.dir": Wire("mypenn", check_dir, extra=PTB),
    "data.path": Wire(BOOK, check_path, extra=(TEXT[0], TEXT[2]), required=True),
    "data.level": Wire("char", check_level, extra=PTB),
    "data.split": Wire([0.5, 0.25, 0.25], check_split, extra=TEXT),
    "data.cache_dir": Wire("{tmp}/mine", check_cache_dir, extra=PTB[:2]),
    "data.batch_size": Wire(2, check_batch_size),
    "data.eval_batch_size": Wire(2, check_eval_batch_size),
    **SYNTHETIC_WIRING,
    **MQAR_WIRING,
}


@pytest.mark.parametrize("key", list(DATA_WIRING))
def test_data_option_is_wired(key, tmp_path):
    run_wire(DATA_WIRING, key, tmp_path)
