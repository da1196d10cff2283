"""Bearer tokens: who may call, under which name.

A token source is a file (`--client-tokens-file`, `--admin-tokens-file`) or an
environment variable (`UNDERCURRENT_CLIENT_TOKENS`, `UNDERCURRENT_ADMIN_TOKENS`).
Entries are `NAME:TOKEN` (the name identifies the caller in logs, metrics and
request ownership) or a bare `TOKEN` (named `token-` + the first 8 hex digits of
its SHA-256, which does not reveal it); one per line in a file, separated by
commas or newlines in a variable; `#` starts a comment line. A file is re-read
when it changes, so tokens rotate without a restart.

Tokens are compared with `hmac.compare_digest` against every configured token,
so the time taken does not reveal how much of a guess matched or which entry
came closest.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CLIENT_TOKENS_ENV = "UNDERCURRENT_CLIENT_TOKENS"
ADMIN_TOKENS_ENV = "UNDERCURRENT_ADMIN_TOKENS"
MIN_TOKEN_CHARS = 16
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class TokenConfigError(ValueError):
    """A token source is missing, empty or malformed (names the source and line)."""


def anonymous_name(token: str) -> str:
    return "token-" + hashlib.sha256(token.encode()).hexdigest()[:8]


def parse_entries(text: str, source: str, separators: str = "\n") -> dict[str, str]:
    """{token: caller name} from token entries; raises TokenConfigError naming the entry."""
    entries: dict[str, str] = {}
    pattern = "|".join(re.escape(s) for s in separators)
    for number, raw in enumerate(re.split(pattern, text), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, token = line.partition(":")
        if not sep:
            name, token = "", name
        name, token = name.strip(), token.strip()
        where = f"{source} entry {number}"
        if len(token) < MIN_TOKEN_CHARS:
            raise TokenConfigError(f"{where}: the token has fewer than {MIN_TOKEN_CHARS} characters")
        if any(ch.isspace() for ch in token) or not token.isprintable():
            raise TokenConfigError(f"{where}: the token must be printable text without spaces")
        if name and not _NAME.match(name):
            raise TokenConfigError(f"{where}: caller name {name!r} must be 1-64 of A-Z a-z 0-9 _ . @ -")
        entries[token] = name or anonymous_name(token)
    if not entries:
        raise TokenConfigError(f"{source}: no tokens")
    return entries


@dataclass
class TokenSet:
    """The tokens that grant one kind of access (client or probe administration)."""

    label: str  # "client" or "admin", for messages
    path: Path | None = None
    env_var: str | None = None
    _tokens: list[tuple[bytes, str]] = field(default_factory=list, init=False, repr=False)
    _stamp: tuple | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_file(cls, label: str, path: Path) -> "TokenSet":
        tokens = cls(label, path=Path(path))
        tokens._load_file()
        return tokens

    @classmethod
    def from_env(cls, label: str, env_var: str, environ=os.environ) -> "TokenSet":
        tokens = cls(label, env_var=env_var)
        tokens._set(parse_entries(environ.get(env_var, ""), f"${env_var}", separators=",\n"))
        return tokens

    @classmethod
    def of(cls, label: str, entries: dict[str, str]) -> "TokenSet":
        """From {token: caller name} (tests and embedding)."""
        tokens = cls(label)
        tokens._set(dict(entries))
        return tokens

    def _set(self, entries: dict[str, str]) -> None:
        self._tokens = [(token.encode(), name) for token, name in entries.items()]

    def _file_stamp(self) -> tuple | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    def _load_file(self) -> None:
        stamp = self._file_stamp()
        try:
            text = self.path.read_text()
        except OSError as err:
            raise TokenConfigError(f"--{self.label}-tokens-file {self.path}: {err.strerror or err}") from None
        self._set(parse_entries(text, f"--{self.label}-tokens-file {self.path}"))
        self._stamp = stamp

    def _refresh(self) -> None:
        """Re-reads a changed file; a bad new file keeps the previous tokens (logged)."""
        if self.path is None or self._file_stamp() == self._stamp:
            return
        try:
            self._load_file()
            log.info("%s tokens reloaded from %s (%d tokens)", self.label, self.path, len(self._tokens))
        except TokenConfigError as err:
            self._stamp = self._file_stamp()
            log.error("%s; keeping the previous %s tokens", err, self.label)

    def caller_of(self, token: str) -> str | None:
        """The caller's name when the token is one of the set, else None (constant time
        in the token's content: every entry is compared, with compare_digest)."""
        self._refresh()
        presented = token.encode()
        found = None
        for candidate, name in self._tokens:
            if hmac.compare_digest(candidate, presented) and found is None:
                found = name
        return found
