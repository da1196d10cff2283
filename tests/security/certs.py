"""Certificates for the security tests: a CA per test directory, leaf
certificates by name, expired ones, and files replaced the way rotation does."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from cryptography import x509

from common import devcerts
from common.security.tls import PemFiles


class CertFactory:
    """One CA in `directory`; `files(name, ...)` writes a leaf signed by it and
    returns (cert, key, this CA) paths."""

    def __init__(self, directory: Path, ca_name: str = "test CA"):
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_key, self.ca_cert = devcerts.make_ca(ca_name)
        devcerts.write_pair(directory, "ca", self.ca_key, self.ca_cert)

    @property
    def ca_path(self) -> Path:
        return self.directory / "ca.pem"

    def write(self, stem: str, dns_names=("localhost",), ip_addresses=("127.0.0.1",), expired=False) -> x509.Certificate:
        """Writes (or atomically replaces) STEM.pem and STEM.key; returns the certificate."""
        not_before = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3) if expired else None
        key, cert = devcerts.make_cert(self.ca_key, self.ca_cert, stem, list(dns_names), ip_addresses,
                                       days=1 if expired else 30, not_before=not_before)
        devcerts.write_pair(self.directory, stem, key, cert)
        return cert

    def files(self, stem: str, ca: Path | None = None, **options) -> PemFiles:
        self.write(stem, **options)
        return PemFiles(self.directory / f"{stem}.pem", self.directory / f"{stem}.key", ca or self.ca_path)
