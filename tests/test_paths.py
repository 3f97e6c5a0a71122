"""Paths and wiring that the tiny reference tests do not reach, each against an independent reference.

- ``train.tar`` with gradient accumulation (``train.batch_chunk``): the gradients of one big batch;
- locked dropout of the embeddings (``model.locked_dropout``, ``model.dropinp``): the masks drawn,
  against masks drawn by hand in the same RNG order;
- a CRTN stream continued from a saved state: an uninterrupted run and the naive reference
  (tests/reference.py).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch

from tests import reference
from tests.helpers import tiny_model
from tests.reference import NaiveCRTN
from tests.test_recipe_training import batches, make_trainer

V = 11
ATOL = 1e-9  # float64 values against the naive reference, as tests/test_crtn_reference.py


# ------------------------------------------------------------------ evaluation K/V in chunks
def _segments(tokens: torch.Tensor, L: int):
    for t in range((tokens.shape[1] - 1) // L):
        yield tokens[:, t * L : (t + 1) * L], tokens[:, t * L + 1 : (t + 1) * L + 1]


# ------------------------------------------------------------------ train.tar with batch_chunk
def _tar_run(tmp_path, chunks: int, beta: float, n_steps: int):
    """Train n_steps in float64 with train.batch_chunk=chunks; per step the trainer's gradients and
    those of a hand-written full-batch loss nll.mean() + beta mean((h_{t+1} - h_t)^2) computed with
    the same weights and a stream state carried by hand."""
    t = make_trainer(
        tmp_path / f"chunks{chunks}", **{"train.tar": beta, "optim.clip": 0.0, "train.batch_chunk": chunks}
    )
    t.model.double()  # in place: the optimizer keeps the same parameters
    t.start()
    ref, ref_state = copy.deepcopy(t.model), None
    grads, hand = [], []
    for batch in batches(t, n_steps):
        ref.load_state_dict(t.model.state_dict())
        ref.zero_grad()
        out = ref(batch.input, batch.target, ref_state)
        ref_state = out.state
        h = out.hidden
        (out.nll.mean() + beta * ((h[:, 1:] - h[:, :-1]) ** 2).mean()).backward()
        hand.append([p.grad.clone() for p in ref.parameters()])
        t.train_step(batch)
        grads.append([p.grad.clone() for p in t.model.parameters()])
    assert out.selection is not None  # the cache took part in the last steps
    return t, grads, hand


def test_tar_with_gradient_accumulation_equals_one_big_batch(tmp_path):
    """train.tar=2 with train.batch_chunk=2 against batch_chunk=1: the TAR mean over each chunk,
    divided by the chunks, is the big batch's mean (equal chunks), so the gradients of every step
    and the weights after them agree to 1e-10 (float64 model). Both match the hand-written full-batch
    loss to 1e-6 (the trainer takes the loss in float32)."""
    beta, n_steps = 2.0, 4
    big, g_big, hand = _tar_run(tmp_path, 1, beta, n_steps)
    chunked, g_chunked, _ = _tar_run(tmp_path, 2, beta, n_steps)
    names = [n for n, _ in big.model.named_parameters()]
    for step in range(n_steps):
        for name, a, b, r in zip(names, g_chunked[step], g_big[step], hand[step]):
            where = f"step {step} {name}"
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=lambda m, w=where: f"{w}: {m}")
            torch.testing.assert_close(b, r, rtol=0, atol=1e-6, msg=lambda m, w=where: f"{w}: {m}")
    for (name, a), b in zip(chunked.model.named_parameters(), big.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=name)


# ------------------------------------------------------------------ locked dropout of the embeddings
class _MaskedWords:
    """``model`` for tests/reference.py naive_segment, its word embeddings multiplied by ``mask`` [1, d]."""

    def __init__(self, model, mask: torch.Tensor):
        self._model, self._mask = model, mask

    def __getattr__(self, name):
        return getattr(self._model, name)

    def word_emb(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._model.word_emb(tokens) * self._mask


def test_locked_dropinp_masks_of_position_table_and_words(monkeypatch):
    """model.locked_dropout with model.dropinp=0.5 (the CRTN authors' recipe, xyz961014/longterm,
    their ``dropinp``: variational dropout on the position embeddings, then on the word embeddings).

    Hand-written expectation, masks drawn in that order from the same seed: the position table
    [K, d] gets one mask [1, d], the same for every distance (and, the table having no batch axis,
    for every stream); the word embeddings [B, L, d] one mask [B, 1, d], the same at every position
    of a stream and drawn per stream. The naive per-token Transformer-XL (tests/reference.py), fed
    the masked word embeddings and sinusoids, gives the training model's NLL at every step (memory
    holding the masked states of the step before)."""
    p, B, steps = 0.5, 2, 3
    model = tiny_model(V, **{"model.name": "txl", "model.locked_dropout": True, "model.dropinp": p}).train()
    L, d = model.tgt_len, model.d_model
    tokens = torch.randint(0, V, (B, steps * L + 1))
    sinusoid = reference.sinusoid
    state, mems = None, [None] * B
    for t, (x, y) in enumerate(_segments(tokens, L)):
        torch.manual_seed(1000 + t)
        pos_mask = torch.empty(1, d, dtype=torch.float64).bernoulli_(1 - p) / (1 - p)
        word_mask = torch.empty(B, 1, d, dtype=torch.float64).bernoulli_(1 - p) / (1 - p)
        assert 0 < int((pos_mask == 0).sum()) < d and not torch.equal(word_mask[0], word_mask[1])
        torch.manual_seed(1000 + t)
        with torch.no_grad():
            out = model(x, y, state)
        state = out.state
        monkeypatch.setattr(reference, "sinusoid", lambda dist, dd, m=pos_mask: sinusoid(dist, dd) * m)
        for b in range(B):
            with torch.no_grad():
                hs = reference.naive_segment(_MaskedWords(model, word_mask[b]), x[b], mems[b], t * L)
                nll = -model.crit.log_prob(hs[-1]).gather(-1, y[b][:, None])[:, 0]
            torch.testing.assert_close(out.nll[b], nll, rtol=0, atol=ATOL)
            cat = hs if mems[b] is None else [torch.cat([m, h]) for m, h in zip(mems[b], hs)]
            mems[b] = [c[-model.mem_len :] for c in cat]


# ------------------------------------------------------------------ a CRTN stream after a saved state
def _roundtrip(sd):
    """A checkpoint's trip through torch.save / torch.load (no tensor shared with the live state)."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize(
    "variant",
    [{}, {"cache.top_k": 1, "query.strategy": "middle_l", "summary.name": "mean"}],
    ids=["token-k2", "middle_l-k1"],
)
def test_crtn_continues_after_a_saved_state_as_uninterrupted(variant):
    """3 slots and k < 3, the cache evicting after the load. A run saved after 5 steps
    (CRTNState.state_dict through torch.save, rebuilt by CRTN.load_state, SegmentCache.load_state_dict)
    and continued gives the uninterrupted run's NLL, selections and slot positions exactly, and both
    agree with the naive reference (tests/reference.py); middle_l reads R_prev, which the state
    carries too."""
    model = tiny_model(V, **{"model.name": "crtn", "cache.n_slot": 3, **variant})
    B, L, steps, cut = 2, model.tgt_len, 10, 5
    tokens = torch.randint(0, V, (B, steps * L + 1))

    def run(state, segs):
        outs = []
        with torch.no_grad():
            for x, y in segs:
                out = model(x, y, state)
                state = out.state
                pos = state.cache.pos
                outs.append((out, None if pos is None else pos.clone()))
        return outs, state

    segs = list(_segments(tokens, L))
    full, _ = run(None, segs)
    head, state = run(None, segs[:cut])
    restored = model.load_state(_roundtrip(state.state_dict()), B, "cpu")
    tail, _ = run(restored, segs[cut:])
    refs = [NaiveCRTN(model) for _ in range(B)]
    evicted = 0
    for t, ((o_full, pos_full), (o, pos)) in enumerate(zip(full, head + tail)):
        assert torch.equal(o.nll, o_full.nll)
        assert (pos is None and pos_full is None) or torch.equal(pos, pos_full)
        if o.selection is None:
            assert o_full.selection is None
        else:
            assert torch.equal(o.selection.slot, o_full.selection.slot)
            assert torch.equal(o.selection.alpha, o_full.selection.alpha)
        x, y = segs[t]
        for b, ref in enumerate(refs):
            before = {s.pos for s in ref.row.slots}
            with torch.no_grad():
                nll_ref, sel_ref = ref.step(x[b], y[b], t * L)
            torch.testing.assert_close(o.nll[b], nll_ref, rtol=0, atol=ATOL)
            if o.selection is not None:
                assert (t * L - o.selection.age[b]).tolist() == [[p for p, _ in s] for s in sel_ref]
            evicted += t > cut and bool(before - {s.pos for s in ref.row.slots})
    assert evicted >= 3  # the restored cache evicts
