"""Which replica a request lives on, and how fast a lost session retries."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable


def rendezvous_weight(key: str, replica: str) -> int:
    """A stable pseudo-random weight of (key, replica); the same in every process."""
    digest = hashlib.blake2b(f"{replica}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def pick_replica(key: str, replicas: Iterable[str]) -> str | None:
    """Highest-random-weight choice: removing a replica moves only the keys it held."""
    return max(replicas, key=lambda r: (rendezvous_weight(key, r), r), default=None)


def backoff_delay(attempt: int, base: float, maximum: float, unit_random: float) -> float:
    """Exponential backoff with jitter in [cap/2, cap], so engines do not reconnect in step."""
    cap = min(maximum, base * (2 ** min(attempt, 32)))
    return cap * (0.5 + 0.5 * unit_random)
