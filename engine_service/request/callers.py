"""What one caller may hold of the engine, so no caller can starve the others,
and the prefix-cache salt that keeps callers' cached prompts apart.

- Streams: a caller runs at most `max_streams` Generate streams at once; one
  more is RESOURCE_EXHAUSTED (the engine's --max-streams still bounds the total).
- Queued bytes: the events queued for a caller's streams and not yet read by
  it count against `max_queued_bytes` together; past it, activations and
  probe scores are dropped and counted, as past one stream's own budget
  (engine_service.request.client_stream). A caller that stops reading pins at
  most this much.
- Cache salt: vLLM shares a KV-cache block between requests whose prompts
  start alike, and a cached prefix answers faster, so a caller could learn by
  timing what another caller's prompts begin with. Every caller's requests
  carry a salt of their own (an HMAC of the caller's name under a key drawn
  at start-up), so vLLM never matches a block across callers.

Callers are the names bearer tokens map to (common.security.auth). Without
tokens every caller is the same anonymous one: nothing tells callers apart,
so no quota or salt applies.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from common.errors import ResourceExhausted
from common.security.auth import ANONYMOUS

DEFAULT_MAX_STREAMS_PER_CALLER = 64
DEFAULT_MAX_QUEUED_BYTES_PER_CALLER = 256 * 1024 * 1024


class CallerAccount:
    """One caller's open streams and the bytes queued for them."""

    def __init__(self, caller: str, max_queued_bytes: int):
        self.caller = caller
        self.max_queued_bytes = max_queued_bytes
        self.streams = 0
        self.queued_bytes = 0


class StreamShare:
    """One Generate call's part of its caller's account: what its client stream
    queued and the client has not read yet. When the call ends, whatever it
    still holds leaves the account (a cancelled call's queue is never read)."""

    def __init__(self, account: CallerAccount):
        self.account = account
        self.queued_bytes = 0
        self.closed = False

    def has_room(self, size: int) -> bool:
        return self.closed or self.account.queued_bytes + size <= self.account.max_queued_bytes

    def queued(self, size: int) -> None:
        if not self.closed:
            self.queued_bytes += size
            self.account.queued_bytes += size

    def read(self, size: int) -> None:
        if not self.closed:
            self.queued_bytes -= size
            self.account.queued_bytes -= size

    def close(self) -> None:
        self.account.queued_bytes -= self.queued_bytes
        self.queued_bytes = 0
        self.closed = True


# The share of the Generate call being served, for the client stream the
# runtime creates for it (set by the servicer for the call's task).
_SHARE: contextvars.ContextVar[StreamShare | None] = contextvars.ContextVar(
    "undercurrent_stream_share", default=None)


def current_share() -> StreamShare | None:
    return _SHARE.get()


@dataclass(frozen=True)
class CallerLimits:
    max_streams: int = DEFAULT_MAX_STREAMS_PER_CALLER
    max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES_PER_CALLER


class Callers:
    """Every caller's account while it has a stream open, and the salts."""

    def __init__(self, limits: CallerLimits = CallerLimits()):
        self.limits = limits
        self._accounts: dict[str, CallerAccount] = {}
        self._salt_key = secrets.token_bytes(32)

    def account(self, caller: str) -> CallerAccount | None:
        return self._accounts.get(caller)

    @contextmanager
    def stream(self, caller: str) -> Iterator[StreamShare | None]:
        """Holds one of the caller's streams while the block runs (the Generate
        call), its share current for the client stream created in it;
        RESOURCE_EXHAUSTED when the caller already holds its most."""
        if caller == ANONYMOUS:
            yield None
            return
        account = self._accounts.get(caller)
        if account is None:
            account = self._accounts[caller] = CallerAccount(caller, self.limits.max_queued_bytes)
        if account.streams >= self.limits.max_streams:
            raise ResourceExhausted(
                f"caller {caller!r} already runs {account.streams} Generate streams, the most one caller "
                "may (--max-streams-per-caller); retry when one ends")
        account.streams += 1
        share = StreamShare(account)
        current = _SHARE.set(share)
        try:
            yield share
        finally:
            share.close()
            account.streams -= 1
            if account.streams == 0:
                del self._accounts[caller]
            # A call's generator that is closed by its garbage collection runs
            # this outside the call's context, where there is nothing to restore.
            with contextlib.suppress(ValueError):
                _SHARE.reset(current)

    def cache_salt(self, caller: str) -> str | None:
        """The caller's prefix-cache salt (None for the anonymous caller)."""
        if caller == ANONYMOUS:
            return None
        return hmac.new(self._salt_key, caller.encode(), hashlib.sha256).hexdigest()
