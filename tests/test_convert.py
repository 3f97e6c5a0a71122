"""crtn-convert against the references: Hugging Face transformers 4.35's Transformer-XL, and
release-format checkpoints derived from it (the release's own code is not used).

transformers is a test-only dependency (the ``test`` extra); it is imported at module level so
that these tests fail, never skip, when it is missing.

Two details of HF 4.35 matter for an exact float64 comparison:

- its attention casts the masked scores to float32 (``attn_score.float().masked_fill(mask,
  torch.finfo(attn_score.dtype).min)``), which in float64 raises "value cannot be converted to
  type float without overflow"; :func:`hf_float64_attention` runs HF's own forward with that cast
  removed (a source-level patch of one expression, nothing else changes);
- with ``mems=None`` HF starts from ``mem_len`` zero vectors (``init_mems``), the release and crtn
  from an empty memory: the reference passes empty ``mems``.

HF also stores the sinusoid frequencies ``inv_freq`` as a float32 buffer, crtn computes them in
float64; the comparison is made both with HF as saved and with HF's frequencies recomputed in
float64 (which isolates that rounding).
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (test dependency: fail, do not skip, when missing)
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file
from transformers import TransfoXLConfig, TransfoXLLMHeadModel
from transformers.models.transfo_xl import modeling_transfo_xl

from crtn.checkpoint import checkpoint_spec as checkpoint_config
from crtn.checkpoint import load_checkpoint
from crtn.convert import ConversionError, convert, infer_hparams, read_source, resolve_hparams
from crtn.model import build_model, resolve_spec
from crtn.model.adaptive import flip_cluster_order

V, B, L, MEM = 50, 2, 8, 8  # vocabulary, streams, segment length, memory
TINY = dict(d_model=16, n_head=2, d_head=8, d_inner=32, n_layer=2, mem_len=MEM, dropout=0.0, dropatt=0.0)

# name -> (TransfoXLConfig overrides, save_pretrained(safe_serialization=...))
VARIANTS = {
    "softmax": (dict(cutoffs=[], div_val=1, d_embed=16, untie_r=True, same_length=False, clamp_len=-1), True),
    "softmax_shared_proj": (
        dict(
            cutoffs=[],
            div_val=1,
            d_embed=12,
            untie_r=False,
            tie_word_embeddings=False,
            same_length=True,
            clamp_len=5,
        ),
        False,  # pytorch_model.bin: keeps tied and shared duplicates
    ),
    "adaptive": (
        dict(cutoffs=[10, 30], div_val=2, d_embed=16, untie_r=True, same_length=False, clamp_len=-1),
        True,
    ),
    "adaptive_div1_shared": (
        dict(
            cutoffs=[10, 30],
            div_val=1,
            d_embed=12,
            untie_r=False,
            proj_share_all_but_first=False,
            same_length=True,
            clamp_len=6,
        ),
        True,
    ),
}


def make_hf(seed: int = 0, vocab_size: int = V, **overrides) -> TransfoXLLMHeadModel:
    """A randomly initialised tiny TransfoXLLMHeadModel with non-trivial biases and LayerNorms."""
    torch.manual_seed(seed)
    config = TransfoXLConfig(vocab_size=vocab_size, **{**TINY, **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = TransfoXLLMHeadModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layer_norm.weight" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


def popen(module: str, args: list[str], cwd: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def error_lines(p) -> list[str]:
    return [line for line in p.stderr.splitlines() if line.strip() and "HYDRA_FULL_ERROR" not in line]


@contextmanager
def hf_float64_attention():
    """HF 4.35's RelPartialLearnableMultiHeadAttn.forward without its float32 cast of the masked scores."""
    cls = modeling_transfo_xl.RelPartialLearnableMultiHeadAttn
    original = cls.forward
    src = textwrap.dedent(inspect.getsource(original))
    assert src.count("attn_score.float()") == 2, "HF's attention changed; revisit the float64 patch"
    namespace: dict = {}
    exec(compile(src.replace("attn_score.float()", "attn_score"), modeling_transfo_xl.__file__, "exec"),
         modeling_transfo_xl.__dict__, namespace)  # fmt: skip
    cls.forward = namespace["forward"]
    try:
        yield
    finally:
        cls.forward = original


