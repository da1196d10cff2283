"""A labelled set whose condition a linear probe can see on a random-weights model:
prompts that contain a marker word (label 1) against prompts that do not (label 0).

The embedded model's weights are random, so no semantic condition is visible in
its activations; a token that is present or absent is. Prompts are drawn from a
fixed word list with a seeded generator, so the same arguments give the same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = (
    "river stone quiet market window garden silver morning paper lantern orange "
    "forest harbor candle meadow copper winter signal bridge travel yellow pocket "
    "thunder basket marble circle planet hollow velvet mirror anchor feather "
    "engine shadow timber canyon desert island ladder mellow puzzle rocket"
).split()
MARKER = "zanzibar"


def marker_examples(count: int, marker: str = MARKER, seed: int = 0, words: int = 8,
                    repeats: int = 2, id_prefix: str = "ex") -> list[dict]:
    """`count` examples, half of them with `marker` inserted `repeats` times."""
    if marker in WORDS:
        raise ValueError(f"marker {marker!r} is one of the filler words")
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        text = [rng.choice(WORDS) for _ in range(words)]
        label = i % 2
        if label:
            for _ in range(repeats):
                text.insert(rng.randrange(len(text) + 1), marker)
        examples.append({"id": f"{id_prefix}{i:05d}", "text": " ".join(text), "label": label})
    return examples


def write_examples(path: str | Path, examples: list[dict]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(e) + "\n" for e in examples))
    return path
