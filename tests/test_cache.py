"""Properties of the key-value cache and retrieval (docs/method.md §3 steps 2 and 5)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from crtn.model import RetrievalStats, evaluation_spec, with_spec
from crtn.model.cache import SegmentCache
from crtn.model.summary import make_summary
from tests.helpers import tiny_model
from tests.reference import naive_ngram_score

V = 11


def drive(model, steps, B=2, tokens=None, train=False):
    """Run ``steps`` segments; returns outputs and the final state."""
    L = model.tgt_len
    if tokens is None:
        tokens = torch.randint(0, V, (B, steps * L + 1))
    state, outs = None, []
    for t in range(steps):
        x, y = tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]
        with torch.set_grad_enabled(train):
            out = model(x, y, state)
        outs.append(out)
        state = out.state
    return outs, state


def test_fifo_order_and_positions_after_many_steps():
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 4, "model.mem_len": 6})
    L, M, N = 3, 6, 4
    outs, state = drive(model, 25)
    cache = state.cache
    cache.commit()
    # segments leave S after M/L steps; the cache holds the N most recent of them
    assert cache.n_insert == 25 - M // L
    newest_pos = (25 - 1) * L - M
    expected = {newest_pos - i * L for i in range(N)}
    for b in range(2):
        assert set(cache.pos[b].tolist()) == expected
        # ring order: slot (n_insert - 1) % N holds the newest segment
        assert cache.pos[b, (cache.n_insert - 1) % N].item() == newest_pos
    # the last step selected among the N segments cached before its own renewal, oldest first
    sel = outs[-1].selection
    t0 = 24 * L
    pos = t0 - sel.age
    assert set(pos.unique().tolist()) <= {p - L for p in expected}
    assert (pos[..., 1:] > pos[..., :-1]).all()


def test_cached_values_equal_the_states_that_left_memory():
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 8, "model.mem_len": 3})
    tokens = torch.randint(0, V, (2, 6 * 3 + 1))
    txl_states = []
    state = None
    for t in range(6):
        out = model(tokens[:, t * 3 : t * 3 + 3], tokens[:, t * 3 + 1 : t * 3 + 4], state)
        state = out.state
        txl_states.append(state.mem.clone())  # S after step t == H_t (mem_len = L)
    cache = state.cache
    cache.commit()
    # the segment of step t entered the cache at step t+1: its states are S after step t
    for t in range(5):
        slot = (cache.pos[0] == t * 3).nonzero().item()
        for b in range(2):
            torch.testing.assert_close(cache.values[:, b * 8 + slot], txl_states[t][:, b], rtol=0, atol=0)


def test_empty_slots_are_never_selected():
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 6, "cache.top_k": 3})
    outs, _ = drive(model, 8)
    for t, out in enumerate(outs):
        n_valid = max(0, t - 1)  # mem_len = L: the first segment enters the cache at step 2
        if n_valid == 0:
            assert out.selection is None
            continue
        k = min(3, n_valid)
        assert out.selection.slot.shape[-1] == k
        assert (out.selection.slot < n_valid).all()
        # distinct slots per token
        s = out.selection.slot.sort(-1).values
        assert (s[..., 1:] != s[..., :-1]).all()


@pytest.mark.parametrize("norm", ["all", "topk"])
def test_alpha_sums_to_one_over_the_slots_it_is_normalised_over(norm):
    model = tiny_model(
        V, **{"model.name": "crtn", "cache.n_slot": 5, "cache.top_k": 2, "cache.alpha_norm": norm}
    )
    outs, state = drive(model, 9)
    alpha = outs[-1].selection.alpha  # 5 valid slots, 2 selected
    if norm == "topk":
        torch.testing.assert_close(alpha.sum(-1), torch.ones_like(alpha[..., 0]))
    else:
        assert (alpha.sum(-1) < 1 - 1e-6).all() and (alpha > 0).all()
    # with k covering every valid slot, 'all' weights are the whole softmax: they sum to 1
    model = with_spec(model, evaluation_spec(model.spec, SimpleNamespace(top_k=5)))
    L = model.tgt_len
    x = torch.randint(0, V, (2, L))
    out = model(x, x, state)
    torch.testing.assert_close(out.selection.alpha.sum(-1), torch.ones_like(out.selection.alpha[..., 0]))


def test_no_gradient_reaches_cached_states_and_detach_stops_only_the_query_pass():
    def grads(detach):
        torch.manual_seed(0)
        model = tiny_model(
            V,
            **{
                "model.name": "crtn",
                "query.strategy": "linear",
                "summary.name": "linear",
                "summary.d_key": 4,
                "query.detach": detach,
            },
        ).train()
        tokens = torch.randint(0, V, (2, 7 * 3 + 1), generator=torch.Generator().manual_seed(1))
        outs, state = drive(model, 6, tokens=tokens)
        model.zero_grad()
        out = model(tokens[:, 18:21], tokens[:, 19:22], state)
        out.nll.sum().backward()
        cache = out.state.cache
        assert not cache.values.requires_grad and not cache.keys.requires_grad
        assert not out.state.mem.requires_grad and not out.state.r_prev.requires_grad
        return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}

    live, detached = grads(False), grads(True)
    # query.detach stops gradients into the query pass (R_cur) only: the retrieval's own
    # weights (the query's linear map, the summary applied to the windows) still train
    for name in ("summary.proj.weight", "query.seq_linear.weight"):
        assert live[name] is not None and live[name].abs().sum() > 0, name
        assert detached[name] is not None and detached[name].abs().sum() > 0, name
    # the query pass shares the layer weights: detaching changes their gradient
    w = "layers.0.dec_attn.qkv_net.weight"
    assert (live[w] - detached[w]).abs().max() > 1e-8


def test_torch_and_faiss_select_the_same_slots_and_weights():
    """The same slots, and the same weights softmax(s_topk)."""
    torch.manual_seed(3)
    kw = {
        "model.name": "crtn",
        "cache.n_slot": 4,
        "cache.top_k": 2,
        "cache.alpha_norm": "topk",
    }
    a = tiny_model(V, double=False, **kw)
    b = tiny_model(V, double=False, **{**kw, "cache.backend": "faiss"})
    b.load_state_dict(a.state_dict())
    tokens = torch.randint(0, V, (2, 20 * 3 + 1))
    oa, _ = drive(a, 20, tokens=tokens)  # 20 steps > 2N insertions: the faiss indexes get rebuilt
    ob, sb = drive(b, 20, tokens=tokens)
    compared = 0
    for x, y in zip(oa, ob):
        if x.selection is None:
            assert y.selection is None
            continue
        assert torch.equal(x.selection.slot, y.selection.slot)
        torch.testing.assert_close(x.selection.alpha, y.selection.alpha, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(x.nll, y.nll, rtol=1e-5, atol=1e-5)
        compared += 1
    assert compared >= 15
    assert sb.cache._faiss.indexes[0].ntotal <= 2 * 4


def test_hnsw_recall_is_reported():
    """Approximate search: recall@k against exact search (reported, not required to be 1)."""
    rng = np.random.default_rng(0)
    n, d, k = 2000, 32, 4
    summ = make_summary("last_state", 1, d)
    cache_exact = SegmentCache(n, 1, summ, backend="faiss", faiss_index="flat")
    cache_hnsw = SegmentCache(n, 1, summ, backend="faiss", faiss_index="hnsw")
    for i in range(n):
        states = torch.from_numpy(rng.standard_normal((2, 1, 1, d)).astype(np.float32))
        key = states[-1, :, -1]
        for c in (cache_exact, cache_hnsw):
            c.insert(states, key, i)
    for c in (cache_exact, cache_hnsw):
        c.commit()
    q = torch.from_numpy(rng.standard_normal((1, 64, d)).astype(np.float32))
    exact = cache_exact.select(q, top_k=k, alpha_norm="topk", t0=n).slot
    approx = cache_hnsw.select(q, top_k=k, alpha_norm="topk", t0=n).slot
    hits = sum(len(set(e.tolist()) & set(a.tolist())) for e, a in zip(exact[0], approx[0]))
    recall = hits / exact.numel()
    print(f"HNSW recall@{k} vs exact over {n} keys: {recall:.3f}")
    assert recall > 0.5


def test_cache_state_roundtrip_continues_identically():
    for backend in ("torch", "faiss"):
        model = tiny_model(
            V,
            double=False,
            **{"model.name": "crtn", "cache.n_slot": 3, "cache.backend": backend, "cache.alpha_norm": "topk"},
        )
        tokens = torch.randint(0, V, (2, 12 * 3 + 1))
        outs, state = drive(model, 6, tokens=tokens)
        saved = state.state_dict()
        restored = model.load_state(saved, 2, "cpu")
        x, y = tokens[:, 18:21], tokens[:, 19:22]
        with torch.no_grad():
            o1 = model(x, y, state)
            o2 = model(x, y, restored)
        assert torch.equal(o1.nll, o2.nll)
        assert torch.equal(o1.selection.slot, o2.selection.slot)


def test_eval_time_larger_cache_and_k():
    """An evaluation-time cache is another model object over the same parameters; the trained
    model is not changed."""
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 2, "cache.top_k": 1})
    ev = SimpleNamespace(tgt_len=None, mem_len=None, clamp_len=None, same_length=None, n_slot=8, top_k=3)
    evaluation = with_spec(model, evaluation_spec(model.spec, ev))
    outs, state = drive(evaluation, 12)
    assert state.cache.n_slot == 8 and outs[-1].selection.slot.shape[-1] == 3
    assert model.n_slot == 2 and model.top_k == 1


def test_retrieval_stats_histogram():
    stats = RetrievalStats()
    stats.update(torch.tensor([[[6, 9]], [[6, 12]]]), seg_len=3)
    stats.update(torch.tensor([[[15]]]), seg_len=3)
    s = stats.summary()
    assert s["distance_hist"] == [0, 0, 2, 1, 1, 1]
    assert s["mean_distance_tokens"] == pytest.approx((6 + 9 + 6 + 12 + 15) / 5)


@pytest.mark.parametrize(
    ("dtype", "summary"), [("float16", "last_state"), ("bfloat16", "last_state"), ("bfloat16", "token_max")]
)
def test_half_precision_cache_values_stay_within_1e3_of_float32(dtype, summary, bf16_units):
    """Half-precision cached values (float16; bfloat16, crtn's default, also with token_max's
    selection in bfloat16: docs/method.md §3, "A selection in bfloat16", as on a CPU with
    bfloat16 units) change the per-token NLL of a float32 model by less than 1e-3 over many
    segments with a full cache."""
    from tests.test_transformer import _segments

    V, L = 32, 4
    overrides = {
        "model.name": "crtn",
        "model.d_model": 32,
        "model.d_head": 8,
        "model.d_inner": 64,
        "model.tgt_len": L,
        "model.mem_len": L,
        "cache.n_slot": 6,
        "model.init_std": 0.05,
        "model.proj_init_std": 0.05,
        "summary.name": summary,
    }
    torch.manual_seed(0)
    ref = tiny_model(V, double=False, **overrides)
    half = tiny_model(V, double=False, **overrides, **{"cache.dtype": dtype})
    half.load_state_dict(ref.state_dict())
    tokens = torch.randint(0, V, (3, 20 * L + 1))
    with torch.no_grad():
        nll32, st32 = _segments(ref, tokens, L)
        nll16, st16 = _segments(half, tokens, L)
    assert st16.cache.values.dtype == getattr(torch, dtype) and st32.cache.values.dtype == torch.float32
    assert bool(st32.cache.pos.ge(0).all())  # the cache is full: the comparison covers retrieval
    diff = (nll16 - nll32).abs().max().item()
    print(f"max |NLL({dtype} cache) - NLL(float32 cache)| = {diff:.2e}")
    assert 0 < diff < 1e-3, diff


def test_backward_after_the_cache_was_renewed_raises_instead_of_wrong_gradients():
    """The retrieved-row products save the cached values for backward: a backward pass run
    after the next segment renewed the cache in place must fail loudly, not use
    the new values (it used to give gradients off by up to 0.2 without an error). Unweighted
    values keep the keys out of autograd, so only the values' own check can catch it."""
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 2, "cache.weighted": False}).train()
    tokens = torch.randint(0, V, (2, 8 * 3 + 1))
    _, state = drive(model, 4, tokens=tokens)  # cache full: every step renews a slot
    first = model(tokens[:, 12:15], tokens[:, 13:16], state)
    assert first.selection is not None
    model(tokens[:, 15:18], tokens[:, 16:19], first.state)  # commits the renewal in place
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        first.nll.sum().backward()


