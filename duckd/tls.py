"""duckd's TLS certificate, served by the gRPC and the HTTP API alike (daemon.tls).

The operator's (daemon.tls_cert and tls_key: PEM, the key unencrypted), or one duckd
generates on its first start with TLS: ECDSA P-256, self-signed, valid VALID_DAYS, naming
localhost, 127.0.0.1, ::1, this host's name and the addresses duckd binds. It lives in the
state folder beside the generated token (tls.crt, tls.key 0600) and is reused by later
starts; a new one is made, and the log says why, when it no longer names every address or
expires within RENEW_DAYS. Every start logs the certificate's SHA-256 fingerprint, and the
runtime file carries it with the certificate's path (duck_proto.tls checks both).

A certificate or key that cannot be read, is not PEM, has expired, or a key that is not
the certificate's is a ConfigError naming the file and the fix.
"""
from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from duck_proto.tls import fingerprint
from duckd.config import Config, ConfigError, DaemonConfig

log = logging.getLogger("duckd.tls")

CERT_FILE, KEY_FILE = "tls.crt", "tls.key"
VALID_DAYS = 3 * 365
RENEW_DAYS = 30
_WILDCARD = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class ServerCert:
    cert_file: Path
    key_file: Path
    chain_pem: bytes        # the certificate first, then any intermediates
    key_pem: bytes
    fingerprint: str        # SHA-256 of the certificate, colon-separated hex
    generated: bool


def server_cert(cfg: Config) -> ServerCert | None:
    """The certificate both APIs serve, or None where daemon.tls is off; its fingerprint is logged."""
    d = cfg.daemon
    if not d.tls:
        return None
    if d.tls_cert:
        cert = load(Path(d.tls_cert).expanduser(), Path(d.tls_key).expanduser(), "daemon.tls_cert", "daemon.tls_key")
        if cert.key_file.stat().st_mode & 0o077:
            log.warning("TLS key %s is readable by others than duckd's user: chmod 600 it", cert.key_file)
    else:
        cert = _generated(cfg.state_path, names_for(d))
    log.info("TLS on gRPC and HTTP: %s certificate %s, SHA-256 fingerprint %s",
             "generated" if cert.generated else "operator's", cert.cert_file, cert.fingerprint)
    return cert


def names_for(d: DaemonConfig) -> list[str]:
    """The names and addresses a client may reach this daemon by: loopback, the host's
    name and each configured bind address (a wildcard bind adds none: connect by the
    host's name, or pin the fingerprint)."""
    names = ["localhost", "127.0.0.1", "::1", socket.gethostname()]
    for listen in (d.listen, d.http_listen):
        host = listen.rpartition(":")[0].strip("[]")
        if host not in _WILDCARD:
            names.append(host)
    return list(dict.fromkeys(n.lower() for n in names if n))


def load(cert_file: Path, key_file: Path, cert_what: str, key_what: str) -> ServerCert:
    """A certificate and its key from PEM files, checked to belong together and to be in date;
    cert_what / key_what name them in errors (a config key, or "the generated certificate")."""
    chain_pem, key_pem = _read(cert_file, cert_what), _read(key_file, key_what)
    try:
        chain = x509.load_pem_x509_certificates(chain_pem)
    except ValueError:
        raise ConfigError(f"{cert_what} = {str(cert_file)!r}: not a PEM certificate "
                          "(expected -----BEGIN CERTIFICATE-----)") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        raise ConfigError(f"{key_what} = {str(key_file)!r}: the key is encrypted; duckd needs it unencrypted, "
                          "readable by duckd's user alone (openssl pkey -in KEY -out PLAIN)") from None
    except (ValueError, UnsupportedAlgorithm) as e:
        raise ConfigError(f"{key_what} = {str(key_file)!r}: not a PEM private key ({e})") from None
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    if chain[0].public_key().public_bytes(*spki) != key.public_key().public_bytes(*spki):
        raise ConfigError(f"{key_what} = {str(key_file)!r} is not the key of {cert_what} = {str(cert_file)!r} "
                          "(their public keys differ): give the key the certificate was issued for")
    now = datetime.datetime.now(datetime.timezone.utc)
    if chain[0].not_valid_after_utc <= now:
        raise ConfigError(f"{cert_what} = {str(cert_file)!r}: expired on {chain[0].not_valid_after_utc:%Y-%m-%d}; "
                          "renew it")
    der = chain[0].public_bytes(serialization.Encoding.DER)
    return ServerCert(cert_file, key_file, chain_pem, key_pem, fingerprint(der), generated=False)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} = {str(path)!r}: cannot read it ({e.strerror})") from None


def _generated(state: Path, names: list[str]) -> ServerCert:
    cert_file, key_file = state / CERT_FILE, state / KEY_FILE
    if cert_file.exists() or key_file.exists():
        try:
            cert = load(cert_file, key_file, "the generated certificate", "its key")
            why = _outdated(x509.load_pem_x509_certificate(cert.chain_pem), names)
        except ConfigError as e:
            why = str(e)
        if not why:
            if key_file.stat().st_mode & 0o077:
                key_file.chmod(0o600)
                log.warning("TLS key %s was readable by others: now 0600", key_file)
            return ServerCert(cert_file, key_file, cert.chain_pem, cert.key_pem, cert.fingerprint, generated=True)
        log.warning("making a new TLS certificate (the fingerprint changes): %s", why)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _self_signed(key, names)
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    _write_private(key_file, key_pem, 0o600)
    _write_private(cert_file, cert_pem, 0o644)
    log.info("made a TLS certificate %s for %s (key %s, 0600)", cert_file, ", ".join(names), key_file)
    return ServerCert(cert_file, key_file, cert_pem, key_pem,
                      fingerprint(cert.public_bytes(serialization.Encoding.DER)), generated=True)


def _outdated(cert: x509.Certificate, names: list[str]) -> str:
    """Why a generated certificate must be made again ("" while it serves)."""
    left = cert.not_valid_after_utc - datetime.datetime.now(datetime.timezone.utc)
    if left < datetime.timedelta(days=RENEW_DAYS):
        return f"it expires on {cert.not_valid_after_utc:%Y-%m-%d}"
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "it names no address"
    have = {n.lower() for n in sans.get_values_for_type(x509.DNSName)}
    have |= {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    missing = [n for n in names if str(_san(n).value).lower() not in have]
    return f"it does not name {', '.join(missing)}" if missing else ""


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _self_signed(key: ec.EllipticCurvePrivateKey, names: list[str]) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"duckd on {socket.gethostname()}"[:64])])
    now = datetime.datetime.now(datetime.timezone.utc)
    spki = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (x509.CertificateBuilder()
            .subject_name(subject).issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))     # a client's clock a little behind
            .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
            .add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=False, content_commitment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(spki, critical=False)
            .sign(key, hashes.SHA256()))


def _write_private(path: Path, data: bytes, mode: int) -> None:
    """Written whole or not at all (a temp file renamed over), with `mode` from its creation."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
