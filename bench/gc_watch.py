"""The garbage collector's runs while a benchmark measures, from `gc.callbacks`."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Self


class Collections:
    """The collections CPython runs while the block runs: per generation, how many,
    their milliseconds in all and the longest one (what held the thread longest),
    and each full collection with what `label` says of that moment."""

    def __init__(self, label: Callable[[], dict] = dict) -> None:
        self.label = label
        self.count, self.ms, self.longest_ms = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]
        self.full: list[dict] = []  # per full collection: label() and its milliseconds
        self._started = 0.0

    def __enter__(self) -> Self:
        gc.callbacks.append(self._on)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on)

    def _on(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        generation, ms = info["generation"], 1e3 * (time.perf_counter() - self._started)
        self.count[generation] += 1
        self.ms[generation] += ms
        self.longest_ms[generation] = max(self.longest_ms[generation], ms)
        if generation == 2:
            self.full.append({**self.label(), "ms": round(ms, 1)})
