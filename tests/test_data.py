"""Tests of crtn.data: vocabularies, corpora, caching, errors, the segment iterator, getdata.sh (docs/method.md §4).

The synthetic corpus has its own file, tests/test_synthetic.py.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing as mp
import os
import stat
import subprocess
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

import crtn.data.corpus as corpus_mod
from crtn.config import schema_node
from crtn.data import Batch, Corpus, StreamIterator, Vocab, cache_dir_for, load_corpus
from crtn.data.spec import DataSpec
from crtn.errors import ConfigError, DataError

REPO = Path(__file__).resolve().parents[1]
GETDATA = REPO / "tools" / "getdata.sh"


def data_cfg(**kw):
    cfg = schema_node(DataSpec)
    for k, v in kw.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def make_corpus_dir(root: Path, folder: str, files: dict[str, str | bytes]) -> Path:
    d = root / folder
    d.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (d / name).write_bytes(content.encode() if isinstance(content, str) else content)
    return root


def cache_files(folder: Path) -> list[str]:
    """Files in a cache folder other than lock files."""
    if not folder.exists():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def reference_word_tokens(path: Path) -> list[str]:
    """Independent reference: Transformer-XL's reader (text mode, line.split() + <eos>)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            out.extend(line.split() + ["<eos>"])
    return out


# ====================================================================== Vocab
def test_vocab_from_counts_order_and_mapping(tmp_path):
    # counts: b=2 (first seen), a=3, c=2, d=0; <eos> is special even though it occurs
    vocab, new_id = Vocab.from_counts(
        ["b", "<eos>", "a", "c", "d"], [2, 5, 3, 2, 0], specials=["<eos>"], eos="<eos>"
    )
    assert vocab.idx2sym == ["<eos>", "a", "b", "c"]
    assert new_id.tolist() == [2, 0, 1, 3, -1]
    assert vocab.eos_idx == 0 and vocab.unk_idx is None and len(vocab) == 4
    assert vocab.sym2idx == {"<eos>": 0, "a": 1, "b": 2, "c": 3}
    assert vocab.encode(["c", "a", "<eos>"]) == [3, 1, 0]
    assert vocab.decode([3, 1, 0]) == ["c", "a", "<eos>"]
    assert vocab.decode(torch.tensor([[2, 1]])) == ["b", "a"]
    with pytest.raises(DataError, match="'zz'"):
        vocab.encode(["zz"])
    with_unk = Vocab(["<eos>", "<unk>", "x"], eos="<eos>", unk="<unk>")
    assert with_unk.encode(["x", "never-seen"]) == [2, 1]
    vocab.save(tmp_path / "v.json")
    assert Vocab.load(tmp_path / "v.json") == vocab
    with pytest.raises(ValueError):
        Vocab(["a", "a"])


# ====================================================================== word level
def test_word_level_rules_hand_computed(tmp_path):
    root = make_corpus_dir(
        tmp_path,
        "penn",
        {
            # lines "b a", "", "a c b": <eos> per line, empty line included
            "train.txt": "b a\n\na c b\n",
            # last line without newline still gets an <eos>; z is unseen -> <unk>
            "valid.txt": "a z\nb",
            # CRLF line ends are newlines
            "test.txt": "c\r\nb\r\n",
        },
    )
    c = load_corpus(data_cfg(name="ptb", root=str(root), cache_dir=str(tmp_path / "cache")))
    assert isinstance(c, Corpus)
    # specials first (<eos>, then <unk> because valid needs it), then b, a (2 each, b first), c
    assert c.vocab.idx2sym == ["<eos>", "<unk>", "b", "a", "c"]
    assert (c.vocab.eos_idx, c.vocab.unk_idx) == (0, 1)
    assert c.splits["train"].tolist() == [2, 3, 0, 0, 3, 4, 2, 0]
    assert c.splits["valid"].tolist() == [3, 1, 0, 2, 0]
    assert c.splits["test"].tolist() == [4, 0, 2, 0]
    assert all(t.dtype == torch.int64 and t.dim() == 1 for t in c.splits.values())
    assert c.train_counts.tolist() == [3, 0, 2, 2, 1]
    assert (c.name, c.level, c.metric, c.labels, c.source_nll) == ("ptb", "word", "ppl", None, None)
    assert c.info["oov_tokens"] == {"train": 0, "valid": 1, "test": 0}


