"""The run's own log, ``metrics.jsonl``: one JSON record per line (a training log record or a
validation), appended as the run goes, and cut back to a checkpoint's step when a run resumes
from it, so the resumed run's log equals an uninterrupted one (docs/reliability.md, "Exact
resume")."""

from __future__ import annotations

import json
from pathlib import Path

from crtn.utils import atomic_write_text


def append_jsonl(path: Path, record: dict) -> None:
    """Append ``record`` as one JSON line to ``path`` (created if missing)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_jsonl(path: Path, max_step: int) -> None:
    """Drop records after ``max_step`` (they are re-done after a resume), and a last record torn by
    a kill in the middle of its append."""
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= max_step:
                keep.append(line)
        except ValueError:  # empty or torn
            continue
    atomic_write_text(path, "".join(line + "\n" for line in keep))
