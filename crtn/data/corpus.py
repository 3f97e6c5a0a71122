"""Corpora: reading, encoding and caching the language-modeling data sets (docs/method.md §4).

:func:`load_corpus` turns a ``data`` config node (the fields of
:class:`crtn.data.spec.DataSpec`) into a :class:`Corpus`: the vocabulary and the
train/valid/test splits as 1-D ``int64`` tensors of symbol ids.

Data sets (``data.name``; the corpus folder is ``data.root / data.dir``, ``dir``
defaulting to the standard folder name in :data:`DEFAULT_DIRS`):

- ``wt2``, ``wt103``: ``wiki.{train,valid,test}.tokens``; ``ptb``:
  ``{train,valid,test}.txt``. Word level: each line is split on whitespace and
  ``<eos>`` is appended to every line (an empty line gives one ``<eos>``).
- ``enwik8`` (raw file ``enwik8``: one symbol per byte) and ``text8`` (raw
  file ``text8``: one symbol per character): character level, no ``<eos>``;
  the last 5M symbols are the test split, the 5M before them the valid split,
  the rest (90M for the public files) the train split. The Transformer-XL
  release's preprocessed layout (``{train,valid,test}.txt`` of
  whitespace-separated symbols) is accepted too.
- ``text``: any UTF-8 file ``data.path``, word level (as above) or character
  level (every character, newline included, is a symbol), cut into
  train/valid/test by the fractions ``data.split`` (contiguous, in file order).
- ``synthetic``: generated, see :mod:`crtn.data.synthetic`.
- ``mqar``: generated, see :mod:`crtn.data.mqar` (multi-query associative recall).

The vocabulary is built from the training split only (see :mod:`crtn.data.vocab`
for the order of the ids); symbols of valid/test outside it map to ``<unk>``
(added as a special symbol only when needed and absent from the training text).

Caching: the vocabulary (JSON) and the encoded splits (``.npy``, int32) are
written once to ``data.cache_dir``, else to ``.crtn-cache/`` inside the corpus
folder when that folder is writable, else to
``${XDG_CACHE_HOME:-~/.cache}/crtn/<hash of the corpus path>/``. File names
carry a key that changes with the size and mtime of each source file and with
the options that affect the encoding. Concurrent processes take a
:class:`filelock.FileLock` so that the cache is built once; every file is
written to a temporary file in the same folder and moved into place with
``os.replace``; after an error no partial file remains.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from crtn.data.base import SPLITS, Corpus
from crtn.data.mqar import make_mqar
from crtn.data.spec import (
    DEFAULT_DIRS,
    DataSpec,
    metric_name,
    resolve_data,
)
from crtn.data.synthetic import make_synthetic
from crtn.data.vocab import EOS, UNK, Vocab
from crtn.errors import DataError
from crtn.utils import atomic_write

#: Symbols held out at the end of a raw character-level corpus for test, and before them for valid.
CHAR_HELDOUT = 5_000_000
#: Bump when the cache format or the encoding rules change.
CACHE_VERSION = 1
_WORD_FILES = {
    "wt2": ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
    "wt103": ("wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"),
    "ptb": ("train.txt", "valid.txt", "test.txt"),
}
_PREPROCESSED_FILES = ("train.txt", "valid.txt", "test.txt")
_CHUNK_BYTES = 1 << 24


# ====================================================================== entry point
def load_corpus(cfg: Any) -> Corpus:
    """Load (or generate) the corpus described by a ``data`` spec (docs/method.md §4).

    Args:
        cfg: an object with the fields of :class:`crtn.data.spec.DataSpec` (the spec, a config
            node, or a plain dict); it is resolved first (:func:`resolve_data`).

    Returns:
        The :class:`Corpus`; encoded splits come from the cache when it is valid.

    Raises:
        ConfigError: see :func:`resolve_data`; bad synthetic or mqar settings.
        DataError: missing corpus folder or split file, empty file, invalid
            UTF-8 (with the byte offset), a split without tokens, an unusable
            ``data.cache_dir``.
    """
    spec = resolve_data(cfg)
    if spec.name == "synthetic":
        return make_synthetic(spec.synthetic)
    if spec.name == "mqar":
        return make_mqar(spec.mqar)
    return _load_cached(_plan(spec), spec.cache_dir)


# ====================================================================== plans
@dataclass
class _Plan:
    """What to read and how: everything that determines the encoded corpus."""

    name: str
    level: str  # word | char
    reader: str  # words (whitespace tokens) | bytes | chars
    eos: bool  # append <eos> per line (reader=words)
    files: list[Path]  # one per split, or a single file cut by `cut`
    corpus_dir: Path  # where the default cache goes
    cut: tuple | None = None  # ("fractions", f_train, f_valid, f_test) | ("heldout", n)

    def key_data(self) -> dict:
        files = []
        for f in self.files:
            st = f.stat()
            files.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
        return {
            "version": CACHE_VERSION,
            "name": self.name,
            "level": self.level,
            "reader": self.reader,
            "eos": self.eos,
            "cut": list(self.cut) if self.cut else None,
            "files": files,
        }


def _plan(spec: DataSpec) -> _Plan:
    name = spec.name
    if name == "text":
        return _plan_text(spec)
    root = Path(spec.root)
    folder = root / spec.dir
    if name in _WORD_FILES:
        files = [folder / f for f in _WORD_FILES[name]]
        _check_folder(name, folder, files)
        _check_files(files)
        if spec.level == "char":  # the same files, every character a symbol (newlines included)
            return _Plan(name, level="char", reader="chars", eos=False, files=files, corpus_dir=folder)
        return _Plan(name, level="word", reader="words", eos=True, files=files, corpus_dir=folder)
    # enwik8 / text8: the raw file, or the Transformer-XL release's preprocessed layout
    raw = folder / name
    pre = [folder / f for f in _PREPROCESSED_FILES]
    if raw.is_file():
        _check_files([raw])
        reader = "bytes" if name == "enwik8" else "chars"
        cut = ("heldout", CHAR_HELDOUT)
        return _Plan(name, level="char", reader=reader, eos=False, files=[raw], corpus_dir=folder, cut=cut)
    if any(f.exists() for f in pre):
        _check_files(pre)
        return _Plan(name, level="char", reader="words", eos=False, files=pre, corpus_dir=folder)
    _check_folder(name, folder, [raw])
    raise DataError(
        f"corpus folder {str(folder)!r} has neither the raw file {name!r} nor the preprocessed "
        f"{', '.join(_PREPROCESSED_FILES)}; run tools/getdata.sh {root} {name}"
    )


def _plan_text(spec: DataSpec) -> _Plan:
    file = Path(spec.path)
    if not file.is_file():
        raise DataError(f"data.path: text file {str(file)!r} not found")
    _check_files([file])
    level = spec.level
    reader = "words" if level == "word" else "chars"
    cut = ("fractions", *spec.split)
    return _Plan(
        "text", level=level, reader=reader, eos=level == "word", files=[file], corpus_dir=file.parent, cut=cut
    )


def _check_folder(name: str, folder: Path, files: list[Path]) -> None:
    if not folder.is_dir():
        expected = ", ".join(f.name for f in files)
        raise DataError(
            f"corpus folder {str(folder)!r} for data.name={name} not found (expected {expected} in it); "
            f"run tools/getdata.sh {folder.parent} {DEFAULT_DIRS[name]} to download it (into "
            f"{folder.parent / DEFAULT_DIRS[name]}), or set data.root/data.dir"
        )


def _check_files(files: list[Path]) -> None:
    for f in files:
        if not f.is_file():
            raise DataError(f"split file {str(f)!r} not found (expected {', '.join(g.name for g in files)})")
        if f.stat().st_size == 0:
            raise DataError(f"file {str(f)!r} is empty")


# ====================================================================== caching
def _dir_writable(path: Path) -> bool:
    """Writable by us *and* by its permission bits (root ignores the bits; we do not)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK) and bool(
        st.st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    )