def load_crtn(path: Path):
    """The model of a crtn checkpoint, float64, eval mode."""
    ckpt = load_checkpoint(path)
    cfg = checkpoint_config(ckpt)
    state = ckpt["model"]
    n_token = sum(
        v.numel() for k, v in state.items() if k.startswith("crit.out_layers.") and k.endswith(".bias")
    )
    model = build_model(cfg, n_token)
    model.load_state_dict(state)
    return model.double().eval(), ckpt


def max_logprob_diff(
    hf: TransfoXLLMHeadModel, model, tokens: torch.Tensor, exact_freq: bool = False
) -> float:
    """max |log p_crtn - log p_HF| over consecutive segments of ``tokens`` [B, n*L] with memory, float64."""
    hf = hf.double().eval()
    if exact_freq:
        d = hf.config.d_model
        hf.transformer.pos_emb.inv_freq.copy_(
            1.0 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
        )
    n_layer, d_model = hf.config.n_layer, hf.config.d_model
    mems = [torch.empty(0, tokens.shape[0], d_model, dtype=torch.float64) for _ in range(n_layer)]
    state, worst = None, 0.0
    with torch.no_grad(), hf_float64_attention():
        for s in range(0, tokens.shape[1], L):
            seg = tokens[:, s : s + L]
            ref = hf(input_ids=seg, mems=mems)
            mems = ref.mems
            out = model(seg, state=state)
            state = out.state
            ours = model.crit.log_prob(out.hidden)
            assert torch.allclose(ours.exp().sum(-1), torch.ones((), dtype=torch.float64))
            worst = max(worst, (ours - ref.prediction_scores).abs().max().item())
    return worst


def tokens_3seg(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, 3 * L), generator=g)


# ---------------------------------------------------------------------------- sources
def release_state_dict(hf: TransfoXLLMHeadModel) -> dict[str, torch.Tensor]:
    """What MemTransformerLM.state_dict() of the release holds for the same weights: no
    ``transformer.`` prefix, one shared pair of r_w_bias/r_r_bias (no per-layer copies), tied
    tensors under both names, the release's cluster order."""
    sd = {}
    for key, value in hf.state_dict().items():
        key = key.removeprefix("transformer.")
        if ".dec_attn.r_" in key and key.endswith("_bias"):
            continue  # HF registers the shared biases in every layer too; the release does not
        sd[key] = value.detach().clone()
    return flip_cluster_order(sd, "crit.")


RELEASE = dict(cutoffs=[10, 30], div_val=2, d_embed=16, untie_r=False, same_length=True, clamp_len=6)
RELEASE_FLAGS = [f"model.tgt_len={L}", f"model.mem_len={MEM}", "model.same_length=true", "model.clamp_len=6"]
RELEASE_ATTRS = dict(
    n_token=V, n_layer=2, n_head=2, d_model=16, d_head=8, d_embed=16, tgt_len=L, mem_len=MEM, ext_len=0,
    same_length=True, clamp_len=6, attn_type=0, sample_softmax=-1,
)  # fmt: skip

MODULE_SRC = '''
"""Stand-in for the release's pytorch/mem_transformer.py: a MemTransformerLM-shaped module."""
import torch
from torch import nn


class MemTransformerLM(nn.Module):
    def __init__(self, state_dict, **attrs):
        super().__init__()
        for key, value in attrs.items():
            setattr(self, key, value)
        self.drop = nn.Dropout(0.0)
        for key, value in state_dict.items():
            *path, leaf = key.split(".")
            mod = self
            for part, after in zip(path, path[1:] + [leaf]):
                if part not in mod._modules:
                    mod.add_module(part, nn.ModuleList() if after.isdigit() else nn.Module())
                mod = mod._modules[part]
            if leaf == "inv_freq":
                mod.register_buffer(leaf, value.clone())
            else:
                mod.register_parameter(leaf, nn.Parameter(value.clone()))
        self.layers[0].dec_attn.pre_lnorm = False
'''

CLI_VARIANTS = ("softmax", "adaptive")  # through the crtn-convert CLI; the others through convert()


