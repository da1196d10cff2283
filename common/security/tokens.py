"""Bearer tokens: who may call, under which name.

A token source is a file (`--client-tokens-file`, `--admin-tokens-file`) or an
environment variable (`UNDERCURRENT_CLIENT_TOKENS`, `UNDERCURRENT_ADMIN_TOKENS`).
Entries are `NAME:TOKEN` (the name identifies the caller in logs, metrics and
request ids) or a bare `TOKEN` (named `token-` + the first 8 hex digits of
its SHA-256, which does not reveal it); one per line in a file, separated by
commas or newlines in a variable; `#` starts a comment line. A file is re-read
when it changes, so tokens rotate (and revoked tokens stop working) without a
restart. A file that becomes unreadable or malformed fails closed: every
token is refused (TokensUnusable) and the error is logged until the file is
fixed, rather than keeping tokens the operator may have meant to revoke.

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

from common.watched_file import WatchedFile

log = logging.getLogger(__name__)

CLIENT_TOKENS_ENV = "UNDERCURRENT_CLIENT_TOKENS"
ADMIN_TOKENS_ENV = "UNDERCURRENT_ADMIN_TOKENS"
MIN_TOKEN_CHARS = 16
_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


class TokenConfigError(ValueError):
    """A token source is missing, empty or malformed (names the source and line)."""


class TokensUnusable(RuntimeError):
    """The token file broke after start-up: no token is accepted until it is fixed."""


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
    _file: WatchedFile | None = field(default=None, init=False, repr=False)
    _text: str | None = field(default=None, init=False, repr=False)
    _broken: str | None = field(default=None, init=False, repr=False)

    @classmethod
    def from_file(cls, label: str, path: Path) -> "TokenSet":
        """Raises TokenConfigError when the file cannot be used (start-up fails)."""
        tokens = cls(label, path=Path(path))
        tokens._file = WatchedFile(tokens.path)
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

    def _load_file(self) -> None:
        source = f"--{self.label}-tokens-file {self.path}"
        try:
            text = self._file.read()
        except (OSError, UnicodeDecodeError) as err:
            raise TokenConfigError(f"{source}: {getattr(err, 'strerror', None) or err}") from None
        if text != self._text:
            self._set(parse_entries(text, source))
            self._text = text

    def _refresh(self) -> None:
        """Re-reads a changed (or not yet settled) file; a file that cannot be
        used makes every token fail until it is fixed (logged)."""
        if self._file is None or not self._file.changed():
            return
        try:
            before = self._text
            self._load_file()
        except TokenConfigError as err:
            self._text, self._tokens = None, []
            if self._broken != str(err):
                self._broken = str(err)
                log.error("%s; refusing every %s token until it is fixed", err, self.label)
            return
        if self._broken is not None or self._text != before:
            self._broken = None
            log.info("%s tokens reloaded from %s (%d tokens)", self.label, self.path, len(self._tokens))

    def caller_of(self, token: str) -> str | None:
        """The caller's name when the token is one of the set, else None (constant time
        in the token's content: every entry is compared, with compare_digest).
        Raises TokensUnusable while the token file is broken."""
        self._refresh()
        if self._broken is not None:
            raise TokensUnusable(self._broken)
        presented = token.encode()
        found = None
        for candidate, name in self._tokens:
            if hmac.compare_digest(candidate, presented) and found is None:
                found = name
        return found
