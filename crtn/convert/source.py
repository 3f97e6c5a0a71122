"""What ``crtn-convert`` reads, before conversion: :class:`Source`, and the helpers the
Hugging Face and release readers share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from crtn.errors import UserError


class ConversionError(UserError):
    """A source that cannot be converted; the message (one line) names the tensor, key or file."""


@dataclass
class Source:
    """Weights and what is known about them, before conversion.

    Attributes:
        kind: ``"hf"`` or ``"release"``.
        path: the file or folder read.
        tensors: release/crtn parameter names (no ``transformer.`` prefix) -> tensor,
            softmax clusters in the release's order.
        names: crtn name -> name in the source file (for messages).
        hparams: crtn ``ModelSpec`` keys known from the source's config or attributes.
        n_token: vocabulary size stated by the source, or None.
    """

    kind: str
    path: Path
    tensors: dict[str, torch.Tensor]
    names: dict[str, str]
    hparams: dict[str, Any] = field(default_factory=dict)
    n_token: int | None = None

    def name(self, key: str) -> str:
        """The source's own name of crtn tensor ``key`` (present or expected)."""
        if key in self.names:
            return self.names[key]
        if self.kind == "hf" and not key.startswith("crit."):
            return "transformer." + key
        return key


def load_weights_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        return load_file(str(path))
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ConversionError(f"{str(path)!r} cannot be read as a torch file ({first_line(e)})") from None
    if not isinstance(sd, dict):
        raise ConversionError(f"{str(path)!r} does not hold a state_dict (got {type(sd).__name__})")
    return sd


def check_supported(attn_type: Any, sample_softmax: Any, where: str) -> None:
    if attn_type is not None and attn_type != 0:
        raise ConversionError(
            f"{where}: attn_type={attn_type} is not supported; crtn implements Transformer-XL's relative "
            "attention only (attn_type=0)"
        )
    if sample_softmax is not None and sample_softmax > 0:
        raise ConversionError(
            f"{where}: sample_softmax={sample_softmax} (a sampled softmax with out_layer) is not supported; "
            "crtn converts the adaptive softmax (sample_softmax <= 0) only"
        )


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def require(src: Source, key: str) -> torch.Tensor:
    if key not in src.tensors:
        raise ConversionError(f"missing tensor {src.name(key)!r} in {str(src.path)!r}")
    return src.tensors[key]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a, b)
