"""Plumbing shared by the command-line apps (``crtn-train``, ``crtn-eval``, ``crtn-generate``,
``crtn-convert``, ``crtn-bench``): the device, one-line user errors, the run's ``status.json``, the
check of a composed config against its schema, and the Hydra entry point that ties them together
(and sets the job process's allocator and CPU float mode, :mod:`crtn.utils`).

    def main() -> None:
        run_app("crtn-eval", "eval", run_eval, record_status=True)

:func:`run_app` registers the schemas (:func:`crtn.app_config.register_configs`), runs
``hydra.main`` with the app's primary config ``conf/<config_name>.yaml``, and calls the task
with the composed config after :func:`check_keys`: Hydra's ``+key=value`` adds keys even to
struct-mode nodes, so an unknown key is caught here, as a one-line error, in every group.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import socket
import sys
import time
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from crtn.app_config import APP_SCHEMAS, register_configs
from crtn.checkpoint import checkpoint_spec, load_checkpoint
from crtn.config import ResolvedRun, check_eval_cache
from crtn.errors import ConfigError, UserError
from crtn.rundir import RunDirLocked, lock_run_dir, previous_run
from crtn.utils import atomic_write, atomic_write_text, flush_denormals, tune_allocator

#: Where every app's primary config lives (``conf/`` is installed as the package ``crtn.conf``).
CONFIG_PATH = "pkg://crtn.conf"


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available).

    Raises:
        UserError: CUDA asked for but not available.
    """
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"train.device={name!r} but CUDA is not available (use device=cpu or auto)")
    return dev


@contextmanager
def report_user_errors(prog: str) -> Iterator[None]:
    """Print a :class:`UserError` as one line ``PROG: error: MESSAGE`` and exit with status 2.

    In a Hydra multirun the error is logged and re-raised instead, so that Hydra marks
    this job failed and the sweep's other jobs still run.
    """
    try:
        yield
    except UserError as e:
        if not isinstance(e, RunDirLocked):  # the log file belongs to the run holding the folder
            logging.getLogger(prog).error("%s", e)
        print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        if _in_multirun():
            raise
        sys.exit(2)


def _in_multirun() -> bool:
    try:
        return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    except Exception:  # outside a Hydra app
        return False


def write_status(run_dir: Path, state: str, **info: Any) -> None:
    """``status.json`` of a run: ``running`` (with pid and host), ``done``, ``failed`` (with the error)
    or ``stopped`` (by a signal); ``crtn-report`` uses it to list jobs that did not finish."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"state": state, "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), **info}
    atomic_write_text(run_dir / "status.json", json.dumps(record))


def run_with_status(prog: str, fn: Callable[[Any], Any], cfg: Any, lock: bool = False) -> Any:
    """Run ``fn(cfg)`` inside a Hydra job, recording ``status.json`` and printing user errors
    as one line (see :func:`report_user_errors`). Used by crtn-train and crtn-eval.

    With ``lock`` the run folder is locked first (:func:`crtn.rundir.lock_run_dir`): a second
    process on the same folder stops there, before writing anything. A user error (a refusal)
    on a folder that had a ``status.json`` or held a run puts the previous state back: the refused
    command leaves the run as it found it.
    """
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    main_rank = int(os.environ.get("RANK", "0")) == 0
    status = (lambda state, **kw: write_status(run_dir, state, **kw)) if main_rank else (lambda *a, **k: None)
    if lock and main_rank:
        with report_user_errors(prog):
            lock_run_dir(run_dir)
    global _run_started
    _run_started = False
    previous = _read_bytes(run_dir / "status.json") if main_rank else None
    held_run = bool(previous_run(run_dir))
    status("running")
    try:
        with report_user_errors(prog):
            try:
                result = fn(cfg)
            except BaseException as e:
                if isinstance(e, UserError) and not _run_started and (previous is not None or held_run):
                    _put_back(run_dir / "status.json", previous)
                elif not isinstance(e, SystemExit):
                    status("failed", error=f"{type(e).__name__}: {e}".strip().splitlines()[0])
                raise
    except SystemExit as e:
        if e.code == 130:
            status("stopped", exit_code=e.code)
        raise
    status("done")
    return result


_run_started = False


def mark_run_started() -> None:
    """Tell :func:`run_with_status` that the task began writing its run: from now on an error marks
    the run ``failed`` instead of putting the previous ``status.json`` back."""
    global _run_started
    _run_started = True


def _put_back(path: Path, content: bytes | None) -> None:
    """``path`` as it was: ``content``, or no file when None."""
    if content is None:
        path.unlink(missing_ok=True)
    else:
        atomic_write(path, lambda f: f.write(content))


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def unknown_keys(values: dict[str, Any], schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of ``values`` (a plain nested dict) that the dataclass ``schema`` does not declare."""
    hints = typing.get_type_hints(schema)
    declared = {f.name for f in fields(schema)}
    found = []
    for key, value in values.items():
        if key not in declared:
            found.append(f"{prefix}{key}")
            continue
        sub = _dataclass_in(hints[key])
        if sub is not None and isinstance(value, dict):
            found += unknown_keys(value, sub, f"{prefix}{key}.")
    return found


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass of a field's type (``X`` or ``X | None``), or None."""
    for tp in (hint, *typing.get_args(hint)):
        if isinstance(tp, type) and is_dataclass(tp):
            return tp
    return None


