"""Mapping a source's tensors onto the crtn Transformer-XL that the converted config describes."""

from __future__ import annotations

from typing import Any

import torch

from crtn.convert.source import ConversionError, Source, first_line, same
from crtn.errors import ConfigError
from crtn.model import TransformerLM, resolve_spec
from crtn.model.spec import ModelSpec, Spec


def convert_tensors(src: Source, cfg: dict[str, Any], n_token: int) -> dict[str, torch.Tensor]:
    """Map the source's tensors onto the crtn Transformer-XL that ``cfg`` describes.

    Returns:
        crtn state dict (every key of ``TransformerLM.state_dict()``, tied entries filled).

    Raises:
        ConversionError: unknown tensor, missing tensor, shape mismatch, inconsistent tying
            or shared biases, a non-standard ``pos_emb.inv_freq`` -- naming the tensor.
    """
    try:
        spec = resolve_spec(Spec(model=ModelSpec(**cfg)))
        mcfg = spec.model
        model = TransformerLM(n_token, spec)
    except (ConfigError, ValueError) as e:
        raise ConversionError(f"the converted config is invalid: {first_line(e)}") from None
    expected = model.state_dict()
    t = dict(src.tensors)
    _drop_inv_freq(src, t, mcfg.d_model)
    if not mcfg.untie_r:
        _merge_shared_biases(src, t, mcfg.n_layer)
    _fill_tied(src, t, model, mcfg)
    _check_names_and_shapes(src, t, expected, describe(mcfg, n_token))
    dtypes = {v.dtype for v in t.values() if v.is_floating_point()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    model = model.to(dtype)
    model.load_state_dict(t, strict=True)
    return {k: v.detach() for k, v in model.state_dict().items()}  # tied entries share storage


def _drop_inv_freq(src: Source, t: dict[str, torch.Tensor], d: int) -> None:
    """A buffer of the release/HF that crtn recomputes, the sinusoid frequencies: checked and dropped."""
    if "pos_emb.inv_freq" not in t:
        return
    inv = t.pop("pos_emb.inv_freq")
    ref = 1.0 / (10000 ** (torch.arange(0.0, d, 2.0, dtype=torch.float64) / d))
    if inv.shape != ref.shape:
        raise ConversionError(
            f"tensor {src.name('pos_emb.inv_freq')!r} has shape {tuple(inv.shape)}, expected "
            f"{tuple(ref.shape)} for d_model={d}"
        )
    if not torch.allclose(inv.double(), ref, rtol=1e-5, atol=0):
        raise ConversionError(
            f"tensor {src.name('pos_emb.inv_freq')!r} is not the standard sinusoid 1/10000^(2i/d_model); "
            "crtn cannot represent other positional frequencies"
        )


def _merge_shared_biases(src: Source, t: dict[str, torch.Tensor], n_layer: int) -> None:
    """Shared relative biases u, v: copies under layer names (HF registers them per layer too)."""
    for name in ("r_w_bias", "r_r_bias"):
        copies = [f"layers.{i}.dec_attn.{name}" for i in range(n_layer)]
        present = [c for c in copies if c in t]
        if name not in t and present:
            t[name] = t[present[0]]
        for c in present:
            if not same(t[c], t[name]):
                raise ConversionError(
                    f"tensor {src.name(c)!r} differs from {src.name(name)!r} but untie_r=false "
                    "(one shared pair of biases); set model.untie_r=true"
                )
            del t[c]


def _fill_tied(src: Source, t: dict[str, torch.Tensor], model: TransformerLM, mcfg: Any) -> None:
    """Tied output weights and projections: filled from the embeddings, or checked against them."""
    expected = model.state_dict()
    n_out = len(model.crit.out_layers)
    for i in range(n_out if mcfg.tie_weight else 0):
        out_k, emb_k = f"crit.out_layers.{i}.weight", f"word_emb.emb_layers.{i}.weight"
        if out_k not in t and emb_k in t:
            t[out_k] = t[emb_k]
        elif out_k in t and emb_k in t and not same(t[out_k], t[emb_k]):
            raise ConversionError(
                f"tensor {src.name(out_k)!r} differs from {src.name(emb_k)!r} but tie_weight=true "
                "(tie_word_embeddings); set model.tie_weight=false"
            )
    for i, tie in enumerate(model.tie_projs):
        out_k = f"crit.out_projs.{i}"
        if not tie or out_k not in expected:
            continue
        emb_k = "word_emb.emb_projs.0" if mcfg.div_val == 1 else f"word_emb.emb_projs.{i}"
        if out_k not in t and emb_k in t:
            t[out_k] = t[emb_k]
        elif out_k in t and emb_k in t and not same(t[out_k], t[emb_k]):
            raise ConversionError(
                f"tensor {src.name(out_k)!r} differs from {src.name(emb_k)!r} but tie_projs[{i}]=true; "
                f"set model.tie_projs (now {list(model.tie_projs)})"
            )


def _check_names_and_shapes(
    src: Source, t: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str
) -> None:
    """Every tensor known, none missing, every shape as the model's (``what`` describes the model)."""
    for key in t:
        if key not in expected:
            raise ConversionError(
                f"unknown tensor {src.name(key)!r} in {str(src.path)!r}: no such parameter in a Transformer-XL "
                f"with {what}"
            )
    for key, ref in expected.items():
        if key not in t:
            raise ConversionError(
                f"missing tensor {src.name(key)!r} in {str(src.path)!r} (needed by a Transformer-XL with {what})"
            )
        if tuple(t[key].shape) != tuple(ref.shape):
            raise ConversionError(
                f"tensor {src.name(key)!r} has shape {tuple(t[key].shape)}, expected {tuple(ref.shape)} for {what}"
            )


def describe(m: Any, n_token: int) -> str:
    return (
        f"n_layer={m.n_layer}, n_head={m.n_head}, d_head={m.d_head}, d_model={m.d_model}, "
        f"d_inner={m.d_inner}, d_embed={m.d_embed or m.d_model}, n_token={n_token}, "
        f"cutoffs={list(m.cutoffs)}, div_val={m.div_val}, untie_r={m.untie_r}"
    )
