"""Throw-away certificates for the local stack's TLS tests: a CA, servers and clients.

Generated at test time with ``cryptography`` (a test dependency), written as PEM
files. Keys are unencrypted PKCS#8, the form both Kafka's PEM keystores and
gRPC accept. Nothing here is meant for production.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID_FOR = datetime.timedelta(days=2)


@dataclass(frozen=True, slots=True)
class CertFiles:
    """PEM files of one identity: its certificate, its key, and both (key first) in one file."""

    cert: Path
    key: Path
    bundle: Path


@dataclass(frozen=True, slots=True)
class LocalPki:
    """A CA and the identities it signed, all under one folder."""

    ca_cert: Path
    server: CertFiles
    client: CertFiles
    other_ca_cert: Path  # a CA that signed nothing here: trusting it alone must fail


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    *,
    server: bool,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    now = datetime.datetime.now(datetime.UTC)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
    )
    if server:
        builder = builder.add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
    return key, builder.sign(ca_key, hashes.SHA256())


def _write(
    folder: Path, name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate
) -> CertFiles:
    files = CertFiles(folder / f"{name}.crt", folder / f"{name}.key", folder / f"{name}.pem")
    files.cert.write_bytes(_cert_pem(cert))
    files.key.write_bytes(_key_pem(key))
    files.key.chmod(0o600)
    files.bundle.write_bytes(_key_pem(key) + _cert_pem(cert))
    files.bundle.chmod(0o600)
    return files


def make_pki(folder: Path) -> LocalPki:
    """A CA, a server certificate for localhost/127.0.0.1, a client certificate, another CA."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("kafka-triton-worker test CA")
    ca_path = folder / "ca.crt"
    ca_path.write_bytes(_cert_pem(ca_cert))
    server = _write(folder, "server", *_leaf(ca_key, ca_cert, "localhost", server=True))
    client = _write(folder, "client", *_leaf(ca_key, ca_cert, "worker", server=False))
    _, other_cert = _ca("an unrelated CA")
    other_path = folder / "other-ca.crt"
    other_path.write_bytes(_cert_pem(other_cert))
    return LocalPki(ca_path, server, client, other_path)