def test_retrieval_stats_alpha_histograms_by_hand():
    """alpha mass per token and the share of its largest weight, binned by tenths."""
    stats = RetrievalStats()
    alpha = torch.tensor([[[0.30, 0.10], [0.25, 0.25]], [[0.02, 0.06], [0.5, 0.45]]])  # [B=2, L=2, k=2]
    stats.update(torch.full((2, 2, 2), 3), seg_len=3, alpha=alpha)
    s = stats.summary()
    # masses 0.40, 0.50, 0.08, 0.95 (k=2: bins of 0.2 over [0, 2]) -> bins 2, 2, 0, 4
    assert s["alpha_mass_max"] == 2.0
    assert s["alpha_mass_hist"] == [1, 0, 2, 0, 1, 0, 0, 0, 0, 0]
    assert s["alpha_mass_mean"] == pytest.approx((0.40 + 0.50 + 0.08 + 0.95) / 4)
    # top shares 0.75, 0.5, 0.75, 0.5263 -> bins 7, 5, 7, 5
    assert s["alpha_top_share_hist"] == [0, 0, 0, 0, 0, 2, 0, 2, 0, 0]


def test_cosine_token_max_scores_a_token_s_own_row_highest_by_hand():
    """summary.cosine: the row equal to the query scores 1 even where a longer row has the larger dot
    product (a raw <e_k, e_j> can exceed <e_k, e_k>); without it the longer row wins, /sqrt(d)."""
    q = torch.tensor([[[1.0, 0.0]]])  # [B=1, L=1, d=2]
    rows = torch.tensor([[[[1.0, 0.0]], [[3.0, 1.0]]]])  # [B, N=2 slots, Ls=1, d]: the token, a longer row
    plain = make_summary("token_max", 1, 2, ngram=1, shift=0)
    cosine = make_summary("token_max", 1, 2, ngram=1, shift=0, cosine=True)
    torch.testing.assert_close(plain.score(q, rows), torch.tensor([[[1.0, 3.0]]]) / 2**0.5)
    torch.testing.assert_close(cosine.score(q, rows), torch.tensor([[[1.0, 3.0 / 10**0.5]]]))
    # the lead-in row (shift 1) is normalised too: slot 0 keyed by its zero predecessor scores 0
    shifted = make_summary("token_max", 1, 2, ngram=1, shift=1, cosine=True)
    # [B, N, 1, d]: slot 0 has no predecessor, slot 1's is the token, twice as long
    lead = torch.tensor([[[[0.0, 0.0]], [[2.0, 0.0]]]])
    torch.testing.assert_close(shifted.score(q, rows, lead=lead), torch.tensor([[[0.0, 1.0]]]))


