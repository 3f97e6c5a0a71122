"""Small builders shared by the tests."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from crtn.config import train_config
from crtn.model import TransformerLM, build_model, resolve_spec

#: Values the tests were written against where they differ from the schema's defaults (which
#: are the command line's since crtn.config became the one source of defaults).
#: The query: the CRTN paper's (the token's own state); crtn's default lookup has its own tests
#: (test_lookup.py, the lookup cases of test_crtn_reference.py and the causality tests).
#: The cache: the CRTN paper's (every layer retrieves, alpha over every slot, k 2 in TINY), the general
#: path with alpha below 1 and its gradient; crtn's default cache has its own reference tests.
#: The cache holds the states in their own dtype, so that float64 models meet their float64
#: references; crtn's default bfloat16 storage has its own tests (test_rowmatch.py, test_cache.py).
TEST_DEFAULTS = {
    "query.strategy": "token",
    "summary.name": "last_state",
    "cache.layers": None,
    "cache.alpha_norm": "all",
    "cache.dtype": None,
}
#: the repository's root
ROOT = Path(__file__).resolve().parents[1]
#: The synthetic corpus the data tests were written against (data.synthetic.* differing from the schema).
TEST_SYNTHETIC = {"vocab_size": 128, "max_gap": 320, "train_tokens": 1_000_000}


#: The tiny model of the unit tests (dotted keys over the schema).
TINY = {
    "model.n_layer": 2,
    "model.n_head": 2,
    "model.d_model": 8,
    "model.d_head": 4,
    "model.d_inner": 16,
    "model.tgt_len": 3,
    "model.mem_len": 3,
    "model.dropout": 0.0,
    "model.dropatt": 0.0,
    "model.init_std": 0.3,
    "model.proj_init_std": 0.3,
    "cache.n_slot": 3,
    "cache.top_k": 2,
}


#: the overrides a query=lookup model needs beyond the tiny one: one row per token at alpha 1
LOOKUP = {
    "query.strategy": "lookup",
    "summary.name": "token_max",
    "cache.top_k": 1,
    "cache.alpha_norm": "topk",
}


def tiny_cfg(**overrides: Any):
    """A ``crtn-train`` config with a tiny model; ``overrides`` are dotted keys, e.g. ``model.n_layer=2``.

    Built like the benchmark's configs: :func:`crtn.config.train_config` (the schema) with
    explicit overrides (:data:`TINY`, :data:`TEST_DEFAULTS`, then ``overrides``).
    """
    return train_config({**TINY, **TEST_DEFAULTS, **overrides})


@functools.cache
def _tiny_spec(items: tuple[tuple[str, Any], ...]):
    """The resolved (frozen) spec of ``tiny_cfg(**dict(items))``, once per process: composing the
    schema node costs tens of milliseconds, and hundreds of tests build the same few models."""
    return resolve_spec(tiny_cfg(**dict(items)))


def tiny_spec(**overrides: Any):
    """``resolve_spec(tiny_cfg(**overrides))``; the same frozen object for the same overrides."""
    items = tuple(overrides.items())
    try:
        hash(items)
    except TypeError:  # a list value: resolved each time
        return resolve_spec(tiny_cfg(**overrides))
    return _tiny_spec(items)


def tiny_model(n_token: int = 11, double: bool = True, **overrides: Any) -> TransformerLM:
    """A tiny model in eval mode (float64 by default), with non-trivial LayerNorm and bias values."""
    import torch

    model = build_model(tiny_spec(**overrides), n_token)
    if double:
        model = model.double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


#: Under pytest-xdist, the folder that the workers of this test run share (set by the session
#: fixture ``_run_folder`` of tests/conftest.py); empty in a run of one process.
RUN_FOLDER: dict[str, Path] = {}
_ONCE: dict[str, Any] = {}


def once_per_run(key: str, compute: Any) -> Any:
    """``compute()`` once per test run for ``key`` (a digest of everything the result depends on),
    for expensive read-only results such as naive references: kept in memory, and under
    pytest-xdist in a file of :data:`RUN_FOLDER` that the other worker loads instead of computing
    it again (written whole, then renamed; two workers that miss it at once both compute it)."""
    import torch

    if key not in _ONCE:
        folder = RUN_FOLDER.get("folder")
        path = None if folder is None else folder / f"{key}.pt"
        if path is not None and path.exists():
            _ONCE[key] = torch.load(path, weights_only=False)
        else:
            _ONCE[key] = compute()
            if path is not None:
                part = path.with_suffix(f".{os.getpid()}.part")
                torch.save(_ONCE[key], part)
                os.replace(part, path)
    return _ONCE[key]


# crtn-train overrides for a tiny model on a tiny synthetic corpus (CLI tests: a few seconds)
TINY_RUN = [
    "model.n_layer=1",
    "model.d_model=16",
    "model.n_head=2",
    "model.d_head=8",
    "model.d_inner=32",
    "model.tgt_len=8",
    "model.mem_len=8",
    "cache.n_slot=4",
    "data.batch_size=4",
    "data.eval_batch_size=4",
    "data.synthetic.vocab_size=24",
    "data.synthetic.branching=4",
    "data.synthetic.passage_len=4",
    "data.synthetic.doc_passages=16",
    "data.synthetic.min_gap=24",
    "data.synthetic.max_gap=40",
    "data.synthetic.train_tokens=4000",
    "data.synthetic.valid_tokens=1024",
    "data.synthetic.test_tokens=1024",
    "train.progress=false",
]


def cli(
    module: str, args: list[str], cwd: Path, timeout: float = 240, env: dict | None = None, **kw: Any
) -> subprocess.CompletedProcess:
    """Run ``python -m module args`` (a crtn entry point) in ``cwd``; one thread, Agg plots."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@functools.cache
def register_configs_once() -> None:
    """:func:`crtn.app_config.register_configs` once per process: it stores the same schema nodes
    each time (it is idempotent) and takes a sixth of a second."""
    from crtn.app_config import register_configs

    register_configs()


def compose_train(overrides: list[str]):
    """``crtn-train``'s config as its command line composes it from ``overrides`` (no Hydra run)."""
    from hydra import compose, initialize_config_module

    register_configs_once()
    with initialize_config_module("crtn.conf", version_base="1.3"):
        return compose("train", overrides=overrides)


def run_main(main: Any, prog: str, args: list[str], capfd: Any) -> tuple[int, str, str]:
    """Run a console entry point (``crtn.train.main``...) in this process with ``sys.argv`` =
    ``[prog, *args]``; returns (exit status, stdout, stderr) captured at the file descriptors."""
    import logging

    from hydra.core.global_hydra import GlobalHydra

    argv = sys.argv
    root = logging.getLogger()
    handlers = list(root.handlers)
    capfd.readouterr()
    code = 0
    sys.argv = [prog, *args]
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
        GlobalHydra.instance().clear()
        for h in list(root.handlers):  # Hydra's handlers of this run (its log file...)
            if h not in handlers:
                root.removeHandler(h)
                h.close()
    out, err = capfd.readouterr()
    return code, out, err


def load_tool(name: str, monkeypatch: Any = None) -> Any:
    """The module of ``tools/NAME.py`` (the tools are scripts, not a package). With a pytest
    ``monkeypatch`` it is registered in ``sys.modules`` for the test's duration, as a tool whose
    dataclasses look their module up needs."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
