"""Labelled prompt files (JSONL): one object per line with `text`, `label` and an optional `id`.

Files are read as a stream, so a file of any size costs the memory of one line.
Every problem is reported with the file, the line number and the field.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

_KEYS = {"text", "label", "id"}


class InputError(ValueError):
    """A labelled prompt file that cannot be used; names the file, line and field."""


@dataclass(frozen=True)
class Example:
    id: str
    text: str
    label: int  # 0 or 1
    line: int  # 1-based line number in the file


@dataclass(frozen=True)
class ExampleSummary:
    """What a full validation pass learned: counts and the file's content hash."""

    path: str
    sha256: str
    examples: int
    positives: int

    @property
    def negatives(self) -> int:
        return self.examples - self.positives


def read_examples(path: str | Path) -> Iterator[Example]:
    """Yields the examples in file order; raises InputError at the first bad line.

    Blank lines are skipped. An example without an id gets `line-N`, N its line
    number, so ids stay stable as long as the file does.
    """
    path = Path(path)
    try:
        handle = path.open("rb")
    except OSError as err:
        raise InputError(f"{path}: {err.strerror or err}") from None
    with handle:
        for number, raw in enumerate(handle, start=1):
            if raw.strip():
                yield _parse_line(path, number, raw)


def check_examples(path: str | Path) -> ExampleSummary:
    """Validates the whole file before anything is captured: every line, and ids unique."""
    path = Path(path)
    digest = hashlib.sha256()
    seen: dict[str, int] = {}
    count = positives = 0
    try:
        with path.open("rb") as handle:
            for raw in handle:
                digest.update(raw)
    except OSError as err:
        raise InputError(f"{path}: {err.strerror or err}") from None
    for example in read_examples(path):
        first = seen.setdefault(example.id, example.line)
        if first != example.line:
            raise InputError(
                f"{path}:{example.line}: id: {example.id!r} was already used on line {first}"
            )
        count += 1
        positives += example.label
    if count == 0:
        raise InputError(f"{path}: no examples (the file is empty)")
    if positives == 0 or positives == count:
        which = "positive (label 1)" if positives == 0 else "negative (label 0)"
        raise InputError(f"{path}: label: no {which} examples; a probe needs both classes")
    return ExampleSummary(str(path), digest.hexdigest(), count, positives)


def _parse_line(path: Path, number: int, raw: bytes) -> Example:
    where = f"{path}:{number}"
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise InputError(f"{where}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise InputError(f"{where}: unknown field(s) {unknown}; expected text, label and id")
    text = data.get("text")
    if text is None:
        raise InputError(f"{where}: text: missing")
    if not isinstance(text, str) or not text.strip():
        raise InputError(f"{where}: text: expected a non-empty string, got {text!r}")
    if "label" not in data:
        raise InputError(f"{where}: label: missing")
    label = data["label"]
    if not isinstance(label, (bool, int)) or label not in (0, 1):
        raise InputError(f"{where}: label: {label!r} is not 0, 1, false or true")
    raw_id = data.get("id", f"line-{number}")
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)) or str(raw_id) == "":
        raise InputError(f"{where}: id: expected a non-empty string or an integer, got {raw_id!r}")
    return Example(str(raw_id), text, int(label), number)