@pytest.mark.parametrize("layers", [None, 1], ids=["every_layer", "top_layer"])
def test_exact_ngram_at_key_layer_0_scores_its_own_copy_1_in_training_with_dropout(layers):
    """cache.key_layer=0 with cosine scores in train mode with dropout: the query pass and the
    cached rows hold the embedding before dropout (docs/method.md §3, "Keys and queries at layer
    0"), so the segment X seen again scores exactly 1 against X's own slot at every token whose
    n-gram and following row lie inside it. The scores the model computes must equal a naive
    float64 n-gram cosine over the plain embeddings word_emb(tokens), one term at a time, and the
    best row of X's own slot (``cache.pos=match``, the default) is the one after the match. With
    retrieval in the top layer only (``cache.layers=1`` of 2) the slots store layer 0 apart and the
    query is the shared lower layers' layer 0."""
    torch.manual_seed(0)
    w, L, n_voc = 3, 6, 50
    model = tiny_model(
        n_voc,
        **{
            "model.name": "crtn",
            "model.n_layer": 2,
            "cache.layers": layers,
            "model.tgt_len": L,
            "model.mem_len": L,
            "model.dropout": 0.3,
            "model.dropemb": 0.2,
            "cache.n_slot": 2,
            "cache.key_layer": 0,
            "cache.top_k": 1,
            "cache.alpha_norm": "topk",
            "summary.name": "token_max",
            "summary.ngram": w,
            "summary.shift": 1,
            "summary.cosine": True,
        },
    ).train()
    x, y, z = (torch.randint(0, n_voc, (2, L)) for _ in range(3))
    seen = []
    score = model.summary.score
    model.summary.score = lambda *a, **k: seen.append(score(*a, **k)) or seen[-1]
    state = None
    for seg in (x, y, z, x):  # X leaves the memory into slot 0 after Y, Y into slot 1 after Z
        state = model(seg, None, state).state
    got, best = seen[-1]  # [B, L, 2] at the second X, and each slot's best row (cache.pos=match)
    emb = model.word_emb
    with torch.no_grad():
        for b in range(2):
            qs = list(emb(z[b : b + 1])[0]) + list(emb(x[b : b + 1])[0])  # R_prev then R_cur, [L] each
            slots = [(emb(x[b : b + 1])[0], None), (emb(y[b : b + 1])[0], emb(x[b : b + 1])[0])]
            for j in range(L):
                for s, (rows, lead) in enumerate(slots):
                    want = naive_ngram_score(model.summary, qs, j, rows, lead)
                    torch.testing.assert_close(got[b, j, s], want, rtol=0, atol=1e-12)
    own = got[:, w - 1 : L - 1, 0]  # the n-gram and the row after it inside X
    torch.testing.assert_close(own, torch.ones_like(own), rtol=0, atol=1e-12)
    # the best row of X's own slot is the one after the matched n-gram: token j's next, row j + 1
    assert torch.equal(best[:, w - 1 : L - 1, 0], torch.arange(w, L).expand(2, -1))
    assert state.cache.values.shape[0] == (3 if layers is None else 2)  # layers 0..2, or 0 and 1