def test_unk_in_text_is_not_a_special(tmp_path):
    root = make_corpus_dir(
        tmp_path,
        "wikitext-2",
        {
            "wiki.train.tokens": "x <unk> x\n",
            "wiki.valid.tokens": "x new\n",
            "wiki.test.tokens": "<unk>\n",
        },
    )
    c = load_corpus(data_cfg(name="wt2", root=str(root), cache_dir=str(tmp_path / "cache")))
    # <unk> keeps its frequency position (tie with <eos>'s count is irrelevant: <eos> is special)
    assert c.vocab.idx2sym == ["<eos>", "x", "<unk>"]
    assert c.vocab.unk_idx == 2
    assert c.splits["valid"].tolist() == [1, 2, 0]


def test_wikitext2_real(shared_data, tmp_path):
    cfg = data_cfg(name="wt2", root=str(shared_data), cache_dir=str(tmp_path))
    t0 = time.perf_counter()
    c = load_corpus(cfg)
    cold = time.perf_counter() - t0
    assert c.info["cache"] == "built"
    assert {s: len(t) for s, t in c.splits.items()} == {"train": 2_088_628, "valid": 217_646, "test": 245_569}
    assert len(c.vocab) == 33_278
    assert c.vocab.idx2sym[0] == "<eos>" and c.vocab.eos_idx == 0
    assert c.vocab.unk_idx == c.vocab.sym2idx["<unk>"]
    # independent reference counts (Transformer-XL's reader)
    ref = reference_word_tokens(shared_data / "wikitext-2" / "wiki.train.tokens")
    counts = collections.Counter(ref)
    assert set(counts) == set(c.vocab.idx2sym)
    assert c.train_counts.tolist() == [counts[s] for s in c.vocab.idx2sym]
    tail = c.train_counts[1:]
    assert bool((tail[:-1] >= tail[1:]).all()), "ids after the specials must be by descending frequency"
    # ties broken by first occurrence
    first = {}
    for i, w in enumerate(ref):
        first.setdefault(w, i)
    syms = c.vocab.idx2sym[1:]
    for a, b in itertools.pairwise(syms):
        if counts[a] == counts[b]:
            assert first[a] < first[b]
    assert c.vocab.decode(c.splits["train"][:200]) == ref[:200]
    valid_ref = reference_word_tokens(shared_data / "wikitext-2" / "wiki.valid.tokens")
    assert c.vocab.decode(c.splits["valid"]) == valid_ref
    # the second load comes from the cache
    t0 = time.perf_counter()
    c2 = load_corpus(cfg)
    warm = time.perf_counter() - t0
    assert c2.info["cache"] == "loaded"
    assert c2.vocab == c.vocab
    assert all(torch.equal(c.splits[s], c2.splits[s]) for s in c.splits)
    assert torch.equal(c.train_counts, c2.train_counts)
    assert warm < cold


def test_ptb_real(shared_data, tmp_path):
    c = load_corpus(data_cfg(name="ptb", root=str(shared_data), cache_dir=str(tmp_path)))
    assert {s: len(t) for s, t in c.splits.items()} == {"train": 929_589, "valid": 73_760, "test": 82_430}
    assert len(c.vocab) == 10_000
    assert c.info["oov_tokens"] == {"train": 0, "valid": 0, "test": 0}
    n_lines = (shared_data / "penn" / "train.txt").read_bytes().count(b"\n")
    assert int(c.train_counts[c.vocab.eos_idx]) == n_lines == 929_589 - 887_521
    ref = reference_word_tokens(shared_data / "penn" / "test.txt")
    assert c.vocab.decode(c.splits["test"]) == ref


