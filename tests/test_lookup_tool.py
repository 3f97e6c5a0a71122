"""tools/lookup_agreement.py: the longest-suffix match against hand-computed cases, and a run over a
trained checkpoint against a naive per-query loop over the same selections."""

from __future__ import annotations

import pytest
import torch

from crtn.checkpoint import checkpoint_spec, load_checkpoint, restore_model
from crtn.train import train_in
from tests.helpers import TINY_RUN, compose_train, load_tool


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A tiny crtn checkpoint trained for 30 steps on passages that repeat (its best.pt)."""
    run = tmp_path_factory.mktemp("lookup") / "run"
    train_in(compose_train([*TINY_RUN, "query=token", "train.max_step=30", "train.eval_interval=30"]), run)
    return str(run / "checkpoints/best.pt")


def test_longest_suffix_by_hand(monkeypatch):
    """Stream 0 = a b c a b c x b c, queries at 6, 7, 8, cached positions [1, 6) (q + 1 there, so
    q in 0..4): x matches nothing; b one token, at q = 1 and 4; c two (b c), at q = 2 only (q = 5
    is outside). With the cache [3, 6): b at q = 4 alone, c still at q = 2. Stream 1, all equal:
    q = 4 matches as far back as the stream goes, 5 tokens, cut at max_len 4 to a tie of q = 3, 4."""
    tool = load_tool("lookup_agreement", monkeypatch)
    a, b, c, x = 0, 1, 2, 3
    tokens = torch.tensor([[a, b, c, a, b, c, x, b, c], [a] * 9])

    def ends_at(ends, lo):
        return [(torch.arange(lo - 1, lo - 1 + e.shape[-1])[e]).tolist() for e in ends]

    length, ends = tool.longest_suffix(tokens, (6, 3), (1, 6), max_len=5)
    assert length.tolist() == [[0, 1, 2], [5, 5, 5]]
    assert ends_at(ends[0], 1) == [[], [1, 4], [2]] and ends_at(ends[1], 1) == [[4], [4], [4]]
    length, ends = tool.longest_suffix(tokens, (6, 3), (3, 6), max_len=5)
    assert length[0].tolist() == [0, 1, 2] and ends_at(ends[0], 3) == [[], [4], [2]]
    length, ends = tool.longest_suffix(tokens, (6, 3), (1, 6), max_len=4)
    assert length[1].tolist() == [4, 4, 4] and ends_at(ends[1], 1)[0] == [3, 4]
    with pytest.raises(ValueError, match="cached range"):
        tool.longest_suffix(tokens, (6, 3), (0, 6), max_len=5)
    with pytest.raises(ValueError, match="cached range"):
        tool.longest_suffix(tokens, (6, 3), (1, 7), max_len=5)


def _naive_counts(tool, tokens, selections, *, lo_of, seg, max_len):
    """The agreement counts by loops: every query, every earlier position, token by token."""
    counts = {k: [0] * len(tool.BUCKETS) for k in ("queries", "slot", "recent", "row", "with_row")}
    nll = {k: [0.0] * len(tool.BUCKETS) for k in ("with", "empty")}
    for t0, start, row, losses in selections:
        lo, hi = lo_of(t0)
        for bi in range(tokens.shape[0]):
            x = tokens[bi].tolist()
            for j in range(start.shape[1]):
                p = t0 + j
                lengths = {}
                for q in range(lo - 1, hi - 1):
                    n = 0
                    while n < max_len and p - n >= 0 and q - n >= 0 and x[p - n] == x[q - n]:
                        n += 1
                    lengths[q] = n
                best = max(lengths.values())
                ends = [q for q, n in lengths.items() if n == best and best > 0]
                chosen = (int(start[bi, j]) - lo) // seg
                i = next(k for k, (a, b) in enumerate(tool.BUCKETS) if best >= a and (b is None or best < b))
                counts["queries"][i] += 1
                counts["slot"][i] += any((q + 1 - lo) // seg == chosen for q in ends)
                counts["recent"][i] += bool(ends) and (max(ends) + 1 - lo) // seg == chosen
                counts["with_row"][i] += 1
                counts["row"][i] += any(q + 1 == int(row[bi, j]) for q in ends)
                for key, loss in zip(("with", "empty"), losses):
                    nll[key][i] += float(loss[bi, j])
    return counts, nll


def test_a_run_over_a_checkpoint_equals_a_naive_loop(trained, monkeypatch):
    """Over a trained checkpoint (passages that repeat, so long matches occur): the tool's counts
    and summed losses equal those of a naive loop over the same model's selections and losses
    (with the cache, and the same weights with an empty one), every counted query is counted
    once, some query of the long-match buckets agrees, and there the cache lowers the loss."""
    tool = load_tool("lookup_agreement", monkeypatch)
    ckpt_path = trained
    segments, batch = 5, 4
    tally = tool.measure(
        ckpt_path, n_slot=None, segments=segments, max_len=12, split="valid", batch_size=batch
    )
    ckpt = load_checkpoint(ckpt_path)
    cfg = checkpoint_spec(ckpt, None)
    corpus, model = restore_model(ckpt, cfg, ckpt_path)
    _, empty = restore_model(ckpt, checkpoint_spec(ckpt, {"cache": {"n_slot": 0}}), ckpt_path)
    assert empty.spec.cache.n_slot == 0
    N, L, m = cfg.cache.n_slot, model.tgt_len, cfg.model.mem_len
    state, state_empty, seen, selections = None, None, [], []
    with torch.no_grad():
        for i, b in enumerate(corpus.iterator("valid", batch, L)):
            seen.append(b.input)
            out = model(b.input, b.target, state)
            out_empty = empty(b.input, b.target, state_empty)
            state, state_empty = out.state, out_empty.state
            t0 = i * L
            if t0 - m - N * L >= 1 and len(selections) < segments:
                start = t0 - out.selection.age[..., 0]
                losses = (out.nll.double(), out_empty.nll.double())
                selections.append((t0, start, start + out.selection.row[..., 0], losses))
    tokens = torch.cat(seen, 1)
    naive, nll = _naive_counts(
        tool, tokens, selections, lo_of=lambda t0: (t0 - m - N * L, t0 - m), seg=L, max_len=12
    )
    assert tally.counts == naive
    for key in ("with", "empty"):
        assert tally.nll[key] == pytest.approx(nll[key], rel=1e-9, abs=1e-9)
    assert sum(naive["queries"]) == segments * batch * L
    assert sum(naive["slot"][2:]) > 0
    assert sum(nll["with"][2:]) < sum(nll["empty"][2:])
    assert "| 16-12 |" not in tally.table(12) and "| 0 |" in tally.table(12)


def test_retrieving_only_is_the_cache_where_true_and_an_empty_one_where_false(trained, monkeypatch):
    """Over a trained checkpoint's steps once the cache is full: a run inside
    :func:`retrieving_only` with every query allowed equals the run with the cache exactly; with
    none allowed it equals the same weights with an empty cache (to float32 rounding: the softmax
    runs over more, zero, terms); with half the streams allowed, each half equals its own; and
    the model's attention is restored on exit."""
    import crtn.model.attention as attention

    tool = load_tool("lookup_agreement", monkeypatch)
    path = trained
    ckpt = load_checkpoint(path)
    cfg = checkpoint_spec(ckpt, None)
    corpus, model = restore_model(ckpt, cfg, path)
    _, empty = restore_model(ckpt, checkpoint_spec(ckpt, {"cache": {"n_slot": 0}}), path)
    inner = attention.attend_with_cache
    batches = list(corpus.iterator("valid", 4, model.tgt_len))[: cfg.cache.n_slot + 4]
    half = torch.tensor([True, False, True, False])[:, None].expand(4, model.tgt_len)
    for allowed in ("all", "none", "half"):
        where = {"all": torch.ones_like(half), "none": torch.zeros_like(half), "half": half}[allowed]
        s_model, s_empty, s_gated = None, None, None
        with torch.no_grad():
            for b in batches:
                out = model(b.input, b.target, s_model)
                out_empty = empty(b.input, b.target, s_empty)
                with tool.retrieving_only(where):
                    out_gated = model(b.input, b.target, s_gated)
                s_model, s_empty, s_gated = out.state, out_empty.state, out_gated.state
        assert attention.attend_with_cache is inner
        assert out.selection is not None  # the cache was read in the compared steps
        if allowed != "none":
            assert torch.equal(out_gated.nll[where[:, 0]], out.nll[where[:, 0]])
        if allowed != "all":
            kept = ~where[:, 0]
            torch.testing.assert_close(out_gated.nll[kept], out_empty.nll[kept], rtol=0, atol=1e-5)
            assert not torch.allclose(out.nll[kept], out_empty.nll[kept], rtol=0, atol=1e-5)