def cache_dir_for(corpus_dir: Path, cache_dir: str | None) -> Path | None:
    """The cache folder of a corpus (module docstring); None when no folder can be used.

    Raises:
        DataError: ``data.cache_dir`` is set but cannot be created or written.
    """
    if cache_dir:
        path = Path(cache_dir)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataError(f"data.cache_dir={cache_dir!r} cannot be created: {e.strerror}") from None
        if not _dir_writable(path):
            raise DataError(f"data.cache_dir={cache_dir!r} is not writable")
        return path
    local = corpus_dir / ".crtn-cache"
    if _dir_writable(local) or (not local.exists() and _dir_writable(corpus_dir)):
        try:
            local.mkdir(exist_ok=True)
            return local
        except OSError:
            pass
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    digest = hashlib.sha256(str(corpus_dir.resolve()).encode()).hexdigest()[:12]
    path = base / "crtn" / digest
    try:
        path.mkdir(parents=True, exist_ok=True)
        if _dir_writable(path):
            return path
    except OSError:
        pass
    warnings.warn(
        f"no writable cache folder for {str(corpus_dir)!r}; the corpus is encoded without a cache",
        stacklevel=2,
    )
    return None


def _atomic_write(path: Path, write: Callable[[Any], None]) -> None:
    """Write ``path`` through a temporary file in its folder and ``os.replace``; no leftovers on error."""
    atomic_write(path, write, mode=None)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class _CacheFiles:
    def __init__(self, folder: Path, plan: _Plan):
        key_data = plan.key_data()
        key = hashlib.sha256(json.dumps(key_data, sort_keys=True).encode()).hexdigest()[:16]
        self.key_data = key_data
        self.prefix = f"{plan.name}-{key}"
        self.folder = folder
        self.vocab = folder / f"{self.prefix}.vocab.json"
        self.splits = {s: folder / f"{self.prefix}.{s}.npy" for s in SPLITS}
        self.meta = folder / f"{self.prefix}.meta.json"  # written last: the cache is complete
        self.lock = folder / f"{self.prefix}.lock"

    def load(self) -> tuple[Vocab, dict[str, np.ndarray], dict] | None:
        """The cached corpus, or None when it is absent, incomplete or unreadable."""
        if not self.meta.is_file():
            return None
        try:
            meta = json.loads(self.meta.read_text(encoding="utf-8"))
            vocab = Vocab.load(self.vocab)
            arrays = {s: np.load(self.splits[s], allow_pickle=False) for s in SPLITS}
            vocab_bytes = self.vocab.read_bytes()
        except (OSError, ValueError, KeyError):
            return None
        if meta.get("vocab_sha256", _sha256(vocab_bytes)) != _sha256(vocab_bytes):
            return None  # a vocabulary file from elsewhere (another corpus, a partial copy)
        for s in SPLITS:
            a = arrays[s]
            if a.ndim != 1 or len(a) != meta["tokens"][s] or (len(a) and a.max() >= len(vocab)):
                return None
        return vocab, arrays, meta

    def save(self, vocab: Vocab, arrays: dict[str, np.ndarray], meta: dict) -> None:
        """Write every file atomically, the meta file last; on error remove what was written."""
        written: list[Path] = []
        try:
            data = json.dumps(vocab.to_json(), ensure_ascii=False).encode("utf-8")
            _atomic_write(self.vocab, lambda f: f.write(data))
            written.append(self.vocab)
            for s in SPLITS:
                _atomic_write(self.splits[s], lambda f, a=arrays[s]: np.save(f, a, allow_pickle=False))
                written.append(self.splits[s])
            meta = {**meta, "key": self.key_data, "vocab_sha256": _sha256(data)}
            meta_bytes = json.dumps(meta, indent=1).encode("utf-8")
            _atomic_write(self.meta, lambda f: f.write(meta_bytes))
        except BaseException:
            for p in written:
                with contextlib.suppress(OSError):
                    p.unlink()
            raise


