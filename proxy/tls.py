"""Serving certificates: the configured pair, or a self-signed CA and a server certificate
generated under the cache directory on first start (clients trust the CA via SSL_CERT_FILE)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
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

log = logging.getLogger(__name__)
_CA_DAYS = 3650
_SERVER_DAYS = 825


@dataclass(frozen=True)
class ServingCertificate:
    """Files to serve with, and the CA clients should trust when we generated it."""

    cert: Path
    key: Path
    ca: Path | None


def server_names(server: ServerConfig) -> list[str]:
    """Names and addresses the generated certificate must cover."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    if server.host not in ("0.0.0.0", "::", ""):
        names.append(server.host)
    if server.public_url:
        public_host = urlsplit(server.public_url).hostname
        if public_host:
            names.append(public_host)
    return sorted(set(names))


def ensure_certificate(server: ServerConfig, cache_dir: Path) -> ServingCertificate:
    """The configured certificate, else the generated one (created or renewed as needed)."""
    if server.tls_cert is not None and server.tls_key is not None:
        return ServingCertificate(server.tls_cert, server.tls_key, None)
    tls_dir = cache_dir / "tls"
    tls_dir.mkdir(parents=True, exist_ok=True)
    ca_cert, ca_key, ca_names_file = tls_dir / "ca.pem", tls_dir / "ca-key.pem", \
        tls_dir / "ca-names.json"
    cert, key, names_file = tls_dir / "server.pem", tls_dir / "server-key.pem", \
        tls_dir / "server-names.json"
    names = server_names(server)
    ca_names = json.loads(ca_names_file.read_text()) if ca_names_file.exists() else []
    if not ca_cert.exists() or not ca_key.exists() or not set(names) <= set(ca_names):
        if ca_cert.exists():
            log.warning("the generated CA does not cover %s; creating a new one: clients must "
                        "trust the new %s", ", ".join(sorted(set(names) - set(ca_names))),
                        ca_cert)
        _write_ca(ca_cert, ca_key, names)
        ca_names_file.write_text(json.dumps(names))
        names_file.unlink(missing_ok=True)
    current = json.loads(names_file.read_text()) if names_file.exists() else None
    if current != names or not cert.exists() or not key.exists() or _expires_soon(cert):
        _write_server(ca_cert, ca_key, cert, key, names)
        names_file.write_text(json.dumps(names))
    return ServingCertificate(cert, key, ca_cert)


def ssl_context(certificate: ServingCertificate) -> ssl.SSLContext:
    """Server-side TLS context (TLS 1.2+)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(certificate.cert), str(certificate.key))
    return context


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _general_names(names: list[str]) -> list[x509.GeneralName]:
    general: list[x509.GeneralName] = []
    for name in names:
        try:
            general.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            general.append(x509.DNSName(name))
    return general


def _write_ca(cert_path: Path, key_path: Path, names: list[str]) -> None:
    """A CA that can only vouch for this proxy's own names (RFC 5280 name constraints): a
    machine that trusts it trusts nothing else, even if the CA key leaks from the cache."""
    key = ec.generate_private_key(ec.SECP256R1())
    permitted: list[x509.GeneralName] = []
    for general in _general_names(names):
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
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _write_server(ca_cert_path: Path, ca_key_path: Path, cert_path: Path, key_path: Path,
                  names: list[str]) -> None:
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_key_path} is not the EC key this proxy generated")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                    "tf-registry-proxy")]))
        .issuer_name(ca_cert.subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - datetime.timedelta(hours=1))
        .not_valid_after(_now() + datetime.timedelta(days=_SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_general_names(names)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                       critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _expires_soon(cert_path: Path) -> bool:
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    return cert.not_valid_after_utc - _now() < datetime.timedelta(days=30)
