"""``crtn-convert``: pretrained Transformer-XL weights into a crtn checkpoint (a Hydra app).

    crtn-convert src=HF_DIR out=OUT [vocab=FILE] [data=ptb data.root=...] [model.KEY=VALUE ...]
    crtn-convert src=model.pt out=OUT model.tgt_len=150 model.mem_len=150 ...

Sources (``format=auto`` tells them apart):

- ``hf``: a Hugging Face ``TransfoXLLMHeadModel`` folder (``config.json`` and
  ``model.safetensors`` or ``pytorch_model.bin``, possibly sharded with an
  ``*.index.json``), as written by ``save_pretrained`` in transformers <= 4.35
  (``models/transfo_xl/modeling_transfo_xl.py``; later releases removed the model).
  Keys lose their ``transformer.`` prefix; the rows of ``crit.cluster_weight`` and
  ``crit.cluster_bias`` are reversed, because HF 4.35's working ``forward`` reads
  tail cluster ``i`` from head column ``cutoffs[0] + i - 1`` while crtn (like the
  PyTorch release) reads column ``-i`` (see :mod:`crtn.model.adaptive`).
  Hyper-parameters come from ``config.json`` (``tie_word_embeddings`` ->
  ``tie_weight``, ``tie_projs`` / ``proj_share_all_but_first`` -> ``tie_projs``,
  ``layer_norm_epsilon`` -> ``layer_norm_eps``, ``vocab_size`` -> ``n_token``; keys
  that ``save_pretrained`` left out take :data:`HF_DEFAULTS`, the 4.35 defaults).
- ``release``: a checkpoint of the Transformer-XL release (kimiyoung/transformer-xl,
  ``pytorch/mem_transformer.py``, ``MemTransformerLM``). Its ``train.py`` saves the
  whole pickled module (``torch.save(model, f)``); a re-saved ``state_dict`` works
  too. Parameter names are crtn's already (crtn follows the release); the release's
  cluster order is crtn's. Files are read with ``torch.load(weights_only=True)``,
  which never runs code from the file. A whole-module pickle needs the release's
  classes, and unpickling them executes code named by the file, so it is refused
  with an explanation unless ``trust_pickle=true`` is given (with the release's
  ``pytorch/`` folder on ``PYTHONPATH``); then ``.state_dict()`` and the module's
  attributes (``tgt_len``, ``mem_len``, ``same_length``, ``clamp_len``, dropout
  rates, ``pre_lnorm``, ``attn_type``...) are used.

Hyper-parameters, in increasing priority: :class:`crtn.model.spec.ModelSpec`
defaults (the command line's; ``mem_len`` defaults to ``tgt_len``) < inferred from tensor shapes (:func:`infer_hparams`: ``n_layer``,
``n_head``, ``d_head``, ``d_model``, ``d_embed``, ``d_inner``, ``div_val``,
``cutoffs`` when ``div_val > 1``, ``untie_r``, ``tie_weight``, ``tie_projs``) <
the source's config or module attributes < ``model.KEY=VALUE`` on the command
line. Values that neither shapes nor the source determine (a bare release
state_dict: ``tgt_len``, ``mem_len``, ``clamp_len``, ``same_length``,
``pre_lnorm``, dropout rates) are logged as assumed; ``pre_lnorm`` changes the
computation, so set it when the model was trained with it.

Output, in ``out``:

- ``model.pt``: a crtn checkpoint (:mod:`crtn.checkpoint`) whose ``config`` is a
  complete ``crtn-train`` config with ``model.name=txl`` and the converted sizes
  (``data`` as given by ``data=...``, else the default), ``vocab`` (the
  ``vocab=FILE`` symbols, or None) and ``model`` (crtn parameter names, the
  source's floating dtype);
- ``model/converted.yaml``: the model as a config-group option, so that
  ``crtn-train --config-dir OUT model=converted model.name=crtn init_from=OUT/model.pt
  data=...`` fine-tunes CRTN from it;
- ``convert.log``.

Errors (bad input that the user can fix) are :class:`ConversionError` and print as
one line naming the tensor, key or file: unknown or missing tensors, shape
mismatches, ``attn_type`` other than 0, ``sample_softmax > 0``, a vocabulary of
the wrong size, a whole-module pickle without ``trust_pickle=true``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from crtn.app import given_keys, run_app
from crtn.checkpoint import save_checkpoint
from crtn.config import resolve, spec_dict, train_config
from crtn.convert.hf import HF_DEFAULTS, read_hf
from crtn.convert.hparams import NOT_INFERABLE, infer_hparams, resolve_hparams
from crtn.convert.release import read_release
from crtn.convert.source import ConversionError, Source, first_line
from crtn.convert.tensors import convert_tensors, describe
from crtn.data import load_corpus

__all__ = [
    "HF_DEFAULTS",
    "NOT_INFERABLE",
    "ConversionError",
    "Source",
    "convert",
    "convert_tensors",
    "infer_hparams",
    "main",
    "read_hf",
    "read_release",
    "read_source",
    "read_vocab",
    "resolve_hparams",
    "run_convert",
]

log = logging.getLogger("crtn.convert")


def read_source(src: str | Path, fmt: str = "auto", trust_pickle: bool = False) -> Source:
    """Read a Hugging Face folder or a release checkpoint (see the module docstring).

    Raises:
        ConversionError: missing/unreadable source, a whole-module pickle without
            ``trust_pickle``, an unsupported model type.
    """
    path = Path(src)
    if fmt not in ("auto", "hf", "release"):
        raise ConversionError(f"format={fmt!r} is not one of: auto, hf, release")
    if not path.exists():
        raise ConversionError(f"src={str(path)!r} does not exist")
    if fmt == "hf" or (fmt == "auto" and path.is_dir()):
        return read_hf(path)
    return read_release(path, trust_pickle)


def read_vocab(path: str | Path) -> list[str]:
    """A vocabulary file, symbols in id order: a JSON list of strings (``*.json``; any symbol,
    e.g. the space and newline of character-level corpora), else one symbol per line, its first
    whitespace-separated field (the release's ``Vocab._build_from_file`` format; trailing counts
    are ignored).

    Raises:
        ConversionError: missing or malformed file, an empty line, a repeated symbol.
    """
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"vocab={str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        try:
            symbols = json.loads(text)
        except ValueError as e:
            raise ConversionError(f"vocab={str(path)!r} is not valid JSON ({first_line(e)})") from None
        if not isinstance(symbols, list) or not all(isinstance(x, str) for x in symbols):
            raise ConversionError(f"vocab={str(path)!r}: expected a JSON list of strings")
    else:
        symbols = []
        for n, line in enumerate(text.splitlines(), 1):
            fields = line.split()
            if not fields:
                raise ConversionError(
                    f"vocab={str(path)!r}: line {n} is empty (one symbol per line expected)"
                )
            symbols.append(fields[0])
    seen: dict[str, int] = {}
    for i, s in enumerate(symbols):
        if s in seen:
            raise ConversionError(
                f"vocab={str(path)!r}: symbol {s!r} appears on lines {seen[s] + 1} and {i + 1}"
            )
        seen[s] = i
    return symbols


# ============================================================================ entry points
def convert(
    src: str | Path,
    out: str | Path,
    vocab: str | Path | None = None,
    data: dict[str, Any] | None = None,
    model: dict[str, Any] | None = None,
    fmt: str = "auto",
    trust_pickle: bool = False,
) -> dict[str, Any]:
    """Convert Transformer-XL weights into ``out/model.pt`` and ``out/model/converted.yaml``.

    Args:
        src: a Hugging Face folder or a release checkpoint file.
        out: output folder (created).
        vocab: vocabulary file (one symbol per line in id order), or None.
        data: a ``data`` config node (dict) for the checkpoint's config, or None (default data).
        model: ``model.*`` values that override what the source says or implies (None values are
            ignored).
        fmt: ``auto``, ``hf`` or ``release``.
        trust_pickle: allow unpickling a whole release module (runs code from the file).

    Returns:
        ``{"checkpoint": path, "model_yaml": path, "config": model dict, "n_token": int,
        "assumed": [...], "kind": "hf" | "release"}``.

    Raises:
        ConversionError: see the module docstring.
    """
    source = read_source(src, fmt, trust_pickle)
    cfg, n_token, assumed = resolve_hparams(source, model)
    state = convert_tensors(source, cfg, n_token)

    symbols = None
    if vocab is not None:
        symbols = read_vocab(vocab)
        if len(symbols) != n_token:
            raise ConversionError(
                f"vocab={str(vocab)!r} has {len(symbols)} symbols but the model has {n_token}"
            )
    train_cfg = train_config()
    train_cfg.model = OmegaConf.merge(train_cfg.model, cfg)
    if data is not None:
        train_cfg.data = OmegaConf.merge(train_cfg.data, data)
        _check_corpus(train_cfg.data, n_token, symbols)
    config = spec_dict(resolve(train_cfg))  # the run spec, as crtn-train's checkpoints store it

    ckpt_path, yaml_path = _write(source, src=src, out=Path(out), config=config, symbols=symbols, state=state)
    n_params = sum(v.numel() for v in {v.data_ptr(): v for v in state.values()}.values())  # tied once
    log.info(
        "converted %s weights %s: %s, %s tensors (%s values); wrote %s and %s",
        source.kind,
        src,
        describe(train_cfg.model, n_token),
        len(state),
        f"{n_params:,}",
        ckpt_path,
        yaml_path,
    )
    if assumed:
        log.warning(
            "not given by the source, assumed: %s (override with model.KEY=VALUE)",
            ", ".join(f"{k}={cfg[k]}" for k in assumed),
        )
    if symbols is None:
        log.info("no vocab=FILE given: the checkpoint has no vocabulary (crtn uses the corpus' own)")
    return {
        "checkpoint": ckpt_path,
        "model_yaml": yaml_path,
        "config": cfg,
        "n_token": n_token,
        "assumed": assumed,
        "kind": source.kind,
    }


def _write(
    source: Source, src: str | Path, out: Path, config: dict, symbols: list[str] | None, state: dict
) -> tuple[Path, Path]:
    """Write ``out/model.pt`` (the checkpoint) and ``out/model/converted.yaml`` (a model option)."""
    ckpt_path = out / "model.pt"
    save_checkpoint(
        ckpt_path,
        {
            "config": config,
            "vocab": symbols,
            "model": state,
            "converted_from": {"kind": source.kind, "path": str(Path(src).resolve())},
        },
    )
    yaml_path = out / "model" / "converted.yaml"
    yaml_path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Transformer-XL converted by crtn-convert from {source.kind} weights {str(Path(src).resolve())}.\n"
        f"# Fine-tune CRTN from it: crtn-train --config-dir {out} model=converted model.name=crtn \\\n"
        f"#   init_from={ckpt_path} data=...\n"
    )
    yaml_path.write_text(header + OmegaConf.to_yaml(OmegaConf.create(config["model"])))
    return ckpt_path, yaml_path


def _check_corpus(data: Any, n_token: int, symbols: list[str] | None) -> None:
    """The corpus of ``data`` must match the model's vocabulary (size, and symbols when known)."""
    corpus = load_corpus(data)
    vocab = corpus.vocab.idx2sym
    if len(vocab) != n_token:
        raise ConversionError(
            f"data.name={data.name}: the corpus has {len(vocab)} symbols but the model has {n_token}"
        )
    if symbols is not None and symbols != vocab:
        i = next(i for i, (a, b) in enumerate(zip(symbols, vocab)) if a != b)
        raise ConversionError(
            f"vocab file and data.name={data.name} disagree at id {i}: {symbols[i]!r} vs {vocab[i]!r} "
            "(the ids must follow the corpus' vocabulary order)"
        )


def run_convert(cfg: Any) -> dict[str, Any]:
    """``crtn-convert``: convert ``cfg.src`` into ``cfg.out`` (see :func:`convert`)."""
    for key in ("src", "out"):
        if OmegaConf.is_missing(cfg, key):
            raise ConversionError(f"{key}=... is required: crtn-convert src=HF_DIR_OR_MODEL_PT out=OUT_DIR")
    overrides = given_keys(cfg, "model")  # what the command line gave; the rest the source says
    data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") is not None else None
    result = convert(
        cfg.src,
        cfg.out,
        vocab=cfg.vocab,
        data=data,
        model=overrides,
        fmt=cfg.format,
        trust_pickle=cfg.trust_pickle,
    )
    out = Path(cfg.out)
    print(f"wrote {result['checkpoint']} and {result['model_yaml']}", flush=True)
    print(
        f"fine-tune CRTN from it: crtn-train --config-dir {out} model=converted model.name=crtn "
        f"init_from={result['checkpoint']} data=...",
        flush=True,
    )
    return result


def main() -> None:
    """Console entry point of ``crtn-convert`` (a Hydra app, config ``conf/convert.yaml``)."""
    run_app("crtn-convert", "convert", run_convert)


if __name__ == "__main__":
    main()