def _load_cached(plan: _Plan, cache_dir: str | None) -> Corpus:
    folder = cache_dir_for(plan.corpus_dir, cache_dir)
    if folder is None:
        vocab, arrays, meta = _build(plan)
        return _make_corpus(plan, vocab, arrays=arrays, meta=meta, extra={"cache": "off"})
    files = _CacheFiles(folder, plan)
    hit = files.load()  # fast path: a complete cache needs no lock
    status = "loaded"
    if hit is None:
        fresh = not any(folder.iterdir())
        try:
            with FileLock(str(files.lock)):
                hit = files.load()  # another process may have built it while we waited
                if hit is None:
                    vocab, arrays, meta = _build(plan)
                    _save_cache(files, vocab, arrays, meta)
                    hit, status = (vocab, arrays, meta), "built"
        except BaseException:  # a bad corpus or a full disk leaves no trace in the cache folder
            with contextlib.suppress(OSError):
                files.lock.unlink()
                if fresh:
                    folder.rmdir()
            raise
    vocab, arrays, meta = hit
    return _make_corpus(
        plan, vocab, arrays=arrays, meta=meta, extra={"cache": status, "cache_dir": str(folder)}
    )


def _save_cache(files: _CacheFiles, vocab: Vocab, arrays: dict[str, np.ndarray], meta: dict) -> None:
    try:
        files.save(vocab, arrays, meta)
    except OSError as e:
        raise DataError(
            f"cannot write the corpus cache in {str(files.folder)!r} ({e.strerror or e}); free space "
            "there or set data.cache_dir to another folder"
        ) from None


