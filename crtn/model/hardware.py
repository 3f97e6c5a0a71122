"""Which 16-bit matrix products a device runs natively (docs/method.md §3, "The products' dtype").

The cache stores its rows in bfloat16 (``cache.dtype``), and by default the products with them
run in the dtype they are stored in, as bfloat16 autocast runs them. That pays only where the
device has 16-bit matrix units: a GPU, or a CPU with AVX512-BF16 or AMX. A CPU without them
(AVX2 only) runs a bfloat16 matrix product through a generic kernel, at the standard sizes
up to 30x slower than float32's (docs/results.md, "Products on a CPU without bfloat16
instructions"); there the products run in float32, the rows cast up a chunk at a time.
"""

from __future__ import annotations

import functools

import torch

#: the CPU features (``torch._C._cpu._get_cpu_capability()``) that multiply each 16-bit dtype
#: natively; a CPU that reports none of them (x86 without them, or another architecture) runs
#: these products in float32
CPU_UNITS = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16"),
}


@functools.cache
def cpu_features() -> dict[str, object]:
    """The features torch detected on this machine's CPU (cached: read once per process); empty
    where this torch build cannot report them (its products then run in float32 on the CPU)."""
    try:
        return dict(torch._C._cpu._get_cpu_capability())
    except (AttributeError, RuntimeError):
        return {}


def multiplies_natively(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``device`` runs matrix products in ``dtype`` at least about as fast as in float32:
    True for every dtype wider than 16 bits and off the CPU; on a CPU, for a 16-bit dtype,
    whether it reports one of its :data:`CPU_UNITS`."""
    if dtype.itemsize != 2 or device.type != "cpu":
        return True
    features = cpu_features()
    return any(bool(features.get(name)) for name in CPU_UNITS.get(dtype, ()))