# ====================================================================== text and character level
def test_text_char_level_shakespeare(shared_data, tmp_path):
    path = shared_data / "shakespeare" / "input.txt"
    c = load_corpus(data_cfg(name="text", path=str(path), level="char", cache_dir=str(tmp_path)))
    text = path.read_text(encoding="utf-8")
    n = len(text)
    assert n == 1_115_394
    assert (c.level, c.metric, c.vocab.eos_idx, c.vocab.unk_idx) == ("char", "bpc", None, None)
    assert len(c.vocab) == 65
    sizes = [len(c.splits[s]) for s in ("train", "valid", "test")]
    assert sizes == [round(0.9 * n), round(0.95 * n) - round(0.9 * n), n - round(0.95 * n)]
    whole = torch.cat([c.splits[s] for s in ("train", "valid", "test")])
    assert "".join(c.vocab.decode(whole)) == text
    counts = collections.Counter(text[: sizes[0]])
    assert c.train_counts.tolist() == [counts[s] for s in c.vocab.idx2sym]
    assert c.vocab.idx2sym[0] == " " and "\n" in c.vocab.sym2idx


def test_text_word_level_split_and_unk(tmp_path):
    path = tmp_path / "doc.txt"
    # 8 tokens (incl. <eos>): a b <eos> a <eos> b c <eos> -> split 0.5/0.25/0.25 = 4/2/2
    path.write_text("a b\na\nb c\n", encoding="utf-8")
    c = load_corpus(
        data_cfg(name="text", path=str(path), split=[0.5, 0.25, 0.25], cache_dir=str(tmp_path / "c"))
    )
    # train = a b <eos> a -> <eos>, a(2), b(1); c unseen -> <unk> special
    assert c.vocab.idx2sym == ["<eos>", "<unk>", "a", "b"]
    assert c.splits["train"].tolist() == [2, 3, 0, 2]
    assert c.splits["valid"].tolist() == [0, 3]
    assert c.splits["test"].tolist() == [1, 0]
    assert c.metric == "ppl"
    # default cache folder: .crtn-cache beside the text file (its folder is writable)
    c2 = load_corpus(data_cfg(name="text", path=str(path), split=[0.5, 0.25, 0.25]))
    assert Path(c2.info["cache_dir"]) == tmp_path / ".crtn-cache"
    assert torch.equal(c2.splits["test"], c.splits["test"])


def test_enwik8_raw_bytes_and_standard_split(tmp_path, monkeypatch):
    assert corpus_mod.CHAR_HELDOUT == 5_000_000  # 90M / 5M / 5M of the 100M-byte public file
    monkeypatch.setattr(corpus_mod, "CHAR_HELDOUT", 1000)
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, size=5000, dtype=np.uint8)  # 0..254 only
    data[-3] = 255  # a byte the train split never has -> <unk>
    data[:3] = [0xFF - 1, 0xC3, 0x28]  # not UTF-8: fine for bytes
    root = make_corpus_dir(tmp_path, "enwik8", {"enwik8": data.tobytes()})
    c = load_corpus(data_cfg(name="enwik8", root=str(root), cache_dir=str(tmp_path / "c")))
    assert (c.level, c.metric) == ("char", "bpc")
    assert [len(c.splits[s]) for s in ("train", "valid", "test")] == [3000, 1000, 1000]
    assert c.vocab.unk_idx == 0 and c.vocab.idx2sym[0] == "<unk>"
    train_syms = "".join(c.vocab.decode(c.splits["train"]))
    assert train_syms.encode("latin-1") == data[:3000].tobytes()
    test = c.splits["test"].tolist()
    assert test[-3] == c.vocab.unk_idx and test.count(c.vocab.unk_idx) == 1
    counts = np.bincount(data[:3000], minlength=256)
    assert c.train_counts[1:].tolist() == [counts[ord(s)] for s in c.vocab.idx2sym[1:]]