def _text_corpus(root: Path) -> dict:
    """A small word-level corpus (41 symbols) and its data node."""
    import random

    rng = random.Random(0)
    words = [f"w{i}" for i in range(40)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(240)]
    (root / "corpus.txt").write_text("\n".join(lines) + "\n")
    return {
        "name": "text",
        "path": str(root / "corpus.txt"),
        "level": "word",
        "split": [0.8, 0.1, 0.1],
        "cache_dir": str(root / "cache"),
        "batch_size": 2,
        "eval_batch_size": 2,
    }


def _data_args(data: dict) -> list[str]:
    return [
        "data=text",
        f"data.path={data['path']}",
        "data.level=word",
        "data.split=[0.8,0.1,0.1]",
        f"data.cache_dir={data['cache_dir']}",
        "data.batch_size=2",
        "data.eval_batch_size=2",
    ]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every source, converted; the CLI runs (conversion, fine-tuning, evaluation) go in parallel."""
    from crtn.data import load_corpus

    root = tmp_path_factory.mktemp("convert")
    runs, res = {}, {"root": root}

    # a Transformer-XL for a real (tiny) corpus, converted with its vocabulary: fine-tune and evaluate it
    data = _text_corpus(root)
    symbols = load_corpus(data).vocab.idx2sym
    (root / "vocab.txt").write_text("\n".join(symbols) + "\n")
    hf_text = make_hf(seed=7, vocab_size=len(symbols), cutoffs=[10, 20], div_val=2, untie_r=False)
    hf_text.save_pretrained(root / "hf_text")
    ft = root / "ft_out"
    convert(root / "hf_text", ft, vocab=root / "vocab.txt", data=data, model={"tgt_len": L})
    res["text"] = (hf_text, ft, data, symbols)
    runs["train"] = popen(
        "crtn.train",
        [
            "--config-dir",
            str(ft),
            "model=converted",
            "model.name=crtn",
            f"init_from={ft / 'model.pt'}",
            *_data_args(data),
            "summary=linear",
            "query=linear",
            "cache.n_slot=2",
            "train.max_step=2",
            "train.log_interval=1",
            "train.eval_interval=100",
            "train.progress=false",
            f"hydra.run.dir={root / 'ft_run'}",
        ],
        root,
    )
    runs["eval"] = popen(
        "crtn.eval_app",
        [f"checkpoint={ft / 'model.pt'}", "splits=[test]", "progress=false", f"hydra.run.dir={root / 'ev'}"],
        root,
    )

    # Hugging Face folders
    for name, (overrides, safe) in VARIANTS.items():
        hf = make_hf(**overrides)
        hf.save_pretrained(root / name, safe_serialization=safe)
        res[name] = (hf, root / f"{name}_out")
        if name in CLI_VARIANTS:
            args = [f"src={root / name}", f"out={root / (name + '_out')}", f"model.tgt_len={L}"]
            runs[name] = popen("crtn.convert", args, root)

    # release: a state_dict (sizes inferred from shapes) and a whole pickled module
    hf = make_hf(seed=3, **RELEASE)
    torch.save(release_state_dict(hf), root / "release_sd.pt")
    res["release_sd"] = (hf, root / "release_sd.pt", root / "release_sd_out")
    runs["release_sd"] = popen(
        "crtn.convert",
        [f"src={root / 'release_sd.pt'}", f"out={root / 'release_sd_out'}", *RELEASE_FLAGS],
        root,
    )
    code = root / "release_code"
    code.mkdir()
    (code / "mem_transformer.py").write_text(MODULE_SRC)
    sys.path.insert(0, str(code))
    try:
        import mem_transformer

        hf = make_hf(seed=5, **RELEASE)
        torch.save(
            mem_transformer.MemTransformerLM(release_state_dict(hf), **RELEASE_ATTRS), root / "pickled.pt"
        )
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("mem_transformer", None)
    res["pickled"] = (hf, root / "pickled.pt", code)
    runs["pickled"] = popen(
        "crtn.convert", [f"src={root / 'pickled.pt'}", f"out={root / 'pickled_out'}"], root
    )

    for name in VARIANTS:
        if name not in CLI_VARIANTS:
            convert(root / name, root / f"{name}_out", model={"tgt_len": L})
    for name, p in runs.items():
        out, err = p.communicate(timeout=300)
        res[f"cli_{name}"] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return res


# ---------------------------------------------------------------------------- HF reference
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_conversion_matches_transformers_log_probs(converted, variant):
    hf, out = converted[variant]
    if variant in CLI_VARIANTS:
        p = converted[f"cli_{variant}"]
        assert p.returncode == 0, p.stderr
        assert f"wrote {out / 'model.pt'}" in p.stdout and "model=converted" in p.stdout
        assert (out / "convert.log").is_file()
    assert (out / "model.pt").is_file() and (out / "model" / "converted.yaml").is_file()
    model, ckpt = load_crtn(out / "model.pt")
    overrides, _ = VARIANTS[variant]
    m = ckpt["config"]["model"]
    assert m["name"] == "txl" and m["tgt_len"] == L and m["mem_len"] == MEM
    assert m["cutoffs"] == overrides["cutoffs"] and m["div_val"] == overrides["div_val"]
    assert m["untie_r"] == overrides["untie_r"] and m["same_length"] == overrides["same_length"]
    assert m["clamp_len"] == overrides["clamp_len"]
    assert m["tie_weight"] == overrides.get("tie_word_embeddings", True)
    assert OmegaConf.to_container(OmegaConf.load(out / "model" / "converted.yaml")) == m

    x = tokens_3seg()
    diff = max_logprob_diff(hf, model, x)
    diff_exact = max_logprob_diff(make_hf(**overrides), model, x, exact_freq=True)
    print(f"\n{variant}: max |dlogp| vs HF 4.35 (float64, 3 segments with memory) = {diff:.3g}; "
          f"with HF's float32 inv_freq recomputed in float64: {diff_exact:.3g}")  # fmt: skip
    assert diff < 1e-5
    assert diff_exact < 1e-10


def test_hf_tied_weights_are_tied_in_crtn(converted):
    """Tying survives conversion: crtn ties what HF tied (and keeps separate what it did not)."""
    model, _ = load_crtn(converted["adaptive"][1] / "model.pt")
    assert model.crit.out_layers[1].weight is model.word_emb.emb_layers[1].weight
    assert model.crit.out_projs[1] is model.word_emb.emb_projs[1]
    assert model.crit.out_projs[0] is not model.word_emb.emb_projs[0]
    model, _ = load_crtn(converted["softmax_shared_proj"][1] / "model.pt")
    assert model.crit.out_layers[0].weight is not model.word_emb.emb_layers[0].weight


# ---------------------------------------------------------------------------- release format
def test_release_state_dict_infers_sizes_and_matches(converted):
    hf, path, out = converted["release_sd"]
    hp = infer_hparams(read_source(path))
    assert hp == {
        "d_embed": 16,
        "div_val": 2,
        "cutoffs": [10, 30],
        "n_token": V,
        "n_layer": 2,
        "d_model": 16,
        "d_inner": 32,
        "untie_r": False,
        "n_head": 2,
        "d_head": 8,
        "tie_weight": True,
        "tie_projs": [False, True, True],
    }
    p = converted["cli_release_sd"]
    assert p.returncode == 0, p.stderr
    model, _ = load_crtn(out / "model.pt")
    diff = max_logprob_diff(hf, model, tokens_3seg(2))
    diff_exact = max_logprob_diff(make_hf(seed=3, **RELEASE), model, tokens_3seg(2), exact_freq=True)
    print(
        f"\nrelease state_dict: max |dlogp| vs HF 4.35 = {diff:.3g} (HF inv_freq in float64: {diff_exact:.3g})"
    )
    assert diff < 1e-5 and diff_exact < 1e-10
    # what cannot be read off the shapes is reported as assumed
    _, _, assumed = resolve_hparams(read_source(path), {"tgt_len": 8})
    assert "pre_lnorm" in assumed and "mem_len" in assumed and "tgt_len" not in assumed


def test_release_cutoffs_needed_when_div_val_1(tmp_path):
    hf = make_hf(seed=4, cutoffs=[10, 30], div_val=1, d_embed=12, untie_r=False)
    path = tmp_path / "sd.pt"
    torch.save(release_state_dict(hf), path)
    with pytest.raises(ConversionError, match=r"crit\.cluster_weight.*model\.cutoffs") as e:
        convert(path, tmp_path / "out")
    assert "\n" not in str(e.value)
    # HF's defaults: same_length=True, clamp_len=1000
    flags = {"cutoffs": [10, 30], "tgt_len": L, "mem_len": MEM, "same_length": True, "clamp_len": 1000}
    convert(path, tmp_path / "out", model=flags)
    model, _ = load_crtn(tmp_path / "out" / "model.pt")
    assert max_logprob_diff(hf, model, tokens_3seg(3)) < 1e-5


def test_release_whole_module_pickle(converted, tmp_path):
    """A pickled module is refused (one line) unless trust_pickle=true and its code is importable."""
    hf, path, code = converted["pickled"]
    p = converted["cli_pickled"]
    lines = error_lines(p)
    assert p.returncode == 2 and len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    msg = lines[0]
    assert msg.startswith("crtn-convert: error:") and "mem_transformer.MemTransformerLM" in msg
    assert "trust_pickle=true" in msg and "state_dict" in msg

    sys.modules.pop("mem_transformer", None)
    with pytest.raises(ConversionError, match=r"mem_transformer.*PYTHONPATH") as e:
        convert(path, tmp_path / "out", trust_pickle=True)  # the release's code is not importable
    assert "\n" not in str(e.value)

    sys.path.insert(0, str(code))
    try:
        convert(path, tmp_path / "out", trust_pickle=True)
    finally:
        sys.path.remove(str(code))
        sys.modules.pop("mem_transformer", None)
    model, ckpt = load_crtn(tmp_path / "out" / "model.pt")
    m = ckpt["config"]["model"]
    assert (m["tgt_len"], m["mem_len"], m["same_length"], m["clamp_len"]) == (L, MEM, True, 6)
    diff = max_logprob_diff(hf, model, tokens_3seg(4))
    print(f"\nrelease whole-module pickle: max |dlogp| vs HF 4.35 = {diff:.3g}")
    assert diff < 1e-5


# ---------------------------------------------------------------------------- errors
def _edit_hf(src: Path, dst: Path, config: dict | None = None, tensors=None) -> Path:
    shutil.copytree(src, dst)
    if config:
        c = json.loads((dst / "config.json").read_text())
        c.update(config)
        (dst / "config.json").write_text(json.dumps(c))
    if tensors:
        sd = load_file(str(dst / "model.safetensors"))
        tensors(sd)
        save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _one_line_error(src: Path, out: Path, **kw) -> str:
    with pytest.raises(ConversionError) as e:
        convert(src, out, **kw)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_errors_name_the_tensor_or_key(tmp_path):
    hf = make_hf(cutoffs=[10, 30], div_val=2, untie_r=True)
    base = tmp_path / "base"
    hf.save_pretrained(base)
    out = tmp_path / "out"

    def extra(sd):
        sd["transformer.layers.0.dec_attn.q_bias"] = torch.zeros(16)

    msg = _one_line_error(_edit_hf(base, tmp_path / "unknown", tensors=extra), out)
    assert "unknown tensor 'transformer.layers.0.dec_attn.q_bias'" in msg

    def drop(sd):
        del sd["transformer.layers.1.pos_ff.CoreNet.3.bias"]

    msg = _one_line_error(_edit_hf(base, tmp_path / "missing", tensors=drop), out)
    assert "missing tensor 'transformer.layers.1.pos_ff.CoreNet.3.bias'" in msg

    msg = _one_line_error(_edit_hf(base, tmp_path / "shape", config={"d_inner": 48}), out)
    assert (
        "tensor 'transformer.layers.0.pos_ff.CoreNet.0.weight' has shape (32, 16), expected (48, 16)" in msg
    )

    msg = _one_line_error(base, out, model={"n_head": 4, "d_head": 4})
    assert "r_w_bias' has shape (2, 8), expected (4, 4)" in msg

    msg = _one_line_error(_edit_hf(base, tmp_path / "attn1", config={"attn_type": 1}), out)
    assert "attn_type=1 is not supported" in msg

    msg = _one_line_error(_edit_hf(base, tmp_path / "sampled", config={"sample_softmax": 64}), out)
    assert "sample_softmax=64" in msg

    def mistie(sd):
        sd["crit.out_projs.2"] = torch.zeros_like(sd["transformer.word_emb.emb_projs.2"])

    msg = _one_line_error(_edit_hf(base, tmp_path / "mistie", tensors=mistie), out)
    assert "'crit.out_projs.2' differs from 'transformer.word_emb.emb_projs.2' but tie_projs[2]=true" in msg

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(f"w{i}" for i in range(V - 1)) + "\n")
    msg = _one_line_error(base, out, vocab=vocab)
    assert f"has {V - 1} symbols but the model has {V}" in msg

    # release: a state dict of another attention type; a source that does not exist
    path = tmp_path / "attn2.pt"
    torch.save({"word_emb.emb_layers.0.weight": torch.zeros(V, 16), "r_emb": torch.zeros(2, 8, 2, 8)}, path)
    msg = _one_line_error(path, out)
    assert "'r_emb'" in msg and "attn_type" in msg
    msg = _one_line_error(tmp_path / "nope", out)
    assert msg == f"src={str(tmp_path / 'nope')!r} does not exist"
    assert not (out / "model.pt").exists()


# ---------------------------------------------------------------------------- fine-tune
def test_converted_txl_evaluates_like_hf(converted):
    """crtn-eval on the converted checkpoint reports HF's own test loss on the same streams."""
    from crtn.data import load_corpus

    p = converted["cli_eval"]
    assert p.returncode == 0, p.stderr
    ev = json.loads((converted["root"] / "ev" / "eval.json").read_text())["test"]
    hf, _, data, _ = converted["text"]
    corpus = load_corpus(data)
    it = corpus.iterator("test", data["eval_batch_size"], L, drop_last=False)
    mems = [torch.empty(0, it.local_batch_size, 16) for _ in range(2)]
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in it.iterate(0):
            ref = hf(input_ids=batch.input, mems=mems)
            mems = ref.mems
            total -= ref.prediction_scores.gather(-1, batch.target[..., None]).double().sum().item()
            count += batch.target.numel()
    assert ev["tokens"] == count
    assert abs(ev["loss"] - total / count) < 1e-5, (ev["loss"], total / count)