def _make_corpus(plan: _Plan, vocab: Vocab, arrays: dict[str, np.ndarray], meta: dict, extra: dict) -> Corpus:
    splits = {s: torch.from_numpy(np.asarray(arrays[s], dtype=np.int64)) for s in SPLITS}
    counts = torch.bincount(splits["train"], minlength=len(vocab))
    info = {
        **{k: v for k, v in meta.items() if k not in ("key", "vocab_sha256")},
        **extra,
        "files": [str(f) for f in plan.files],
    }
    return Corpus(
        name=plan.name,
        vocab=vocab,
        level=plan.level,
        metric=metric_name(plan.level),
        splits=splits,
        train_counts=counts,
        info=info,
    )


# ====================================================================== building
class _SymbolTable:
    """Provisional ids in order of first occurrence (over the files in reading order)."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def encode(self, words: list[str]) -> np.ndarray:
        index = self.index
        for w in dict.fromkeys(words):
            if w not in index:
                index[w] = len(index)
        return np.fromiter(map(index.__getitem__, words), dtype=np.int32, count=len(words))

    @property
    def symbols(self) -> list[str]:
        return list(self.index)


def _chunks(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(byte offset, bytes)`` pieces of a file, each ending at a newline (or at the end)."""
    with open(path, "rb") as f:
        offset = 0
        while True:
            buf = f.read(_CHUNK_BYTES)
            if not buf:
                return
            if not buf.endswith(b"\n"):
                buf += f.readline()
            yield offset, buf
            offset += len(buf)


def _decode(path: Path, buf: bytes, offset: int) -> str:
    try:
        return buf.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"file {str(path)!r} is not valid UTF-8: byte 0x{buf[e.start]:02x} at byte offset "
            f"{offset + e.start} ({e.reason})"
        ) from None


def _read_words(path: Path, table: _SymbolTable, eos: bool) -> np.ndarray:
    """Whitespace tokens of a UTF-8 file (universal newlines), ``<eos>`` after each line if ``eos``."""
    pieces = []
    last = b""
    for offset, buf in _chunks(path):
        text = _decode(path, buf, offset)
        if "\r" in text:
            text = text.replace("\r\n", "\n").replace("\r", "\n")
        if eos:
            text = text.replace("\n", f" {EOS} ")
        pieces.append(table.encode(text.split()))
        last = buf
    if eos and last and not last.endswith((b"\n", b"\r")):
        pieces.append(table.encode([EOS]))  # the last line has no newline
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)


def _read_codes(path: Path, reader: str) -> np.ndarray:
    """Raw character-level file as integer codes: bytes (``reader=bytes``) or Unicode code points."""
    raw = np.fromfile(path, dtype=np.uint8)
    if reader == "bytes" or len(raw) == 0 or raw.max() < 0x80:
        return raw
    text = _decode(path, raw.tobytes(), 0)
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