def test_text8_raw_and_preprocessed_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus_mod, "CHAR_HELDOUT", 10)
    text = "the quick brown fox jumps over the lazy dog " * 3  # 132 chars
    root = make_corpus_dir(tmp_path, "text8", {"text8": text})
    c = load_corpus(data_cfg(name="text8", root=str(root), cache_dir=str(tmp_path / "c")))
    assert [len(c.splits[s]) for s in ("train", "valid", "test")] == [len(text) - 20, 10, 10]
    assert "".join(c.vocab.decode(torch.cat(list(c.splits.values())))) == text
    assert c.vocab.idx2sym[0] == " "  # the most frequent character
    # the Transformer-XL release's preprocessed layout: whitespace-separated symbols, no <eos>
    pre = make_corpus_dir(
        tmp_path / "pre",
        "enwik8",
        {"train.txt": "60 61 60\n62 60\n", "valid.txt": "61 60\n", "test.txt": "62\n"},
    )
    c = load_corpus(data_cfg(name="enwik8", root=str(pre), cache_dir=str(tmp_path / "c")))
    assert c.vocab.idx2sym == ["60", "61", "62"] and c.vocab.eos_idx is None
    assert c.splits["train"].tolist() == [0, 1, 0, 2, 0] and c.splits["test"].tolist() == [2]
    assert (c.level, c.metric) == ("char", "bpc")


def test_char_corpus_too_short_for_standard_split(tmp_path):
    root = make_corpus_dir(tmp_path, "enwik8", {"enwik8": b"abc" * 100})
    with pytest.raises(DataError, match=r"enwik8.*300 symbols.*100,000,000"):
        load_corpus(data_cfg(name="enwik8", root=str(root), cache_dir=str(tmp_path / "c")))
    assert cache_files(tmp_path / "c") == []


# ====================================================================== caching
def test_cache_location_rules(tmp_path, monkeypatch):
    """A writable corpus folder gets ``.crtn-cache`` inside it; a read-only one (made so here, by its
    permission bits, which crtn honours even as root) gets a folder per corpus path under
    ``XDG_CACHE_HOME/crtn``; an explicit ``data.cache_dir`` wins."""
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    writable = tmp_path / "w"
    writable.mkdir()
    assert cache_dir_for(writable, None) == writable / ".crtn-cache"
    assert cache_dir_for(writable, str(tmp_path / "explicit")) == tmp_path / "explicit"
    # two read-only corpora, copies of a tiny one: their caches go to XDG_CACHE_HOME, one per path
    root = _tiny_ptb(tmp_path / "ro")
    other = root / "wikitext-2"
    other.mkdir()
    for f in (root / "penn").iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    folders = [root / "penn", other]
    for d in folders:
        d.chmod(0o555)
    try:
        a, b = (cache_dir_for(d, None) for d in folders)
        assert a.parent == b.parent == xdg / "crtn" and a != b and a.is_dir() and b.is_dir()
        assert not any((d / ".crtn-cache").exists() for d in folders)  # even as root
        # what a real load does with it: the encoded corpus is cached outside the folder
        c = load_corpus(data_cfg(name="ptb", root=str(root)))
        assert Path(c.info["cache_dir"]) == a and not (root / "penn" / ".crtn-cache").exists()
    finally:
        for d in folders:
            d.chmod(0o755)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(DataError, match="data.cache_dir"):
        cache_dir_for(writable, str(blocker / "sub"))


def _tiny_ptb(root: Path) -> Path:
    return make_corpus_dir(
        root, "penn", {"train.txt": "a b c a\nb a\n", "valid.txt": "a b\n", "test.txt": "c a\n"}
    )


