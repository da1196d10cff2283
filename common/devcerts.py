"""A development CA and service certificates: `python -m common.devcerts --out DIR --names engine,router`.

Writes DIR/ca.pem (and ca.key), and for every name NAME.pem and NAME.key;
with `--client-tokens demo --admin-tokens operator`, also the token files
DIR/client-tokens and DIR/admin-tokens (NAME:TOKEN per line, random tokens;
an existing token file is kept, so callers keep their tokens across runs). Each
certificate is valid for the name itself, `localhost`, `127.0.0.1`, `::1`, the
compose service name (the name) and the Kubernetes service names
(NAME.NAMESPACE.svc, NAME.NAMESPACE.svc.cluster.local and the headless
`*.NAME...` forms), and carries both the server and the client
extended key usage, so the engine can present its certificate to routers.

For development and tests only: the CA key sits next to the certificates.
Production certificates come from the cluster's issuer (cert-manager; see
docs/security.md).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import secrets
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DEFAULT_DAYS = 365
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Undercurrent development"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _validity(days: float, not_before: dt.datetime | None) -> tuple[dt.datetime, dt.datetime]:
    start = not_before or dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)
    return start, start + dt.timedelta(days=days)


def make_ca(common_name: str = "Undercurrent development CA", days: float = DEFAULT_DAYS):
    """A self-signed CA: (private key, certificate)."""
    key = _key()
    start, end = _validity(days, None)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                          content_commitment=False, key_encipherment=False, data_encipherment=False,
                          key_agreement=False, encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def service_dns_names(name: str, namespaces: list[str]) -> list[str]:
    """The names a service is dialled by: compose (the name), Kubernetes services
    and the pods of a headless service, and localhost."""
    names = [name, *LOOPBACK_NAMES]
    for namespace in namespaces:
        for suffix in (f"{namespace}.svc", f"{namespace}.svc.cluster.local"):
            names += [f"{name}.{suffix}", f"*.{name}.{suffix}"]
    return list(dict.fromkeys(names))


def make_cert(ca_key, ca_cert, common_name: str, dns_names: list[str], ip_addresses=LOOPBACK_IPS,
              days: float = DEFAULT_DAYS, not_before: dt.datetime | None = None):
    """A leaf certificate signed by the CA, for both TLS servers and clients:
    (private key, certificate)."""
    key = _key()
    start, end = _validity(days, not_before)
    san = [x509.DNSName(n) for n in dns_names] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def key_pem(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def cert_pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def write_atomically(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replaces path in one rename, so a reader never sees half a file (rotation)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def write_pair(directory: Path, stem: str, key, cert) -> None:
    write_atomically(directory / f"{stem}.key", key_pem(key), 0o600)
    write_atomically(directory / f"{stem}.pem", cert_pem(cert))


def write_tokens(path: Path, names: list[str]) -> None:
    """A token file (NAME:TOKEN per line, the services' --*-tokens-file format)
    with a fresh random token per name; readable by its owner only."""
    lines = "".join(f"{name}:{secrets.token_urlsafe(24)}\n" for name in names)
    write_atomically(path, lines.encode(), 0o600)


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def generate(out: Path, names: list[str], namespaces: list[str] | None = None,
             days: float = DEFAULT_DAYS) -> None:
    """Writes a fresh CA and one certificate per name into out (reusing out/ca.* if present)."""
    out.mkdir(parents=True, exist_ok=True)
    namespaces = ["default"] if namespaces is None else namespaces
    if (out / "ca.key").exists() and (out / "ca.pem").exists():
        ca_key = serialization.load_pem_private_key((out / "ca.key").read_bytes(), None)
        ca_cert = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    else:
        ca_key, ca_cert = make_ca(days=days)
        write_pair(out, "ca", ca_key, ca_cert)
    for name in names:
        key, cert = make_cert(ca_key, ca_cert, name, service_dns_names(name, namespaces), days=days)
        write_pair(out, name, key, cert)


def main(argv: list[str] | None = None) -> int:
    from common.cli import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m common.devcerts", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the PEM files")
    parser.add_argument("--names", default="engine,router",
                        help="comma-separated service names, one certificate each (default engine,router)")
    parser.add_argument("--namespaces", default="default",
                        help="Kubernetes namespaces whose service names the certificates cover")
    parser.add_argument("--days", type=float, default=DEFAULT_DAYS, help="validity in days")
    parser.add_argument("--client-tokens", default="", metavar="NAMES",
                        help="comma-separated callers: write OUT/client-tokens unless it exists")
    parser.add_argument("--admin-tokens", default="", metavar="NAMES",
                        help="comma-separated operators: write OUT/admin-tokens unless it exists")
    args = parser.parse_args(argv)
    names = _names(args.names)
    if not names:
        parser.error("--names: give at least one name")
    bad = [n for n in names if not n.replace("-", "").replace(".", "").isalnum()]
    if bad:
        parser.error(f"--names: {bad[0]!r} is not a DNS name")
    token_files = {"client-tokens": _names(args.client_tokens), "admin-tokens": _names(args.admin_tokens)}
    for flag, callers in zip(("--client-tokens", "--admin-tokens"), token_files.values()):
        bad = [n for n in callers if ":" in n or not n.isprintable() or " " in n]
        if bad:
            parser.error(f"{flag}: {bad[0]!r} is not a caller name (no ':' or spaces)")
    generate(args.out, names, _names(args.namespaces), args.days)
    written = ["ca.pem", *(f"{n}.pem/{n}.key" for n in names)]
    for filename, callers in token_files.items():
        if callers and not (args.out / filename).exists():
            write_tokens(args.out / filename, callers)
            written.append(filename)
    print(f"wrote {', '.join(written)} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
