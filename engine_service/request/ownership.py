"""Which caller owns each running request, so callers cannot see or touch each other's.

A request belongs to the caller (the name its bearer token maps to) whose
Generate started it. To any other caller it does not exist: its Abort answers
`found=false` exactly as for an unknown id, and a Generate reusing its id is
NOT_FOUND, so request ids reveal nothing about other callers' traffic. Without
tokens (`--insecure` and no token source) every caller is the same anonymous
one and nothing is isolated.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from common.errors import NotFound


class RequestOwners:
    def __init__(self) -> None:
        self._owner: dict[str, str] = {}

    def owner(self, request_id: str) -> str | None:
        return self._owner.get(request_id)

    def visible_to(self, request_id: str, caller: str) -> bool:
        """True unless the request is running for another caller."""
        owner = self._owner.get(request_id)
        return owner is None or owner == caller

    @contextmanager
    def claim(self, request_id: str, caller: str) -> Iterator[None]:
        """Owns request_id for caller while the block runs (the Generate stream).

        Another caller's running request with this id raises NotFound; the same
        caller's is left to the runtime, which answers ALREADY_EXISTS, and keeps
        its claim."""
        owner = self._owner.get(request_id)
        if owner is not None and owner != caller:
            raise NotFound(f"request_id: {request_id!r} not found")
        if owner is not None:
            yield
            return
        self._owner[request_id] = caller
        try:
            yield
        finally:
            del self._owner[request_id]

    def __len__(self) -> int:
        return len(self._owner)
