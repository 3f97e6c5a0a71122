"""The lookup of the preceding tokens (``query=lookup``; docs/method.md §3, "Lookup of the
preceding tokens"): its keys, its sorted index under first-in first-out renewal, its rules, and
a stream continued from a saved state. The model's selection and attention against a brute-force
search of every cached row: ``tests/test_crtn_reference.py``."""

from __future__ import annotations

import random

import pytest
import torch

from crtn.errors import ConfigError
from crtn.model.lookup import NO_ROW, LookupIndex, _multipliers, ending_keys, longest, match_lengths
from tests.helpers import LOOKUP as LOOKUP_MODEL
from tests.helpers import tiny_model, tiny_spec

LOOKUP = {
    "model.name": "crtn",
    **LOOKUP_MODEL,
    "model.tgt_len": 4,
    "model.mem_len": 4,
    "summary.ngram": 2,
    "query.max_match": 4,
}


def test_match_lengths_double_from_the_ngram_and_end_at_the_longest():
    assert match_lengths(4, 16) == (4, 8, 16)
    assert match_lengths(4, 12) == (4, 8, 12)
    assert match_lengths(3, 3) == (3,)
    assert match_lengths(1, 5) == (1, 2, 4, 5)


def test_equal_keys_are_exactly_equal_ngrams():
    """Over every pair of positions of a few streams of 3 symbols (many repeats): keys are equal
    exactly where the l tokens ending there are, and there is none where they reach before the
    start or over an unknown token (-1)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 3, (2, 60))
    tokens[1, 20] = -1
    lengths = (1, 3, 5)
    keys = ending_keys(tokens, lengths)
    flat = [(b, p) for b in range(2) for p in range(60)]
    for i, n in enumerate(lengths):
        for b, p in flat:
            window = tokens[b, p - n + 1 : p + 1].tolist() if p >= n - 1 else None
            known = window is not None and min(window) >= 0
            assert (int(keys[i, b, p]) != NO_ROW) == known, (n, b, p)
            assert not known or int(keys[i, b, p]) >= 0
        for (b, p), (c, q) in random.Random(n).sample([(x, y) for x in flat for y in flat], 3000):
            if keys[i, b, p] == NO_ROW or keys[i, c, q] == NO_ROW:
                continue
            same = tokens[b, p - n + 1 : p + 1].tolist() == tokens[c, q - n + 1 : q + 1].tolist()
            assert bool(keys[i, b, p] == keys[i, c, q]) == same, (n, b, p, c, q)


def _keys_offset_by_offset(tokens: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
    """The hash of :func:`ending_keys` summed one offset a at a time: sum_a x_{p-a} m_a modulo
    2^64, NO_ROW where a token is unknown or before the first column."""
    B, S = tokens.shape
    mult = _multipliers(max(lengths), tokens.device)
    acc = torch.zeros(B, S, dtype=torch.long)
    known = torch.ones(B, S, dtype=torch.bool)
    out = []
    for a in range(max(lengths)):
        back = torch.full_like(tokens, -1)
        back[:, a:] = tokens[:, : S - a]
        acc += back * mult[a]
        known &= back >= 0
        if a + 1 in lengths:
            out.append(torch.where(known, acc & ((1 << 63) - 1), NO_ROW))
    return torch.stack(out)


@pytest.mark.parametrize(
    ("B", "S", "lengths"), [(2, 60, (1, 3, 5)), (4, 80, (4, 8, 16)), (3, 5, (5,)), (1, 1, (1,))]
)
def test_keys_equal_the_sum_offset_by_offset(B, S, lengths):
    """The keys are exactly the sum over offsets, bit for bit (the running sum wraps modulo 2^64
    in any order), so an index saved in a checkpoint keeps matching the keys computed now."""
    torch.manual_seed(B * S)
    tokens = torch.randint(0, 300, (B, S))
    tokens[0, : min(3, S)] = -1
    tokens[-1, S // 2] = -1
    keys = ending_keys(tokens, lengths)
    assert keys.is_contiguous()
    assert torch.equal(keys, _keys_offset_by_offset(tokens, lengths))


def test_the_index_finds_the_most_recent_equal_key_under_renewal():
    """Slots of 5 keys from 4 values enter a ring of 3 slots for 12 steps; after each, every
    query finds the most recent equal key of the slots held, or none, as a list search does."""
    gen = torch.Generator().manual_seed(1)
    n_slot, Ls, B = 3, 5, 2
    index, held = LookupIndex(), []  # held: (insert count, ring slot, keys [2, B, Ls])
    for t in range(12):
        keys = torch.randint(0, 4, (2, B, Ls), generator=gen)
        slot = t % n_slot
        index.renew(keys, slot, evict=t >= n_slot)
        held = [h for h in held if h[1] != slot] + [(t, slot, keys)]
        queries = torch.randint(0, 5, (2, B, 6), generator=gen)
        hit, where = index.find(queries)
        for i in range(2):
            for b in range(B):
                for j in range(6):
                    want = None
                    for _, s, k in sorted(held):  # oldest first: the last equal key wins
                        for r in range(Ls):
                            if k[i, b, r] == queries[i, b, j]:
                                want = s * Ls + r
                    assert bool(hit[i, b, j]) == (want is not None)
                    if want is not None:
                        assert int(where[i, b, j]) == want, (t, i, b, j)


def test_the_renewed_index_equals_one_sort_of_the_slots_held():
    """After every renewal, with and without eviction, the merged index is exactly the stable
    sort of the held slots' keys taken oldest first (:meth:`LookupIndex.of_slots`): the same keys
    and the same row for each, ties in stream order."""
    gen = torch.Generator().manual_seed(2)
    n_slot, Ls, B = 4, 6, 3
    index, ring = LookupIndex(), torch.zeros(2, B, n_slot, Ls, dtype=torch.long)
    for t in range(11):
        keys = torch.randint(0, 5, (2, B, Ls), generator=gen)
        slot = t % n_slot
        index.renew(keys, slot, evict=t >= n_slot)
        ring[:, :, slot] = keys
        held = min(t + 1, n_slot)  # slots 0..t until the ring is full, then the oldest is slot + 1
        oldest_first = torch.tensor([(t + 1 + i) % n_slot for i in range(n_slot)][-held:])
        want = LookupIndex.of_slots(ring[:, :, :held], oldest_first)
        assert torch.equal(index.keys, want.keys), t
        assert torch.equal(index.where, want.where), t


def test_longest_takes_the_longest_length_that_occurred():
    hit = torch.tensor([[[True, True, False, False]], [[False, True, True, False]]])  # [n_len 2, B 1, L 4]
    where = torch.tensor([[[1, 2, 3, 4]], [[5, 6, 7, 8]]])
    found, at, length = longest(hit, where)
    assert found.tolist() == [[True, True, True, False]]
    assert at[found].tolist() == [1, 6, 7]
    assert length.tolist() == [[0, 1, 1, -1]]


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"cache.top_k": 2}, "cache.top_k=2: query=lookup retrieves one row per token"),
        ({"cache.alpha_norm": "all"}, "cache.alpha_norm=all is a softmax over scores query=lookup does not"),
        ({"query.max_match": 1}, "query.max_match=1 must be >= summary.ngram=2"),
        ({"query.max_match": 0}, "query.max_match=0 must be >= 1"),
        ({"query.detach": True}, "query.detach=true is ignored by query=lookup"),
        ({"summary.d_key": 4}, "summary.d_key=4 is ignored by query=lookup"),
        ({"summary.cosine": True}, "summary.cosine=true is ignored by query=lookup"),
        ({"cache.key_layer": 0}, "cache.key_layer=0 applies to the query strategies that score states"),
        ({"cache.backend": "faiss"}, "cache.backend=faiss does not support summary=token_max"),
        (
            {"query.strategy": "token", "summary.name": "token_max"},
            "query.max_match=4 is ignored by query=token",
        ),
    ],
)
def test_options_a_lookup_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        tiny_spec(**{**LOOKUP, **overrides})


def test_a_stream_continues_exactly_from_its_saved_state():
    """The state after 6 segments (the token history and the sorted index with it), saved and
    loaded into a fresh state, continues as the running stream does: same losses and selections."""
    torch.manual_seed(0)
    model = tiny_model(5, **LOOKUP)
    tokens = torch.randint(0, 3, (2, 49))
    state = None
    for t in range(6):
        state = model(tokens[:, 4 * t : 4 * t + 4], tokens[:, 4 * t + 1 : 4 * t + 5], state).state
    loaded = model.load_state(state.state_dict(), 2, "cpu")
    found = 0
    for t in range(6, 12):
        x, y = tokens[:, 4 * t : 4 * t + 4], tokens[:, 4 * t + 1 : 4 * t + 5]
        a, b = model(x, y, state), model(x, y, loaded)
        torch.testing.assert_close(a.nll, b.nll, rtol=0, atol=0)
        assert torch.equal(a.selection.starts(4 * t), b.selection.starts(4 * t))
        found += int(a.selection.found.sum())
        state, loaded = a.state, b.state
    assert found > 0
