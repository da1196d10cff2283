"""Development certificates, each for its role only:
`python -m common.devcerts --out DIR --engine engine --router router --client operator`.

A run makes a fresh CA, signs one certificate per name with it, writes
DIR/ca.pem and never writes the CA's key: no file, volume or container ever
holds it. A later run keeps the certificates it finds (all present, signed by
one CA, valid for more than RENEW_BEFORE_DAYS more days), so clients keep
trusting the same CA; otherwise, or with `--renew`, it replaces every
certificate at once with a new CA's.

A certificate carries the extended key usage and the names of its role:
  engine  server and client auth (it serves clients and dials routers as a client);
          DNS names: the name and its Kubernetes service names
  router  server auth only; the same kinds of names
  client  client auth only; the name as its common name (its identity), no DNS names
The Kubernetes names are NAME.NAMESPACE.svc, NAME.NAMESPACE.svc.cluster.local
and the headless `*.NAME...` forms, per `--namespaces`. `--loopback NAMES`
adds `localhost`, 127.0.0.1 and ::1 to those server certificates: services
that clients reach on this machine by those names (a port published on the
host's loopback).

`--client-tokens demo,operator --admin-tokens operator` also write the token
files (NAME:TOKEN per line, random tokens; an existing file is kept, so
callers keep their tokens across runs). With `--per-service`, DIR holds one
directory per certificate with only what that party needs: its certificate,
key and ca.pem, and the engine's also client-tokens, the router's
admin-tokens, and a client's its own tokens (client-token, admin-token).

For development and tests only. Production certificates come from the
cluster's issuer (cert-manager; see docs/security.md).
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
RENEW_BEFORE_DAYS = 30
LOOPBACK_NAMES = ("localhost",)
LOOPBACK_IPS = ("127.0.0.1", "::1")

ENGINE, ROUTER, CLIENT = "engine", "router", "client"
ROLE_USAGES = {
    ENGINE: (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH),
    ROUTER: (ExtendedKeyUsageOID.SERVER_AUTH,),
    CLIENT: (ExtendedKeyUsageOID.CLIENT_AUTH,),
}
CLIENT_TOKENS_FILE, ADMIN_TOKENS_FILE = "client-tokens", "admin-tokens"


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


def service_dns_names(name: str, namespaces: list[str], loopback: bool = False) -> list[str]:
    """The names a service is dialled by: compose (the name), Kubernetes services
    and the pods of a headless service, and localhost when asked."""
    names = [name, *(LOOPBACK_NAMES if loopback else ())]
    for namespace in namespaces:
        for suffix in (f"{namespace}.svc", f"{namespace}.svc.cluster.local"):
            names += [f"{name}.{suffix}", f"*.{name}.{suffix}"]
    return list(dict.fromkeys(names))


def make_cert(ca_key, ca_cert, common_name: str, dns_names: list[str], ip_addresses=LOOPBACK_IPS,
              days: float = DEFAULT_DAYS, not_before: dt.datetime | None = None,
              usages=ROLE_USAGES[ENGINE]):
    """A leaf certificate signed by the CA with these extended key usages (by
    default server and client auth): (private key, certificate)."""
    key = _key()
    start, end = _validity(days, not_before)
    san = [x509.DNSName(n) for n in dns_names] + [
        x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses
    ]
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def role_cert(ca_key, ca_cert, name: str, role: str, namespaces: list[str], loopback: bool = False,
              days: float = DEFAULT_DAYS):
    """The certificate of `name` in `role`: its role's usages and names only."""
    if role == CLIENT:
        return make_cert(ca_key, ca_cert, name, [], (), days, usages=ROLE_USAGES[CLIENT])
    return make_cert(ca_key, ca_cert, name, service_dns_names(name, namespaces, loopback),
                     LOOPBACK_IPS if loopback else (), days, usages=ROLE_USAGES[role])


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


def read_tokens(path: Path) -> dict[str, str]:
    """{name: token} of a token file written by write_tokens."""
    return dict(line.split(":", 1) for line in path.read_text().split())


def _names(value: str) -> list[str]:
    return [n.strip() for n in value.split(",") if n.strip()]


def generate(out: Path, roles: dict[str, str], namespaces: list[str] | None = None,
             days: float = DEFAULT_DAYS, loopback: tuple[str, ...] = (), per_service: bool = False) -> list[str]:
    """Writes ca.pem of a fresh CA, whose key is dropped, and NAME.pem, NAME.key
    for every {name: role} (the names in `loopback` also for localhost): all in
    `out`, or with per_service each name's pair and a ca.pem in out/NAME.
    Returns the files written, relative to out."""
    out.mkdir(parents=True, exist_ok=True)
    namespaces = ["default"] if namespaces is None else namespaces
    ca_key, ca_cert = make_ca(days=days)
    homes = {name: out / name if per_service else out for name in roles}
    written = []
    for home in dict.fromkeys(homes.values()):
        home.mkdir(exist_ok=True)
        write_atomically(home / "ca.pem", cert_pem(ca_cert))
        written.append(str((home / "ca.pem").relative_to(out)))
    for name, role in roles.items():
        write_pair(homes[name], name, *role_cert(ca_key, ca_cert, name, role, namespaces, name in loopback, days))
        written += [str((homes[name] / f"{name}.{suffix}").relative_to(out)) for suffix in ("pem", "key")]
    return written