def _codes_in_order(codes: np.ndarray, size: int) -> np.ndarray:
    """Distinct values of ``codes`` in order of first occurrence (chunked, vectorised)."""
    seen = np.zeros(size, dtype=bool)
    order: list[int] = []
    step = 1 << 20
    for start in range(0, len(codes), step):
        chunk = codes[start : start + step]
        new = chunk[~seen[chunk]]
        if len(new) == 0:
            continue
        values, first = np.unique(new, return_index=True)
        values = values[np.argsort(first, kind="stable")]
        order.extend(values.tolist())
        seen[values] = True
    return np.asarray(order, dtype=np.int64)


def _cut(plan: _Plan, ids: np.ndarray) -> dict[str, np.ndarray]:
    n = len(ids)
    kind = plan.cut[0]
    if kind == "heldout":
        held = plan.cut[1]
        if n <= 2 * held:
            raise DataError(
                f"file {str(plan.files[0])!r} has {n:,} symbols; the standard {plan.name} split holds out "
                f"the last 2 x {held:,} for valid and test, so more are needed (the public file has 100,000,000)"
            )
        bounds = (n - 2 * held, n - held)
    else:
        f_train, f_valid, _ = plan.cut[1:]
        bounds = (round(n * f_train), round(n * (f_train + f_valid)))
    parts = {"train": ids[: bounds[0]], "valid": ids[bounds[0] : bounds[1]], "test": ids[bounds[1] :]}
    for s, a in parts.items():
        if len(a) == 0:
            raise DataError(
                f"file {str(plan.files[0])!r}: the {s} split of data.split={list(plan.cut[1:])} has no "
                f"tokens ({n} tokens in all)"
            )
    return parts


def _build(plan: _Plan) -> tuple[Vocab, dict[str, np.ndarray], dict]:
    """Read and encode the corpus: ``(vocab, {split: int32 ids}, meta)``."""
    # 1. provisional ids, in order of first occurrence (train first)
    if plan.reader == "words":
        table = _SymbolTable()
        pieces = [_read_words(f, table, plan.eos) for f in plan.files]
        symbols = table.symbols
    else:  # one file cut by `cut`, or one per split (a word corpus read as characters)
        codes = [_read_codes(f, plan.reader) for f in plan.files]
        size = max(int(c.max()) for c in codes) + 1
        order = _codes_in_order(np.concatenate(codes), size)
        lut = np.full(size, -1, dtype=np.int32)
        lut[order] = np.arange(len(order), dtype=np.int32)
        pieces = [lut[c] for c in codes]
        symbols = [chr(int(c)) for c in order]
    if plan.cut is None:
        for f, a in zip(plan.files, pieces):
            if len(a) == 0:
                raise DataError(f"file {str(f)!r} has no tokens")
        prov = dict(zip(SPLITS, pieces))
    else:
        prov = _cut(plan, pieces[0])

    # 2. the vocabulary from the training counts
    counts = np.bincount(prov["train"], minlength=len(symbols))
    unseen = {s: int(np.count_nonzero(counts[prov[s]] == 0)) for s in ("valid", "test")}
    in_train = {sym for sym, c in zip(symbols, counts) if c > 0 and sym in (EOS, UNK)}
    specials = [EOS] if plan.eos else []
    need_unk = unseen["valid"] + unseen["test"] > 0
    unk = UNK if need_unk or UNK in in_train else None
    if need_unk and UNK not in in_train:
        specials.append(UNK)
    candidates = symbols + [s for s in specials if s not in symbols]
    cand_counts = np.concatenate([counts, np.zeros(len(candidates) - len(symbols), np.int64)])
    vocab, new_id = Vocab.from_counts(
        candidates, cand_counts, specials, eos=EOS if plan.eos else None, unk=unk
    )

    # 3. final ids
    if vocab.unk_idx is not None:
        new_id = np.where(new_id < 0, vocab.unk_idx, new_id)
    new_id = new_id.astype(np.int32)
    arrays = {s: new_id[prov[s]] for s in SPLITS}
    meta = {
        "tokens": {s: len(arrays[s]) for s in SPLITS},
        "vocab_size": len(vocab),
        "oov_tokens": {"train": 0, **unseen},
    }
    return vocab, arrays, meta
