"""Shared fixtures.

The real corpora (WikiText-2, Penn Treebank, Tiny Shakespeare) live outside the
repository. Tests find them through the environment variable ``CRTN_DATA``,
which ``.ci/run`` sets; when it is unset, ``../shared/data`` beside the checkout
is used if it exists. A test that needs them fails (never skips) when they are
missing, so a green run always means the real-data tests ran.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def _shared_data() -> Path | None:
    env = os.environ.get("CRTN_DATA")
    if env:
        return Path(env)
    default = REPO.parent / "shared" / "data"
    return default if default.is_dir() else None


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Folder holding ``wikitext-2/``, ``penn/`` and ``shakespeare/`` (fails if missing)."""
    path = _shared_data()
    if path is None or not path.is_dir():
        pytest.fail(
            "real corpora not found: set CRTN_DATA to a folder with wikitext-2/, penn/ and "
            "shakespeare/ (tools/getdata.sh fetches them); got "
            f"{os.environ.get('CRTN_DATA')!r}"
        )
    return path


@pytest.fixture(autouse=True)
def _deterministic():
    """Every test starts from the same RNG state, with one intra-op thread (fastest for the
    tiny models of the tests, and robust when other processes share the cores)."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    yield


def _listing(root: Path) -> set[tuple[str, int, int]]:
    return {(str(p.relative_to(root)), p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture(scope="session", autouse=True)
def _shared_data_untouched():
    """The suite never writes into the real corpora (no ``.crtn-cache`` there, no file changed):
    their listing after the session equals the one before."""
    path = _shared_data()
    before = _listing(path) if path is not None and path.is_dir() else None
    yield
    if before is not None:
        changed = sorted({name for name, *_ in before ^ _listing(path)})
        assert not changed, f"the tests wrote into {path}: {changed[:5]}"


@pytest.fixture(scope="session", autouse=True)
def _run_folder(tmp_path_factory):
    """Under pytest-xdist, a folder that every worker of this run shares (tmp_path_factory's base
    is one per worker, its parent one per run) for :func:`tests.helpers.once_per_run`."""
    from tests.helpers import RUN_FOLDER

    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.getbasetemp().parent / "once-per-run"
        folder.mkdir(exist_ok=True)
        RUN_FOLDER["folder"] = folder
    yield
    RUN_FOLDER.clear()


@pytest.fixture
def bf16_units(monkeypatch):
    """This machine's CPU as one with bfloat16 matrix units (AVX512-BF16), whatever it has: a
    test of the bfloat16 product paths takes them as such a CPU does
    (:func:`crtn.model.hardware.multiplies_natively`); ``test_hardware.py`` checks a CPU
    without them."""
    from crtn.model import hardware

    monkeypatch.setattr(hardware, "cpu_features", lambda: {"avx512_bf16": True})
