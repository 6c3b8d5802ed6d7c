"""Certificates of the tests' own for duckd's TLS: a CA, and server certificates it signs
(RunningDaemon itself trusts a TLS daemon's certificate through its runtime file)."""
from __future__ import annotations

import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def make_ca(folder: Path, name: str = "test CA") -> tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A CA of the test's own: its certificate file, key and certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = _builder(subject, subject, key.public_key(), days=30) \
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(key, hashes.SHA256())
    path = folder / f"{name.replace(' ', '_')}.crt"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return path, key, cert


def issue(folder: Path, ca_key, ca_cert: x509.Certificate, names: list[str], days: int = 30) -> tuple[Path, Path]:
    """A server certificate for `names` signed by the CA: (certificate file, key file)."""
    import ipaddress
    key = ec.generate_private_key(ec.SECP256R1())
    sans = []
    for n in names:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(n)))
        except ValueError:
            sans.append(x509.DNSName(n))
    cert = _builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]), ca_cert.subject,
                    key.public_key(), days) \
        .add_extension(x509.SubjectAlternativeName(sans), critical=False).sign(ca_key, hashes.SHA256())
    cert_file, key_file = folder / "server.crt", folder / "server.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return cert_file, key_file


def _builder(subject, issuer, public_key, days: int) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=60))      # days < 0: expired
            .not_valid_after(now + datetime.timedelta(days=days)))
