"""Serving certificates: the configured pair, or a CA and a server certificate generated under
server.state_dir/tls on first start (clients trust the CA via SSL_CERT_FILE). Clients trust
that CA, so it is never replaced except by `tf-registry-proxy tls rotate`; the server
certificate is re-issued from it as needed (names, expiry), which clients do not notice."""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import logging
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from proxy.config import ServerConfig
from proxy.tls.state import StatePaths, state_lock, write_atomic

log = logging.getLogger(__name__)
_CA_DAYS = 3650
_SERVER_DAYS = 825
_RENEW_BEFORE = datetime.timedelta(days=30)
_CA_WARN_BEFORE = datetime.timedelta(days=90)
_ROTATE_HINT = ("run `tf-registry-proxy tls rotate` to create a new CA for the configured "
                "names, then give every client the new CA (SSL_CERT_FILE); or serve with a "
                "certificate of your own (server.tls_cert, server.tls_key)")


class TlsStateError(Exception):
    """The generated CA cannot serve this configuration; the message says what to do."""


@dataclass(frozen=True)
class ServingCertificate:
    """Files to serve with, and the CA clients should trust when we generated it."""

    cert: Path
    key: Path
    ca: Path | None


def generated_ca_path(server: ServerConfig) -> Path | None:
    """Where the generated CA is (or will be), unless the operator's certificate is used."""
    return None if server.tls_cert is not None else StatePaths(server.state_dir).ca_cert


def server_names(server: ServerConfig) -> list[str]:
    """Names and addresses a new CA and the server certificate cover."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    return sorted({_canonical(name) for name in names} | set(configured_names(server)))


def configured_names(server: ServerConfig) -> dict[str, str]:
    """The names the configuration says clients use, each with the key that names it: the
    CA must cover them all."""
    names: dict[str, str] = {}
    if server.host not in ("0.0.0.0", "::", ""):
        names[_canonical(server.host)] = "server.listen"
    if server.public_url:
        public_host = urlsplit(server.public_url).hostname
        if public_host:
            names[_canonical(public_host)] = "server.public_url"
    return names


def ensure_certificate(server: ServerConfig) -> ServingCertificate:
    """The configured certificate, else the generated one: the CA is created on first start
    only; the server certificate is (re-)issued from it when missing, expiring or naming
    other names. Raises TlsStateError when the CA does not cover the configured names."""
    if server.tls_cert is not None and server.tls_key is not None:
        return ServingCertificate(server.tls_cert, server.tls_key, None)
    paths = StatePaths(server.state_dir)
    with state_lock(paths):  # several workers or instances may start at once
        has_cert, has_key = paths.ca_cert.exists(), paths.ca_key.exists()
        if has_cert != has_key:
            present, missing = ((paths.ca_cert, paths.ca_key) if has_cert
                                else (paths.ca_key, paths.ca_cert))
            raise TlsStateError(f"{present} exists but {missing} does not: restore it, or "
                                f"{_ROTATE_HINT}")
        if not has_cert:
            _write_ca(paths, server_names(server))
            log.info("created a CA for this proxy at %s", paths.ca_cert)
        ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
        _check_ca(ca, paths.ca_cert, server)
        names = [name for name in server_names(server) if permits(ca, name)]
        if not _server_cert_current(paths, ca, names):
            _write_server(paths, names)
    return ServingCertificate(paths.server_cert, paths.server_key, paths.ca_cert)


def rotate_ca(server: ServerConfig) -> Path:
    """Replace the generated CA (and the server certificate) with a new one for the
    configured names; returns the new CA's path."""
    paths = StatePaths(server.state_dir)
    with state_lock(paths):
        _write_ca(paths, server_names(server))
        _write_server(paths, server_names(server))
    log.info("replaced the CA at %s", paths.ca_cert)
    return paths.ca_cert


def describe(server: ServerConfig) -> str:
    """The generated CA and server certificate: paths, names, expiry, fingerprint."""
    paths = StatePaths(server.state_dir)
    lines = []
    for title, path in (("CA", paths.ca_cert), ("server certificate", paths.server_cert)):
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            subtrees = cert.extensions.get_extension_for_class(x509.NameConstraints).value
            names = [str(n.value) for n in subtrees.permitted_subtrees or []]
        else:
            names = _san_names(cert)
        fingerprint = hashlib.sha256(cert.public_bytes(serialization.Encoding.DER)).hexdigest()
        lines += [f"{title}: {path}", f"  names: {', '.join(names)}",
                  f"  valid until: {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
                  f"  sha256 fingerprint: {fingerprint}"]
    return "\n".join(lines) + "\n"


def ssl_context(certificate: ServingCertificate) -> ssl.SSLContext:
    """Server-side TLS context (TLS 1.2+)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(certificate.cert), str(certificate.key))
    return context


def permits(ca: x509.Certificate, name: str) -> bool:
    """Whether the CA's name constraints (RFC 5280 4.2.1.10) allow it to vouch for name."""
    try:
        constraints = ca.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return True
    general = _general_name(name)
    if any(_within(general, s) for s in constraints.excluded_subtrees or []):
        return False
    of_type = [s for s in constraints.permitted_subtrees or [] if type(s) is type(general)]
    # A name type without permitted subtrees of its own is not constrained.
    return not of_type or any(_within(general, s) for s in of_type)