@pytest.mark.parametrize("alpha_norm", ["topk", "original"])
def test_alpha_of_one_skips_the_selection_gradient_exactly(alpha_norm):
    """With one slot per token alpha is 1 under ``topk`` and ``original``, so the model neither
    scales the values nor differentiates the selection (``alpha_is_one``). Forcing the weighted
    path (alpha in autograd, values scaled by it) gives the same loss and the same gradients to
    1e-12, and gives the summary's and the query's weights (a learned ``d_key`` map, reached
    only through alpha) exactly zero gradient: the skipped computation contributed nothing."""
    over = {"model.name": "crtn", "cache.n_slot": 3, "cache.top_k": 1, "cache.alpha_norm": alpha_norm}
    over.update({"summary.name": "token_max", "summary.d_key": 8, "model.mem_len": 3})
    torch.manual_seed(0)
    fast = tiny_model(V, **over).train()
    assert fast.weighted is False
    forced = tiny_model(V, **over).train()
    forced.load_state_dict(fast.state_dict())
    forced.weighted = True  # the path a weighted model takes: alpha scales the values, with gradient
    tokens = torch.randint(0, V, (2, 6 * 3 + 1))
    _, st_fast = drive(fast, 5, tokens=tokens)
    _, st_forced = drive(forced, 5, tokens=tokens)
    x, y = tokens[:, 15:18], tokens[:, 16:19]
    loss_fast, loss_forced = fast(x, y, st_fast).nll.sum(), forced(x, y, st_forced).nll.sum()
    torch.testing.assert_close(loss_fast, loss_forced, rtol=0, atol=1e-12)
    assert st_fast.cache.n_valid == 3  # committed by the step: a choice among three slots
    loss_fast.backward()
    loss_forced.backward()
    own = ("summary.", "query.")
    checked = 0
    for (name, p), q in zip(fast.named_parameters(), forced.parameters(), strict=True):
        if name.startswith(own):
            assert p.grad is None, name
            assert q.grad is not None and q.grad.abs().max() == 0, name
            checked += 1
        elif q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    assert checked > 0  # the strategy and the summary have weights