def issued(out: Path, roles: dict[str, str], per_service: bool = False) -> bool:
    """True when `out` holds every name's certificate and key and a ca.pem,
    all of one CA, each valid for more than RENEW_BEFORE_DAYS more days."""
    now = dt.datetime.now(dt.timezone.utc)
    cas = set()
    for name in roles:
        home = out / name if per_service else out
        try:
            ca_pem = (home / "ca.pem").read_bytes()
            ca = x509.load_pem_x509_certificate(ca_pem)
            cert = x509.load_pem_x509_certificate((home / f"{name}.pem").read_bytes())
            if not (home / f"{name}.key").is_file():
                return False
            cert.verify_directly_issued_by(ca)
        except (OSError, ValueError, TypeError):
            return False
        if min(cert.not_valid_after_utc, ca.not_valid_after_utc) - now < dt.timedelta(days=RENEW_BEFORE_DAYS):
            return False
        cas.add(ca_pem)
    return len(cas) == 1


# Which role checks each token file: with per_service it is kept in their directories.
TOKEN_CHECKERS = {CLIENT_TOKENS_FILE: ENGINE, ADMIN_TOKENS_FILE: ROUTER}
# A client's own copy of its token, with per_service.
OWN_TOKEN_FILES = {CLIENT_TOKENS_FILE: "client-token", ADMIN_TOKENS_FILE: "admin-token"}


def write_token_files(out: Path, roles: dict[str, str], callers: dict[str, list[str]],
                      per_service: bool = False) -> list[str]:
    """Token files for {file name: caller names}; an existing one is kept (callers
    keep their tokens across runs). With per_service each file goes to the
    directories of the role that checks it, and every client's own tokens to
    its directory. Returns the files written, relative to out."""
    written = []
    for filename, names in callers.items():
        if per_service:
            homes = [out / n for n, r in roles.items() if r == TOKEN_CHECKERS[filename]]
        else:
            homes = [out]
        present = [home / filename for home in homes if (home / filename).exists()]
        if not present and names:
            if not homes:
                raise ValueError(f"{filename}: no {TOKEN_CHECKERS[filename]} certificate's directory to hold it")
            write_tokens(homes[0] / filename, names)
            written.append(str((homes[0] / filename).relative_to(out)))
            present = [homes[0] / filename]
        if not present:
            continue
        for target in (home / filename for home in homes):
            if not target.exists():
                write_atomically(target, present[0].read_bytes(), 0o600)
                written.append(str(target.relative_to(out)))
        if per_service:
            tokens = read_tokens(present[0])
            for name, role in roles.items():
                if role == CLIENT and name in tokens:
                    write_atomically(out / name / OWN_TOKEN_FILES[filename], tokens[name].encode(), 0o600)
                    written.append(f"{name}/{OWN_TOKEN_FILES[filename]}")
    return written


def main(argv: list[str] | None = None) -> int:
    from common.cli import OneLineErrorParser

    parser = OneLineErrorParser(prog="python -m common.devcerts", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the PEM files")
    parser.add_argument("--engine", default="", metavar="NAMES", help="engine certificates (comma-separated)")
    parser.add_argument("--router", default="", metavar="NAMES", help="router certificates")
    parser.add_argument("--client", default="", metavar="NAMES",
                        help="client certificates (operators calling ProbeAdmin)")
    parser.add_argument("--namespaces", default="default",
                        help="Kubernetes namespaces whose service names the server certificates cover")
    parser.add_argument("--loopback", default="", metavar="NAMES",
                        help="server certificates that also name localhost, 127.0.0.1 and ::1")
    parser.add_argument("--days", type=float, default=DEFAULT_DAYS, help="validity in days")
    parser.add_argument("--client-tokens", default="", metavar="NAMES",
                        help="comma-separated callers: write client-tokens unless it exists")
    parser.add_argument("--admin-tokens", default="", metavar="NAMES",
                        help="comma-separated operators: write admin-tokens unless it exists")
    parser.add_argument("--per-service", action="store_true",
                        help="one directory per certificate, with only what that party needs")
    parser.add_argument("--renew", action="store_true",
                        help="issue a new CA and certificates even when valid ones are in place")
    args = parser.parse_args(argv)
    roles = {name: role for role in (ENGINE, ROUTER, CLIENT) for name in _names(getattr(args, role))}
    if not roles:
        parser.error("--engine, --router, --client: give at least one name")
    bad = [n for n in roles if not n.replace("-", "").replace(".", "").isalnum()]
    if bad:
        parser.error(f"{bad[0]!r} is not a DNS name")
    loopback = tuple(_names(args.loopback))
    if unknown := [n for n in loopback if roles.get(n) not in (ENGINE, ROUTER)]:
        parser.error(f"--loopback: {unknown[0]!r} is not an --engine or --router certificate")
    callers = {CLIENT_TOKENS_FILE: _names(args.client_tokens), ADMIN_TOKENS_FILE: _names(args.admin_tokens)}
    for filename, names in callers.items():
        bad = [n for n in names if ":" in n or not n.isprintable() or " " in n]
        if bad:
            parser.error(f"--{filename}: {bad[0]!r} is not a caller name (no ':' or spaces)")
        if names and args.per_service and TOKEN_CHECKERS[filename] not in roles.values():
            parser.error(f"--{filename}: with --per-service they are kept with the "
                         f"--{TOKEN_CHECKERS[filename]} that checks them; give one")
    if not args.renew and issued(args.out, roles, args.per_service):
        written = write_token_files(args.out, roles, callers, args.per_service)
        print(f"kept the certificates in {args.out} (--renew replaces them)"
              + (f"; wrote {', '.join(written)}" if written else ""))
        return 0
    written = generate(args.out, roles, _names(args.namespaces), args.days, loopback, args.per_service)
    written += write_token_files(args.out, roles, callers, args.per_service)
    print(f"wrote {', '.join(written)} to {args.out} (a new CA; its key was not kept)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