def _check_ca(ca: x509.Certificate, path: Path, server: ServerConfig) -> None:
    left = ca.not_valid_after_utc - _now()
    if left <= datetime.timedelta(0):
        raise TlsStateError(f"the generated CA {path} expired on "
                            f"{ca.not_valid_after_utc:%Y-%m-%d}: {_ROTATE_HINT}")
    outside = {name: key for name, key in configured_names(server).items()
               if not permits(ca, name)}
    if outside:
        named = ", ".join(f"{key} names {name}" for name, key in outside.items())
        covered = ", ".join(str(s.value) for s in ca.extensions.get_extension_for_class(
            x509.NameConstraints).value.permitted_subtrees or [])
        raise TlsStateError(f"{named}, which the generated CA {path} cannot vouch for (it "
                            f"covers only {covered}). Clients trust that CA, so it is not "
                            f"replaced automatically: {_ROTATE_HINT}")
    if left < _CA_WARN_BEFORE:
        log.warning("the generated CA %s expires on %s: %s", path,
                    f"{ca.not_valid_after_utc:%Y-%m-%d}", _ROTATE_HINT)


def _server_cert_current(paths: StatePaths, ca: x509.Certificate, names: list[str]) -> bool:
    if not paths.server_cert.exists() or not paths.server_key.exists():
        return False
    try:  # an unreadable server certificate is simply issued again
        cert = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
        same_key = _same_key(cert, paths.server_key)
    except ValueError:
        return False
    try:
        issued_by_ca = (cert.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier)
                        .value.key_identifier
                        == ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
                        .value.digest)
    except x509.ExtensionNotFound:
        issued_by_ca = False
    return (issued_by_ca and same_key
            and sorted(_san_names(cert)) == sorted(names)
            and cert.not_valid_after_utc - _now() > _RENEW_BEFORE)


def _same_key(cert: x509.Certificate, key_path: Path) -> bool:
    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    public = cert.public_key()
    return isinstance(key, ec.EllipticCurvePrivateKey) \
        and isinstance(public, ec.EllipticCurvePublicKey) \
        and key.public_key().public_numbers() == public.public_numbers()


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _canonical(name: str) -> str:
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name.lower().rstrip(".")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _within(name: x509.GeneralName, subtree: x509.GeneralName) -> bool:
    if isinstance(name, x509.IPAddress) and isinstance(subtree, x509.IPAddress):
        network = subtree.value
        return isinstance(network, ipaddress.IPv4Network | ipaddress.IPv6Network) \
            and name.value in network
    if isinstance(name, x509.DNSName) and isinstance(subtree, x509.DNSName):
        # A DNS constraint covers the name itself and every name below it.
        host, base = name.value.lower(), subtree.value.lower()
        return host.endswith(base) if base.startswith(".") \
            else host == base or host.endswith("." + base)
    return False


def _san_names(cert: x509.Certificate) -> list[str]:
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [*sans.get_values_for_type(x509.DNSName),
            *(str(ip) for ip in sans.get_values_for_type(x509.IPAddress))]


def _write_ca(paths: StatePaths, names: list[str]) -> None:
    """A CA that can only vouch for this proxy's own names (RFC 5280 name constraints): a
    machine that trusts it trusts nothing else, even if the CA key leaks."""
    key = ec.generate_private_key(ec.SECP256R1())
    permitted: list[x509.GeneralName] = []
    for general in map(_general_name, names):
        if isinstance(general, x509.IPAddress):
            permitted.append(x509.IPAddress(ipaddress.ip_network(general.value)))
        else:
            permitted.append(general)
    subject = x509.Name([x509.NameAttribute(
        NameOID.COMMON_NAME, f"tf-registry-proxy local CA ({socket.gethostname()})")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(hours=1))
        .not_valid_after(_now() + datetime.timedelta(days=_CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(x509.NameConstraints(permitted_subtrees=permitted,
                                            excluded_subtrees=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    # Key first: a crash in between leaves a key without a certificate, which is reported.
    write_atomic(paths.ca_key, _key_pem(key))
    write_atomic(paths.ca_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _write_server(paths: StatePaths, names: list[str]) -> None:
    ca_cert = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    ca_key = serialization.load_pem_private_key(paths.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{paths.ca_key} is not the EC key this proxy generated")
    key = ec.generate_private_key(ec.SECP256R1())
    # Never valid for longer than the CA that vouches for it.
    not_after = min(_now() + datetime.timedelta(days=_SERVER_DAYS), ca_cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                    "tf-registry-proxy")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(hours=1))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(list(map(_general_name, names))),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    write_atomic(paths.server_key, _key_pem(key))
    write_atomic(paths.server_cert, cert.public_bytes(serialization.Encoding.PEM), 0o644)