def test_crtn_from_converted_txl_predicts_like_txl_before_training(converted):
    """model=crtn with n_slot=0, initialised like crtn-train init_from=..., equals the converted txl."""
    from dataclasses import replace
    from types import SimpleNamespace

    from crtn.checkpoint import init_from as _init_from

    _, out, _, symbols = converted["text"]
    ckpt = load_checkpoint(out / "model.pt")
    txl_cfg = checkpoint_config(ckpt)
    txl = build_model(txl_cfg, len(symbols)).eval()
    txl.load_state_dict(ckpt["model"])
    for query, summary in (("token", "last_state"), ("linear", "linear")):
        cfg = resolve_spec(
            replace(
                txl_cfg,
                model=replace(txl_cfg.model, name="crtn"),
                cache=replace(txl_cfg.cache, n_slot=0),
                query=replace(txl_cfg.query, strategy=query),
                summary=replace(txl_cfg.summary, name=summary),
            )
        )
        torch.manual_seed(0)
        crtn = build_model(cfg, len(symbols)).eval()
        _init_from(crtn, str(out / "model.pt"), SimpleNamespace(vocab=SimpleNamespace(idx2sym=symbols)))
        x = torch.randint(0, len(symbols), (2, 3 * L), generator=torch.Generator().manual_seed(0))
        s_txl = s_crtn = None
        with torch.no_grad():
            for s in range(0, 3 * L, L):
                a, b = txl(x[:, s : s + L], state=s_txl), crtn(x[:, s : s + L], state=s_crtn)
                s_txl, s_crtn = a.state, b.state
                assert torch.equal(txl.crit.log_prob(a.hidden), crtn.crit.log_prob(b.hidden))


def test_crtn_train_init_from_lists_fresh_parameters(converted):
    p = converted["cli_train"]
    assert p.returncode == 0, p.stderr
    run = converted["root"] / "ft_run"
    text = (run / "train.log").read_text()
    n = len(load_checkpoint(converted["text"][1] / "model.pt")["model"])
    assert f"init_from {converted['text'][1] / 'model.pt'}: loaded {n} tensors" in text
    fresh = next(line for line in text.splitlines() if "freshly initialised" in line)
    for name in (
        "summary.proj.weight",
        "summary.proj.bias",
        "query.seq_linear.weight",
        "query.seq_linear.bias",
    ):
        assert name in fresh
    assert "word_emb" not in fresh and "layers." not in fresh
    res = json.loads((run / "results.json").read_text())
    assert res["model"] == "crtn" and res["steps"] == 2