def test_unfilled_slots_hold_zeros_and_never_reach_a_prediction():
    """Slots not yet filled hold zeros (the ring is saved whole in checkpoints), and nothing reads
    them: with NaN written there, a training step gives the loss and gradients of the clean
    state, bit for bit (a product over a slot range that included them would give NaN: 0·NaN)."""
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 4, "model.mem_len": 3}).train()
    tokens = torch.randint(0, V, (2, 6 * 3 + 1))
    _, state = drive(model, 4, tokens=tokens)
    cache = state.cache
    cache.commit()
    n1, S, Ls, d = cache.values.shape
    nv = cache.n_valid
    assert 0 < nv < 4  # stream 0's unfilled slots lie between the two streams' filled ones
    assert cache.values.view(n1, 2, 4, Ls, d)[:, :, nv:].abs().max() == 0
    clean = state.state_dict()
    poisoned = state.state_dict()
    poisoned["cache"] = dict(poisoned["cache"], values=cache.values.clone())
    poisoned["cache"]["values"].view(n1, 2, 4, Ls, d)[:, :, nv:] = float("nan")
    x, y = tokens[:, 12:15], tokens[:, 13:16]
    grads = []
    for sd in (clean, poisoned):
        model.zero_grad()
        st = model.load_state(sd, 2, "cpu")
        out = model(x, y, st)
        assert out.selection is not None
        out.nll.sum().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        grads[-1].append(out.nll.detach())
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("k", [1, 2])
def test_equal_scores_go_to_the_most_recent_slots_after_the_ring_wrapped(k):
    """With N = 3 after 9 steps the ring has wrapped, so slot order is not age order. One slot
    scores 0 and the other two tie at 1 for every token, each slot losing in turn (so in some
    case the older of the tied pair sits first in the ring): the k best are the tied pair, the
    more recent first (k = 1: the newer of the two; k = 2: both, returned oldest first)."""
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 3})
    _, state = drive(model, 9)
    cache = state.cache
    cache.commit()
    pos = cache.pos  # [B, 3] stream position of each slot's first token
    assert not (pos[:, 1:] > pos[:, :-1]).all()  # wrapped: not ascending in slot index
    B, L = pos.shape[0], model.tgt_len
    by_age = pos.argsort(1)  # [B, 3] slots oldest first
    rows = torch.arange(B)
    for loser in range(3):
        scores = torch.ones(B, L, 3)
        scores[rows, :, by_age[:, loser]] = 0.0
        tied = by_age[:, [a for a in range(3) if a != loser]]  # [B, 2] oldest first
        sel = cache.choose(scores, top_k=k, alpha_norm="topk", t0=int(pos.max()) + L)
        want = tied[:, 1:] if k == 1 else tied
        assert torch.equal(sel.slot, want[:, None, :].expand(B, L, k)), loser
