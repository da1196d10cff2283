"""Which new requests a probe's canary takes: those whose point, a stable hash
of the request id in [0, 1), is below the canary's share. Every process
computes the same point, so every engine of a fleet pins the canary for the
same requests, and a test can tell which ones it will take."""

from __future__ import annotations

import hashlib


def canary_point(request_id: str) -> float:
    """The request's place in [0, 1): its id's 8-byte BLAKE2b digest, big-endian, over 2**64."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def canary_takes(request_id: str, share: float) -> bool:
    """Whether a canary of this share takes the request."""
    return canary_point(request_id) < share
