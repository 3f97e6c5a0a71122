"""Generation: incremental decoding with memory and cache equals re-evaluating the text so far;
seeds; text <-> ids; the crtn-generate CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf

from crtn.checkpoint import save_checkpoint
from crtn.errors import UserError
from crtn.generate import IncrementalLM, decode, encode_prompt, generate, sample_next, text_mode
from tests.helpers import tiny_cfg, tiny_model

N_TOKEN = 11
PROMPT = [1, 4, 2, 7]  # 4 tokens: one full segment of 3 and a partial one
MODELS = {
    "txl": {"model.name": "txl"},
    "crtn_token": {},
    "crtn_linear": {"query.strategy": "linear", "summary.name": "linear", "summary.d_key": 6},
    "crtn_mem0": {"model.mem_len": 0, "query.strategy": "last_l", "summary.name": "mean"},
    "crtn_gate": {"query.strategy": "gate", "summary.name": "token_max", "summary.ngram": 2},
}


def reevaluate(model, ids: list[int]) -> torch.Tensor:
    """Next-token log-distribution after ``ids``: the whole text from a fresh state, in segments of
    tgt_len from its first token (the last one partial), as evaluation would cut it."""
    state, L = None, model.tgt_len
    with torch.no_grad():
        for s in range(0, len(ids), L):
            out = model(torch.tensor([ids[s : s + L]]), state=state)
            state = out.state
        return model.crit.log_prob(out.hidden[0, -1])


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_equals_argmax_of_reevaluation(name):
    torch.manual_seed(0)
    model = tiny_model(N_TOKEN, **MODELS[name])  # float64, tgt_len=3, mem_len=3, n_slot=3, top_k=2
    lm = IncrementalLM(model)
    n_new = 14
    new = generate(model, PROMPT, n_new, temperature=0.0, lm=lm)
    assert len(new) == n_new
    for n in range(n_new):
        ref = reevaluate(model, PROMPT + new[:n])
        assert int(ref.argmax()) == new[n], f"token {n}"
    # one forward per new token (the prompt: one committed segment, one partial run)
    assert lm.n_forward == 2 + n_new - 1
    text = PROMPT + new
    assert len(lm.partial) == (len(text) - 1) % 3 and lm.state.pos == (len(text) - 1) // 3 * 3
    if name.startswith("crtn"):
        cache = lm.state.cache
        assert cache is not None and cache.n_valid == cache.n_slot == 3  # it filled during generation
        assert (cache.pos[0] >= 0).all()


@pytest.mark.parametrize("name", ["crtn_token", "crtn_linear"])
def test_incremental_distribution_equals_reevaluation(name):
    """Not just the argmax: every next-token distribution matches, token by token."""
    torch.manual_seed(1)
    model = tiny_model(N_TOKEN, **MODELS[name])
    lm = IncrementalLM(model)
    g = torch.Generator().manual_seed(0)
    ids = list(PROMPT)
    lp = lm.feed(ids)
    worst = 0.0
    for _ in range(12):
        worst = max(worst, (lp.double() - reevaluate(model, ids).float().double()).abs().max().item())
        token = sample_next(lp, 1.0, 0, g)
        ids.append(token)
        lp = lm.feed([token])
    assert worst < 1e-6  # IncrementalLM returns float32 distributions


def test_same_seed_same_text_and_sampling_options():
    model = tiny_model(N_TOKEN, double=False)

    def run(seed, **kw):
        return generate(model, PROMPT, 25, generator=torch.Generator().manual_seed(seed), **kw)

    a, b, c = run(0), run(0), run(1)
    assert a == b and a != c
    greedy = generate(model, PROMPT, 25, temperature=0.0)
    assert run(3, temperature=1.0, top_k=1) == greedy  # top-1 sampling is greedy
    assert run(4, temperature=0.0) == greedy  # temperature 0 draws nothing
    lp = torch.log_softmax(torch.tensor([0.0, 3.0, 2.9, -1.0, 2.8]), -1)
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(lp, 1.0, 2, g) for _ in range(200)}
    assert draws == {1, 2}  # top_k=2 keeps the two most likely tokens only
    with pytest.raises(ValueError):
        sample_next(lp, -1.0)
    with pytest.raises(ValueError):
        generate(model, [], 3)


def test_text_to_ids_and_back():
    words = ["<eos>", "<unk>", "the", "cat", "sat"]
    assert encode_prompt("the cat <eos> sat dog", words) == [2, 3, 0, 4, 1]
    assert encode_prompt("the cat\nsat dog\n", words) == [2, 3, 0, 4, 1, 0]  # line breaks are <eos>
    assert decode([2, 3, 0, 4, 1], words) == "the cat\nsat <unk>"
    with pytest.raises(UserError, match=r"prompt symbol 'dog' is not in the vocabulary") as e:
        encode_prompt("the dog", ["<eos>", "the"])
    assert "\n" not in str(e.value)
    chars = ["a", "b", " ", "\n"]
    mode = text_mode(chars, "char", "text")
    assert mode == "chars" and encode_prompt("ab b\n", chars, mode) == [0, 1, 2, 1, 3]
    assert decode([0, 2, 1, 3], chars, mode) == "a b\n"
    byte_syms = [chr(b) for b in "hé".encode()]
    mode = text_mode(byte_syms, "char", "enwik8")
    assert mode == "bytes" and decode(encode_prompt("hé", byte_syms, mode), byte_syms, mode) == "hé"
    assert text_mode(["72", "101"], "char", "enwik8") == "words"  # the release's preprocessed layout


# ---------------------------------------------------------------------------- CLI
SYMBOLS = ["<eos>", "<unk>"] + [f"w{i}" for i in range(N_TOKEN - 2)]


def test_crtn_generate_cli(tmp_path):
    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = tiny_model(N_TOKEN, double=False)
    ckpt = tmp_path / "model.pt"
    save_checkpoint(
        ckpt,
        {"config": OmegaConf.to_container(cfg, resolve=True), "vocab": SYMBOLS, "model": model.state_dict()},
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    base = [f"checkpoint={ckpt}", "prompt=w1 w2 zz w3", "max_new_tokens=20", "top_k=5"]
    runs = {
        "a": [*base, "seed=7", f"out={tmp_path / 'a.json'}"],
        "b": [*base, "seed=7"],
        "c": [*base, "seed=8"],
        "bad": [f"checkpoint={ckpt}", "temperature=-1"],
    }
    procs = {
        k: subprocess.Popen(
            [sys.executable, "-m", "crtn.generate", *args],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k, args in runs.items()
    }
    out = {k: (p.communicate(timeout=240), p.returncode) for k, p in procs.items()}
    for k in "abc":
        (stdout, stderr), rc = out[k]
        assert rc == 0, stderr
        assert stdout.startswith("w1 w2 <unk> w3")  # the unknown symbol maps to <unk>
        assert "cache 3/3 slots filled" in stderr
    assert out["a"][0][0] == out["b"][0][0] != out["c"][0][0]
    record = json.loads((tmp_path / "a.json").read_text())
    assert record["prompt_ids"] == [3, 4, 1, 5] and len(record["new_ids"]) == 20
    assert record["text"] + "\n" == out["a"][0][0]
    (stdout, stderr), rc = out["bad"]
    assert rc == 2 and stderr.strip() == "crtn-generate: error: temperature=-1.0 must be >= 0 (0: greedy)"
    assert not list(tmp_path.glob("*.log")) and not (tmp_path / "outputs").exists()
    # the library gives the same text for the same seed
    new = generate(model, [3, 4, 1, 5], 20, 1.0, 5, torch.Generator().manual_seed(7))
    assert new == record["new_ids"]