def test_cache_hit_and_key_changes(tmp_path, monkeypatch):
    root = _tiny_ptb(tmp_path)
    cfg = data_cfg(name="ptb", root=str(root))  # default: .crtn-cache inside the corpus folder
    c1 = load_corpus(cfg)
    cache = root / "penn" / ".crtn-cache"
    assert c1.info["cache"] == "built" and Path(c1.info["cache_dir"]) == cache
    names = cache_files(cache)
    assert len(names) == 5 and any(n.endswith(".vocab.json") for n in names)
    assert sum(n.endswith(".npy") for n in names) == 3
    arr = np.load(next(cache.glob("*.train.npy")))
    assert arr.dtype == np.int32 and arr.tolist() == c1.splits["train"].tolist()
    json.loads(next(cache.glob("*.vocab.json")).read_text())

    def no_build(plan):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(corpus_mod, "_build", no_build)
    c2 = load_corpus(cfg)
    assert c2.info["cache"] == "loaded" and c2.vocab == c1.vocab
    monkeypatch.undo()
    # changing a source file changes the key: rebuilt, with the new content
    valid = root / "penn" / "valid.txt"
    valid.write_text("a b\nc c\n")
    c3 = load_corpus(cfg)
    assert c3.info["cache"] == "built"
    assert c3.vocab.decode(c3.splits["valid"]) == ["a", "b", "<eos>", "c", "c", "<eos>"]
    # same size, new mtime: rebuilt too
    st_ = valid.stat()
    os.utime(valid, ns=(st_.st_atime_ns, st_.st_mtime_ns + 10**9))
    assert load_corpus(cfg).info["cache"] == "built"
    # a corrupt cache file is rebuilt, not trusted
    for victim in cache.glob("*.train.npy"):
        victim.write_bytes(b"garbage")
    c4 = load_corpus(cfg)
    assert c4.info["cache"] == "built" and torch.equal(c4.splits["train"], c1.splits["train"])