def check_keys(cfg: Any, schema: type) -> None:
    """Reject keys the app's schema does not have, wherever they were added (``+model.x=1``, ``+x=1``).

    Raises:
        ConfigError: ``unknown key 'model.x' (not in the schema)``.
    """
    found = unknown_keys(OmegaConf.to_container(cfg, resolve=False), schema)
    if found:
        more = f"; also {', '.join(repr(k) for k in found[1:])}" if len(found) > 1 else ""
        raise ConfigError(f"unknown key {found[0]!r} (not in the schema){more}")


def given_keys(cfg: Any, section: str) -> dict[str, Any]:
    """The keys of ``section`` (``cache``, ``data``, ``model``...) that this job's command line set
    (Hydra's task overrides: ``cache.backend=faiss``, ``data=ptb``, a sweep's ``cache.n_slot=8``),
    with their composed values, as a nested dict. Used where an app's group replaces only what the
    user gave (crtn-eval's ``cache.*`` over a checkpoint's, crtn-convert's ``model.*`` over what the
    source implies); the app's schema has already checked names and types.
    """
    out: dict[str, Any] = {}
    for item in HydraConfig.get().overrides.task:
        key = item.split("=", 1)[0].lstrip("+~")
        if key != section and not key.startswith(section + "."):
            continue
        value = OmegaConf.select(cfg, key)
        if isinstance(value, (DictConfig, ListConfig)):
            value = OmegaConf.to_container(value, resolve=True)
        if key == section:
            out.update(value or {})
            continue
        *path, leaf = key.split(".")[1:]
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def run_app(
    prog: str, config_name: str, task: Callable[[Any], Any], record_status: bool = False, lock: bool = False
) -> None:
    """The entry point of a Hydra app: compose ``conf/<config_name>.yaml`` from the command line,
    check it against its schema (:data:`crtn.app_config.APP_SCHEMAS`) and run ``task(cfg)``.

    User errors print as one line ``PROG: error: ...`` (exit status 2); with ``record_status``
    the run directory also gets ``status.json`` and with ``lock`` is locked for the process
    (:func:`run_with_status`). The Hydra job is named
    after ``task``'s module (``train``, ``evaluate``...), as if ``task`` were the decorated function.
    """
    register_configs()
    schema = APP_SCHEMAS[config_name]

    def checked(cfg: Any, flushed: bool) -> Any:
        # logged here, after the run folder's lock: a run refused there leaves its log untouched
        if flushed:
            logging.getLogger(prog).info("CPU arithmetic flushes denormal floats to zero")
        else:
            logging.getLogger(prog).warning("denormal floats are not flushed to zero in every CPU thread")
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:
            raise ConfigError(f"{missing[0]} is required: give {missing[0]}=...")
        check_keys(cfg, schema)
        return task(cfg)

    @functools.wraps(task)
    def job(cfg: Any) -> Any:
        # in the process that runs the job (a launcher's worker, too), before its first tensor
        tune_allocator()
        run = functools.partial(checked, flushed=flush_denormals())
        if record_status:
            return run_with_status(prog, run, cfg, lock=lock)
        with report_user_errors(prog):
            return run(cfg)

    with _config_errors_as_one_line(prog):
        hydra.main(config_path=CONFIG_PATH, config_name=config_name, version_base="1.3")(job)()


@contextmanager
def _config_errors_as_one_line(prog: str) -> Iterator[None]:
    """Hydra's and OmegaConf's errors about the command line (an unknown key without ``+``, a value
    of the wrong type, a missing mandatory value, an unknown option) as one line
    ``PROG: error: ...`` with exit status 2, like a :class:`UserError`; other errors keep their
    traceback. (Hydra re-raises instead of printing several lines while ``HYDRA_FULL_ERROR`` is set.)"""
    old = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (HydraException, OmegaConfBaseException) as e:
        if old is not None:  # the user asked for the full error
            raise
        print(f"{prog}: error: {one_line(e)}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        if old is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = old


def one_line(e: BaseException) -> str:
    """The message of ``e`` and of its cause on one line, without OmegaConf's ``full_key:``,
    ``object_type=`` ... detail lines."""
    parts: list[str] = []
    for ex in (e, e.__cause__):
        if ex is None:
            continue
        for line in str(ex).splitlines():
            line = line.strip().rstrip(".")
            if line.startswith("Config search path"):
                break
            if line and not line.startswith(("full_key:", "reference_type=", "object_type=")):
                parts.append(line)
    return "; ".join(dict.fromkeys(parts)) or type(e).__name__


def load_with_overrides(cfg: Any) -> tuple[dict[str, Any], ResolvedRun]:
    """Read ``cfg.checkpoint`` and make the run spec of its evaluation: the checkpoint's, with the
    ``cache.*`` and ``data.*`` keys given on the command line and the app's ``eval.*`` settings
    (:func:`crtn.checkpoint.checkpoint_spec`; the evaluation model is built from
    :attr:`crtn.config.ResolvedRun.eval_spec`). The cache's size comes from
    ``eval.n_slot``/``eval.top_k`` only. Used by crtn-eval and crtn-generate.

    Raises:
        CheckpointError: unreadable checkpoint. ConfigError: a setting the rules refuse,
            ``cache.n_slot`` or ``cache.top_k`` set (:func:`crtn.config.check_eval_cache`).
    """
    check_eval_cache(cfg.cache)
    ckpt = load_checkpoint(cfg.checkpoint)
    overrides = {
        "cache": given_keys(cfg, "cache"),
        "data": given_keys(cfg, "data"),
        "eval": OmegaConf.to_container(cfg.eval),
    }
    return ckpt, checkpoint_spec(ckpt, overrides)
