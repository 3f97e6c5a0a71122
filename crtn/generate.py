"""Text generation with the short-term memory and the cache, and ``crtn-generate`` (a Hydra app).

    crtn-generate checkpoint=PATH prompt="the company said" max_new_tokens=40 temperature=0.8 top_k=20
    crtn-generate checkpoint=PATH prompt_file=prompt.txt temperature=0    # greedy

Incremental decoding (:class:`IncrementalLM`) keeps the segment boundaries of
evaluation: the text is cut into segments of ``tgt_len`` tokens from its first token
on. Full segments are run once with ``update=True``, which renews the memory S and
(``crtn``) inserts segments into the cache. The current, partial segment is re-run
with ``update=False`` after each new token (one forward per token, over at most
``tgt_len`` positions), which reads memory and cache without changing them; when it
reaches ``tgt_len`` tokens it is run with ``update=True`` instead, which commits it.
The next-token distribution is ``model.crit.log_prob`` of the last position. So the
distribution of every generated token equals the one that re-evaluating the whole
text from a fresh state, segment by segment, gives at that position
(``tests/test_generate.py`` checks this for greedy decoding).

Sampling (:func:`sample_next`): ``temperature`` divides the log-probabilities
(0: greedy argmax); ``top_k > 0`` keeps the k most likely tokens (not to be confused
with ``eval.top_k``, the number of retrieved segments). Draws come from one
``torch.Generator`` seeded with ``seed``: the same seed gives the same text.

Text <-> ids (:func:`encode_prompt`, :func:`decode`): word-level corpora split the
prompt on whitespace, read a line break as ``<eos>`` (which may also be written as a word)
and print ``<eos>`` as a newline; character-level corpora use one symbol per character (per UTF-8 byte for
enwik8). A symbol outside the vocabulary becomes ``<unk>`` when the vocabulary has
one, else it is a one-line error naming the symbol.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from torch import Tensor

from crtn.app import load_with_overrides, resolve_device, run_app
from crtn.data import load_corpus
from crtn.errors import UserError
from crtn.model import build_model

log = logging.getLogger("crtn.generate")

EOS = "<eos>"
UNK = "<unk>"


# ============================================================================ decoding
class IncrementalLM:
    """Feeds a token stream to a model one piece at a time, keeping memory, cache and segment boundaries.

    Args:
        model: a :class:`crtn.model.TransformerLM` (put in eval mode; no gradients are taken).
        device: where the tokens go (the model's device).

    Attributes:
        state: the model state after the last committed (full) segment.
        partial: tokens of the current segment not yet committed (fewer than ``tgt_len``).
        log_prob: [n_token] log-distribution of the next token, or None before any token.
        n_forward: forward passes run so far.
    """

    def __init__(self, model: Any, device: torch.device | str | None = None):
        self.model = model.eval()
        self.device = device if device is not None else next(model.parameters()).device
        self.state = model.init_state(1, self.device)
        self.partial: list[int] = []
        self.log_prob: Tensor | None = None
        self.n_forward = 0

    @property
    def seg_len(self) -> int:
        """Segment length L (the model's current ``tgt_len``)."""
        return self.model.tgt_len

    @torch.no_grad()
    def _run(self, commit: bool) -> None:
        tokens = torch.tensor([self.partial], dtype=torch.long, device=self.device)
        out = self.model(tokens, state=self.state, update=commit)
        self.n_forward += 1
        self.log_prob = self.model.crit.log_prob(out.hidden[0, -1]).float()
        if commit:
            self.state = out.state
            self.partial = []

    def feed(self, ids: Sequence[int]) -> Tensor:
        """Append ``ids`` to the text; return the log-distribution of the token after them.

        Full segments are committed with ``update=True`` (one forward each); a remaining
        partial segment is run once with ``update=False``. Feeding one token costs one forward.

        Raises:
            ValueError: ``ids`` is empty and nothing was fed before.
        """
        ids = [int(i) for i in ids]
        L = self.seg_len
        i = 0
        while i < len(ids):
            take = min(L - len(self.partial), len(ids) - i)
            self.partial.extend(ids[i : i + take])
            i += take
            if len(self.partial) == L:
                self._run(commit=True)
            elif i == len(ids):
                self._run(commit=False)
        if self.log_prob is None:
            raise ValueError("no token fed yet: the prompt must hold at least one token")
        return self.log_prob


def sample_next(
    log_prob: Tensor, temperature: float = 1.0, top_k: int = 0, generator: torch.Generator | None = None
) -> int:
    """Draw the next token id from a log-distribution [n_token].

    ``temperature == 0``: the argmax (greedy). Otherwise ``softmax(log_prob / temperature)``
    restricted to the ``top_k`` largest entries when ``top_k > 0``.

    Raises:
        ValueError: negative temperature or top_k.
    """
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature={temperature} and top_k={top_k} must be >= 0")
    if temperature == 0:
        return int(log_prob.argmax())
    logits = log_prob.double() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def generate(
    model: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    generator: torch.Generator | None = None,
    lm: IncrementalLM | None = None,
) -> list[int]:
    """Continue ``prompt_ids`` by ``max_new_tokens`` tokens (see the module docstring).

    Args:
        model: a :class:`crtn.model.TransformerLM` (vanilla, txl or crtn).
        prompt_ids: at least one token id.
        max_new_tokens: tokens to generate (>= 0).
        temperature: 0 for greedy decoding.
        top_k: sample among the k most likely tokens (0: all).
        generator: a CPU ``torch.Generator`` for the draws (None: torch's global RNG).
        lm: an :class:`IncrementalLM` of ``model`` to use (its memory and cache can then be
            inspected afterwards); a fresh one by default.

    Returns:
        The generated ids only (without the prompt).

    Raises:
        ValueError: an empty prompt, negative ``max_new_tokens``/``temperature``/``top_k``.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if len(prompt_ids) == 0:
        raise ValueError("the prompt must hold at least one token")
    lm = lm if lm is not None else IncrementalLM(model)
    log_prob = lm.feed(prompt_ids)
    new: list[int] = []
    for n in range(max_new_tokens):
        token = sample_next(log_prob, temperature, top_k, generator)
        new.append(token)
        if n + 1 < max_new_tokens:
            log_prob = lm.feed([token])
    return new


# ============================================================================ text <-> ids
def text_mode(symbols: Sequence[str], level: str, data_name: str | None = None) -> str:
    """How text maps to symbols: ``words`` (whitespace), ``chars`` or ``bytes`` (enwik8)."""
    if level != "char" or not all(len(s) == 1 for s in symbols):
        return "words"
    return "bytes" if data_name == "enwik8" else "chars"


def encode_prompt(text: str, symbols: Sequence[str], mode: str = "words") -> list[int]:
    """Prompt text -> ids (see :func:`text_mode`); unknown symbols -> ``<unk>`` if present.

    Word level: whitespace-separated symbols; a line break is ``<eos>`` (when the vocabulary has
    it), as in the corpus, and ``<eos>`` may also be written out.

    Raises:
        UserError: a symbol outside the vocabulary when there is no ``<unk>`` (names the symbol).
    """
    index = {s: i for i, s in enumerate(symbols)}
    if mode == "words":
        if EOS in index:  # a line break ends a line, as when the corpus was read
            text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\n", f" {EOS} ")
        pieces = text.split()
    elif mode == "bytes":
        pieces = [chr(b) for b in text.encode("utf-8")]
    else:
        pieces = list(text)
    unk = index.get(UNK)
    ids = []
    for p in pieces:
        i = index.get(p, unk)
        if i is None:
            raise UserError(
                f"prompt symbol {p!r} is not in the vocabulary ({len(symbols)} symbols, no {UNK} to map it to)"
            )
        ids.append(i)
    return ids


def decode(ids: Sequence[int], symbols: Sequence[str], mode: str = "words") -> str:
    """Ids -> text: words joined by spaces with ``<eos>`` as a newline; characters joined as they are."""
    if mode == "chars":
        return "".join(symbols[i] for i in ids)
    if mode == "bytes":
        return bytes(ord(symbols[i]) for i in ids).decode("utf-8", errors="replace")
    out: list[str] = []
    for i in ids:
        s = symbols[i]
        if s == EOS:
            out.append("\n")
        else:
            out.append(s if not out or out[-1] == "\n" else " " + s)
    return "".join(out)


# ============================================================================ CLI
def run_generate(cfg: Any) -> dict[str, Any]:
    """``crtn-generate``: sample a continuation of ``cfg.prompt`` from ``cfg.checkpoint``.

    Raises:
        UserError: bad checkpoint, settings or prompt (one line).
    """
    _check_settings(cfg)
    ckpt, run = load_with_overrides(cfg)
    symbols = ckpt.get("vocab")
    if symbols is None:
        log.info("the checkpoint has no vocabulary; reading it from data.name=%s", run.data.name)
        symbols = load_corpus(run.data).vocab.idx2sym
    symbols = list(symbols)
    mode = text_mode(symbols, run.data.level, run.data.name)
    prompt = _read_prompt(cfg)
    prompt_ids = _prompt_ids(prompt, symbols, mode)

    device = resolve_device(cfg.device)
    model = build_model(run.eval_spec, len(symbols)).to(device)
    try:
        model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(
            f"checkpoint {cfg.checkpoint!r} does not match its config/vocabulary ({str(e).splitlines()[0]})"
        ) from None
    generator = torch.Generator().manual_seed(cfg.seed)
    lm = IncrementalLM(model, device)
    new = generate(
        model,
        prompt_ids,
        cfg.max_new_tokens,
        temperature=cfg.temperature,
        top_k=cfg.top_k,
        generator=generator,
        lm=lm,
    )
    prompt_text = decode(prompt_ids, symbols, mode)
    new_text = decode(new, symbols, mode)
    sep = (
        " "
        if mode == "words" and prompt_text and not prompt_text.endswith("\n") and new_text[:1] != "\n"
        else ""
    )
    text = prompt_text + sep + new_text
    print(text, flush=True)
    _log_state(lm, model, len(prompt_ids), len(new))
    record = {
        "checkpoint": str(cfg.checkpoint),
        "prompt": prompt,
        "prompt_ids": prompt_ids,
        "new_ids": new,
        "text": text,
        "continuation": new_text,
        "settings": {
            "max_new_tokens": cfg.max_new_tokens,
            "temperature": cfg.temperature,
            "top_k": cfg.top_k,
            "seed": cfg.seed,
            "tgt_len": model.tgt_len,
            "mem_len": model.mem_len,
            "n_slot": model.n_slot if model.has_cache else 0,
            "cache_top_k": model.top_k if model.has_cache else 0,
        },
    }
    if cfg.out:
        out = Path(cfg.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2, ensure_ascii=False))
    return record


def _check_settings(cfg: Any) -> None:
    if OmegaConf.is_missing(cfg, "checkpoint"):
        raise UserError("checkpoint=PATH is required (a crtn-train or crtn-convert checkpoint)")
    if cfg.max_new_tokens < 0:
        raise UserError(f"max_new_tokens={cfg.max_new_tokens} must be >= 0")
    if cfg.temperature < 0:
        raise UserError(f"temperature={cfg.temperature} must be >= 0 (0: greedy)")
    if cfg.top_k < 0:
        raise UserError(f"top_k={cfg.top_k} must be >= 0 (0: no top-k filtering)")


def _read_prompt(cfg: Any) -> str:
    if not cfg.prompt_file:
        return cfg.prompt
    path = Path(cfg.prompt_file)
    if not path.is_file():
        raise UserError(f"prompt_file={str(path)!r} does not exist")
    return path.read_text(encoding="utf-8")


def _prompt_ids(prompt: str, symbols: list[str], mode: str) -> list[int]:
    """The prompt's ids; an empty prompt starts after an ``<eos>``."""
    prompt_ids = encode_prompt(prompt, symbols, mode)
    if not prompt_ids:
        if EOS not in symbols:
            raise UserError(
                "the prompt is empty and the vocabulary has no <eos> to start from; give prompt=..."
            )
        prompt_ids = [symbols.index(EOS)]
    return prompt_ids


def _log_state(lm: IncrementalLM, model: Any, n_prompt: int, n_new: int) -> None:
    cache = lm.state.cache
    log.info(
        "%d prompt + %d new tokens, %d forward passes, tgt_len=%d, memory %d positions, cache %s",
        n_prompt,
        n_new,
        lm.n_forward,
        model.tgt_len,
        0 if lm.state.mem is None else lm.state.mem.shape[2],
        "off" if cache is None else f"{cache.n_valid}/{cache.n_slot} slots filled",
    )


def main() -> None:
    """Console entry point of ``crtn-generate`` (a Hydra app, config ``conf/generate.yaml``)."""
    run_app("crtn-generate", "generate", run_generate)


if __name__ == "__main__":
    main()
