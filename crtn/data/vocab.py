"""Vocabulary: the mapping between symbols and integer ids (docs/method.md §4).

Order of the ids (it matters for the adaptive-softmax ``cutoffs``, which assume
that frequent symbols have small ids): the special symbols first (``<eos>`` for
word-level corpora, then ``<unk>`` when it is needed and the training text does
not already contain it), then every training symbol by descending training
frequency, ties broken by first occurrence in the training split.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import torch

from crtn.errors import DataError

EOS = "<eos>"
UNK = "<unk>"


class Vocab:
    """An ordered list of distinct symbols and its inverse.

    Attributes:
        idx2sym: ``list[str]``; ``idx2sym[i]`` is the symbol of id ``i``.
        sym2idx: ``dict[str, int]``, the inverse of ``idx2sym``.
        eos_idx: id of ``<eos>`` (the end-of-line / document separator), or None
            when the corpus has none (character-level corpora).
        unk_idx: id of ``<unk>``, to which symbols outside the vocabulary are
            mapped, or None when the vocabulary has none.

    Args:
        symbols: the symbols in id order; must be distinct.
        eos: which symbol plays ``<eos>`` (None: none).
        unk: which symbol plays ``<unk>`` (None: none).

    Raises:
        ValueError: duplicate symbols, or ``eos``/``unk`` given but absent.
    """

    def __init__(self, symbols: Sequence[str], eos: str | None = None, unk: str | None = None):
        self.idx2sym: list[str] = list(symbols)
        self.sym2idx: dict[str, int] = {s: i for i, s in enumerate(self.idx2sym)}
        if len(self.sym2idx) != len(self.idx2sym):
            raise ValueError("Vocab: duplicate symbols")
        for role, sym in (("eos", eos), ("unk", unk)):
            if sym is not None and sym not in self.sym2idx:
                raise ValueError(f"Vocab: {role} symbol {sym!r} is not in the symbol list")
        self.eos_idx: int | None = None if eos is None else self.sym2idx[eos]
        self.unk_idx: int | None = None if unk is None else self.sym2idx[unk]

    # ------------------------------------------------------------------ building
    @classmethod
    def from_counts(
        cls,
        symbols: Sequence[str],
        counts: Sequence[int] | np.ndarray,
        specials: Sequence[str] = (),
        eos: str | None = None,
        unk: str | None = None,
    ) -> tuple[Vocab, np.ndarray]:
        """Build the vocabulary from training counts, in the order of the module docstring.

        Args:
            symbols: candidate symbols in order of first occurrence in the
                training split (symbols with count 0 are left out).
            counts: training count of each candidate symbol.
            specials: symbols placed first, in this order (a special that also
                occurs in the text keeps its special position).
            eos, unk: which symbols play ``<eos>`` / ``<unk>`` (must be in the result).

        Returns:
            ``(vocab, new_id)`` where ``new_id`` (int64 array, one entry per
            candidate symbol) is the id of each candidate in ``vocab``, or -1 for
            candidates with count 0.
        """
        counts = np.asarray(counts, dtype=np.int64)
        if len(counts) != len(symbols):
            raise ValueError("Vocab.from_counts: symbols and counts differ in length")
        position = {s: i for i, s in enumerate(symbols)}
        if len(position) != len(symbols):
            raise ValueError("Vocab.from_counts: duplicate candidate symbols")
        is_special = np.zeros(len(symbols), dtype=bool)
        for sym in specials:
            if sym in position:
                is_special[position[sym]] = True
        keep = np.flatnonzero((counts > 0) & ~is_special)
        # stable sort: equal counts keep first-occurrence order
        order = keep[np.argsort(-counts[keep], kind="stable")]
        idx2sym = list(specials) + [symbols[i] for i in order]
        new_id = np.full(len(symbols), -1, dtype=np.int64)
        new_id[order] = np.arange(len(specials), len(specials) + len(order))
        for j, sym in enumerate(specials):
            if sym in position:
                new_id[position[sym]] = j
        return cls(idx2sym, eos=eos, unk=unk), new_id

    # ------------------------------------------------------------------ mapping
    def __len__(self) -> int:
        return len(self.idx2sym)

    def __contains__(self, sym: str) -> bool:
        return sym in self.sym2idx

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Vocab)
            and self.idx2sym == other.idx2sym
            and self.eos_idx == other.eos_idx
            and self.unk_idx == other.unk_idx
        )

    def __repr__(self) -> str:
        return f"Vocab(size={len(self)}, eos_idx={self.eos_idx}, unk_idx={self.unk_idx})"

    def encode(self, symbols: Iterable[str]) -> list[int]:
        """Ids of ``symbols``; symbols outside the vocabulary map to ``unk_idx``.

        Raises:
            DataError: a symbol is not in the vocabulary and there is no ``<unk>``.
        """
        get, unk = self.sym2idx.get, self.unk_idx
        out = []
        for s in symbols:
            i = get(s, unk)
            if i is None:
                raise DataError(f"symbol {s!r} is not in the vocabulary ({len(self)} symbols, no <unk>)")
            out.append(i)
        return out

    def decode(self, ids: Iterable[int] | torch.Tensor | np.ndarray) -> list[str]:
        """Symbols of ``ids`` (a list, 1-D array or tensor of ints in ``[0, len(self))``)."""
        if isinstance(ids, (torch.Tensor, np.ndarray)):
            ids = ids.reshape(-1).tolist()
        return [self.idx2sym[int(i)] for i in ids]

    # ------------------------------------------------------------------ files
    def to_json(self) -> dict:
        """JSON-serialisable form (see :meth:`from_json`)."""
        return {
            "idx2sym": self.idx2sym,
            "eos": None if self.eos_idx is None else self.idx2sym[self.eos_idx],
            "unk": None if self.unk_idx is None else self.idx2sym[self.unk_idx],
        }

    @classmethod
    def from_json(cls, obj: dict) -> Vocab:
        return cls(obj["idx2sym"], eos=obj.get("eos"), unk=obj.get("unk"))

    def save(self, path: str | Path) -> None:
        """Write the vocabulary as UTF-8 JSON (not atomic; the cache writes atomically)."""
        Path(path).write_text(json.dumps(self.to_json(), ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        """Read a vocabulary written by :meth:`save`."""
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))