def test_cache_options_change_key(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("ab ba\nab\n" * 20)
    cache = tmp_path / "cache"
    w = load_corpus(data_cfg(name="text", path=str(path), level="word", cache_dir=str(cache)))
    ch = load_corpus(data_cfg(name="text", path=str(path), level="char", cache_dir=str(cache)))
    other = load_corpus(data_cfg(name="text", path=str(path), split=[0.8, 0.1, 0.1], cache_dir=str(cache)))
    assert w.info["cache"] == ch.info["cache"] == other.info["cache"] == "built"
    assert len(w.vocab) == 3 and len(ch.vocab) == 4  # <eos> ab ba | a b ' ' '\n'
    assert len(other.splits["train"]) != len(w.splits["train"])


def test_interrupted_cache_write_leaves_no_partial_file(tmp_path, monkeypatch):
    root = _tiny_ptb(tmp_path)
    cache = tmp_path / "cache"
    cfg = data_cfg(name="ptb", root=str(root), cache_dir=str(cache))
    real_save = np.save
    calls = []

    def flaky_save(f, arr, **kw):
        calls.append(1)
        if len(calls) == 2:
            f.write(b"partial")
            raise KeyboardInterrupt
        real_save(f, arr, **kw)

    monkeypatch.setattr(np, "save", flaky_save)
    with pytest.raises(KeyboardInterrupt):
        load_corpus(cfg)
    assert cache_files(cache) == []  # no temp file, no orphan .npy, no vocab without meta
    monkeypatch.undo()
    c = load_corpus(cfg)
    assert c.info["cache"] == "built" and len(cache_files(cache)) == 5


def _concurrent_worker(cfg_dict, barrier, queue):
    from crtn.data import load_corpus as load

    barrier.wait()
    c = load(OmegaConf.create(cfg_dict))
    queue.put((c.info["cache"], c.vocab.idx2sym, {s: c.splits[s].tolist() for s in c.splits}))


def test_concurrent_processes_build_the_cache_once(shared_data, tmp_path):
    cache = tmp_path / "cache"
    cfg_dict = OmegaConf.to_container(data_cfg(name="ptb", root=str(shared_data), cache_dir=str(cache)))
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_concurrent_worker, args=(cfg_dict, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sorted(r[0] for r in results) == ["built", "loaded"]
    assert results[0][1:] == results[1][1:]
    single = load_corpus(data_cfg(name="ptb", root=str(shared_data), cache_dir=str(tmp_path / "single")))
    assert results[0][1] == single.vocab.idx2sym
    assert results[0][2] == {s: single.splits[s].tolist() for s in single.splits}
    names = cache_files(cache)
    assert len(names) == 5 and not [n for n in names if n.startswith(".") or n.endswith(".tmp")]


# ====================================================================== errors
def test_missing_corpus_folder(tmp_path):
    with pytest.raises(DataError) as e:
        load_corpus(data_cfg(name="wt2", root=str(tmp_path / "nowhere"), cache_dir=str(tmp_path / "c")))
    msg = str(e.value)
    assert "nowhere/wikitext-2" in msg and "wiki.train.tokens" in msg and "tools/getdata.sh" in msg
    assert "\n" not in msg
    assert cache_files(tmp_path / "c") == []
    # data.dir overrides the standard folder name
    with pytest.raises(DataError, match="nowhere/my-wt2"):
        load_corpus(data_cfg(name="wt2", root=str(tmp_path / "nowhere"), dir="my-wt2"))


def test_missing_split_file(tmp_path):
    root = _tiny_ptb(tmp_path)
    (root / "penn" / "valid.txt").unlink()
    with pytest.raises(DataError, match=r"valid\.txt.*not found"):
        load_corpus(data_cfg(name="ptb", root=str(root), cache_dir=str(tmp_path / "c")))
    assert cache_files(tmp_path / "c") == []


def test_empty_file(tmp_path):
    root = _tiny_ptb(tmp_path)
    (root / "penn" / "test.txt").write_bytes(b"")
    with pytest.raises(DataError, match=r"test\.txt.*empty"):
        load_corpus(data_cfg(name="ptb", root=str(root), cache_dir=str(tmp_path / "c")))
    assert cache_files(tmp_path / "c") == []


def test_undecodable_bytes_name_file_and_offset(tmp_path):
    root = _tiny_ptb(tmp_path)
    (root / "penn" / "valid.txt").write_bytes(b"ok fine\n\xff bad\n")
    cache = tmp_path / "c"
    with pytest.raises(DataError, match=r"valid\.txt.*UTF-8.*byte offset 8"):
        load_corpus(data_cfg(name="ptb", root=str(root), cache_dir=str(cache)))
    assert cache_files(cache) == []
    path = tmp_path / "bad.txt"
    path.write_bytes("héllo wörld ".encode() * 10 + b"\xc3\x28")
    with pytest.raises(DataError, match=r"bad\.txt.*byte offset 140"):
        load_corpus(data_cfg(name="text", path=str(path), level="char", cache_dir=str(cache)))
    assert cache_files(cache) == []


def test_config_errors():
    with pytest.raises(
        ConfigError, match=r"data\.name='wt3'.*wt2, wt103, ptb, enwik8, text8, text, synthetic"
    ):
        load_corpus(data_cfg(name="wt3"))
    with pytest.raises(ConfigError, match=r"data\.path"):
        load_corpus(data_cfg(name="text"))
    with pytest.raises(ConfigError, match=r"data\.level"):
        load_corpus(data_cfg(name="text", path="x", level="byte"))
    for bad in ([0.5, 0.5], [0.9, 0.2, -0.1], [0.5, 0.3, 0.3], [1.0, 0.0, 0.0]):
        with pytest.raises(ConfigError, match=r"data\.split"):
            load_corpus(data_cfg(name="text", path="x", split=bad))


def test_text_file_errors(tmp_path):
    with pytest.raises(DataError, match=r"data\.path.*missing\.txt"):
        load_corpus(data_cfg(name="text", path=str(tmp_path / "missing.txt")))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("ab")
    with pytest.raises(DataError, match=r"tiny\.txt.*valid split.*no tokens"):
        load_corpus(data_cfg(name="text", path=str(tiny), level="char", cache_dir=str(tmp_path / "c")))
    assert cache_files(tmp_path / "c") == []


def test_split_too_small_for_one_batch(tmp_path):
    c = load_corpus(data_cfg(name="ptb", root=str(_tiny_ptb(tmp_path)), cache_dir=str(tmp_path / "c")))
    assert len(c.splits["valid"]) == 3
    with pytest.raises(DataError, match=r"ptb/valid.*3 tokens.*batch_size=2.*at least 4"):
        c.iterator("valid", batch_size=2, tgt_len=4)
    it = c.iterator("valid", batch_size=1, tgt_len=4)
    assert len(it) == 1


# ====================================================================== iterator
def test_iterator_hand_computed():
    data = torch.arange(11)  # n = 11 // 2 = 5; the last token is dropped
    it = StreamIterator(data, batch_size=2, tgt_len=3)
    batches = list(it)
    assert len(it) == len(batches) == 2
    b0, b1 = batches
    assert isinstance(b0, Batch) and b0.index == 0 and b1.index == 1
    assert b0.input.tolist() == [[0, 1, 2], [5, 6, 7]]
    assert b0.target.tolist() == [[1, 2, 3], [6, 7, 8]]
    assert b1.input.tolist() == [[3], [8]] and b1.target.tolist() == [[4], [9]]
    assert b0.label is None and b0.input.dtype == torch.int64
    full = list(StreamIterator(data, 2, 3, drop_last=True))
    assert len(full) == 1 and full[0].input.tolist() == b0.input.tolist()
    assert [b.index for b in it.iterate(start=1)] == [1]
    assert list(it.iterate(start=2)) == []
    with pytest.raises(ValueError):
        list(it.iterate(start=3))


def reference_batches(data, B, L, drop_last):
    """Brute force: per stream and position, without views."""
    n = len(data) // B
    out = []
    t = 0
    while t * L < n - 1:
        seq = min(L, n - 1 - t * L)
        if drop_last and seq < L:
            break
        inp = [[int(data[b * n + t * L + j]) for j in range(seq)] for b in range(B)]
        tgt = [[int(data[b * n + t * L + j + 1]) for j in range(seq)] for b in range(B)]
        out.append((inp, tgt))
        t += 1
    return out


@settings(max_examples=60, deadline=None)
@given(
    n_tok=st.integers(2, 300),
    B=st.sampled_from([1, 2, 3, 4, 6]),
    L=st.integers(1, 40),
    drop_last=st.booleans(),
    W=st.sampled_from([1, 2, 3]),
)
def test_iterator_matches_brute_force(n_tok, B, L, drop_last, W):
    data = torch.randint(0, 1000, (n_tok,))
    labels = torch.arange(n_tok, dtype=torch.int16)
    n = n_tok // B
    if n < 2 or (drop_last and n - 1 < L):
        with pytest.raises(DataError):
            StreamIterator(data, B, L, drop_last=drop_last)
        return
    ref = reference_batches(data, B, L, drop_last)
    it = StreamIterator(data, B, L, labels=labels, drop_last=drop_last)
    assert len(it) == len(ref) == ((n - 1) // L if drop_last else -(-(n - 1) // L))
    for batch, (inp, tgt) in zip(it, ref):
        assert batch.input.tolist() == inp and batch.target.tolist() == tgt
        # labels follow the targets: here a token's label is its position in data
        assert torch.equal(data[batch.label.long()], batch.target)
    assert it.n_targets == sum(len(x[0]) * len(x[0][0]) for x in ref)
    if B % W == 0:
        shards = [StreamIterator(data, B, L, rank=r, world_size=W, drop_last=drop_last) for r in range(W)]
        assert all(len(s) == len(it) for s in shards)
        for t in range(len(it)):
            merged = torch.cat([s[t].input for s in shards])
            assert torch.equal(merged, it[t].input)
            assert torch.equal(torch.cat([s[t].target for s in shards]), it[t].target)
            assert all(s[t].input.shape[0] == B // W for s in shards)


def test_iterator_argument_errors():
    data = torch.arange(100)
    with pytest.raises(ConfigError, match="tgt_len=0"):
        StreamIterator(data, 2, 0)
    with pytest.raises(ConfigError, match="batch_size=0"):
        StreamIterator(data, 0, 4)
    with pytest.raises(ConfigError, match="divisible by world_size=3"):
        StreamIterator(data, 4, 4, world_size=3, rank=0)
    with pytest.raises(ConfigError, match="rank=2"):
        StreamIterator(data, 4, 4, world_size=2, rank=2)
    with pytest.raises(DataError, match=r"'train' has 100 tokens.*tgt_len=100.*at least 1,010"):
        StreamIterator(data, 10, 100, drop_last=True, split="train")
    assert len(StreamIterator(data, 10, 100, split="train")) == 1  # one short segment without drop_last
    with pytest.raises(DataError, match="labels"):
        StreamIterator(data, 2, 4, labels=torch.zeros(99))
    b = StreamIterator(data, 2, 4)[0].to("cpu")
    assert b.seq_len == 4


# ====================================================================== tools/getdata.sh
def test_getdata_syntax():
    subprocess.run(["bash", "-n", str(GETDATA)], check=True)
    assert os.access(GETDATA, os.X_OK)


def _fake_curl(tmp_path: Path, server: Path) -> dict:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    script = bindir / "curl"
    script.write_text(
        "#!/usr/bin/env bash\n"
        'out=""; url=""\n'
        'while [[ $# -gt 0 ]]; do case "$1" in -o) out=$2; shift 2;; --retry|--connect-timeout) shift 2;;'
        " -*) shift;; *) url=$1; shift;; esac; done\n"
        f'echo "$url" >> {log}\n'
        f'f={server}/$(basename "$url")\n'
        '[[ -f $f ]] || { echo "curl: (22) The requested URL returned error: 404" >&2; exit 22; }\n'
        'cp "$f" "$out"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}", "_LOG": str(log)}


def getdata(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GETDATA), *args], env=env, capture_output=True, text=True, check=False)


def test_getdata_with_fake_curl(shared_data, tmp_path):
    server = tmp_path / "server"
    server.mkdir()
    with zipfile.ZipFile(server / "wikitext-2-v1.zip", "w") as z:
        for f in ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"):
            z.write(shared_data / "wikitext-2" / f, f"wikitext-2/{f}")
    for s in ("train", "valid", "test"):
        (server / f"ptb.{s}.txt").write_bytes((shared_data / "penn" / f"{s}.txt").read_bytes())
    env = _fake_curl(tmp_path, server)
    dest = tmp_path / "data"
    run = getdata(env, str(dest), "wt2", "penn")
    assert run.returncode == 0, run.stderr
    for folder in ("wikitext-2", "penn"):
        ours = (dest / folder / "SHA256SUMS").read_text().split()
        theirs = (shared_data / folder / "SHA256SUMS").read_text().split()
        assert sorted(ours) == sorted(theirs)
        for f in theirs[1::2]:
            assert (dest / folder / f).read_bytes() == (shared_data / folder / f).read_bytes()
    assert not list(dest.glob(".getdata*"))
    calls = Path(env["_LOG"]).read_text().splitlines()
    assert len(calls) == 4
    # already there: nothing downloaded
    run = getdata(env, str(dest), "wikitext-2")
    assert run.returncode == 0 and "skipping" in run.stdout
    assert len(Path(env["_LOG"]).read_text().splitlines()) == 4
    # a corrupt download fails the checksum, naming the file
    (server / "ptb.valid.txt").write_bytes(b"corrupt\n")
    run = getdata(env, str(tmp_path / "d2"), "ptb")
    assert run.returncode != 0 and "checksum mismatch" in run.stderr and "valid.txt" in run.stderr
    # an unreachable file: a clear message
    run = getdata(env, str(tmp_path / "d3"), "enwik8")
    assert run.returncode != 0 and "download of enwik8.zip failed" in run.stderr
    assert not list((tmp_path / "d3").glob(".getdata*"))
    run = getdata(env, str(dest), "wt5")
    assert run.returncode != 0 and "unknown corpus 'wt5'" in run.stderr
