"""TLS on the client side of duckd's API: which certificates a client trusts for a
daemon, a daemon certificate pinned by its SHA-256 fingerprint, and the words for a
handshake that failed.

A daemon with daemon.tls on writes its certificate's path and fingerprint to its runtime
file; a client on the same host trusts that certificate as the root of the chain (so a
self-signed one and an operator's CA-signed one both verify), once the file's fingerprint
is the one the daemon announced. From another host: --ca FILE (the daemon's certificate,
or the CA that signed it) and/or --fingerprint SHA256 (the certificate the daemon must
present). A mismatch is an error; nothing falls back to plaintext.
"""
from __future__ import annotations

import hashlib
import re
import socket
import ssl
from dataclasses import dataclass

import grpc

_PEM_CERT = re.compile(rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.S)


class TlsError(RuntimeError):
    """A certificate that could not be read, or not the one expected; the message says which."""


def fingerprint(der: bytes) -> str:
    """SHA-256 of a DER certificate, as `openssl x509 -noout -fingerprint -sha256` prints it."""
    return ":".join(f"{b:02X}" for b in hashlib.sha256(der).digest())


def normalize_fingerprint(text: str) -> str:
    """An operator's fingerprint ("sha256:", colons, spaces and case optional) in fingerprint()'s form."""
    digits = re.sub(r"^sha-?256[:=]?|[:\s]", "", text.strip(), flags=re.I).upper()
    if not re.fullmatch(r"[0-9A-F]{64}", digits):
        raise TlsError(f"fingerprint {text!r}: expected the certificate's SHA-256, 64 hex digits (colons optional), "
                       "as duckd logs it at start")
    return ":".join(digits[i:i + 2] for i in range(0, 64, 2))


def certificates(pem: bytes) -> list[bytes]:
    """The DER certificates of a PEM file's text, in order."""
    return [ssl.PEM_cert_to_DER_cert(m.group().decode("ascii")) for m in _PEM_CERT.finditer(pem)]


def read_certificates(path: str, what: str) -> bytes:
    """A PEM file of at least one certificate; `what` names its origin in errors."""
    try:
        with open(path, "rb") as f:
            pem = f.read()
    except OSError as e:
        raise TlsError(f"{what} {path}: cannot read it ({e.strerror})") from None
    if not certificates(pem):
        raise TlsError(f"{what} {path}: no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)")
    return pem


def fetch_certificate(address: str, timeout: float = 5.0) -> bytes:
    """The DER certificate the daemon at host:port presents, not yet trusted: only its
    fingerprint decides whether it is."""
    host, _, port = address.rpartition(":")
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    probe.check_hostname, probe.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as sock:
            with probe.wrap_socket(sock) as conn:
                return conn.getpeercert(binary_form=True)
    except ssl.SSLError as e:
        raise TlsError(f"duckd at {address} did not answer TLS ({e.reason or e}): is daemon.tls on there?") from None
    except (OSError, ValueError) as e:
        raise TlsError(f"cannot reach duckd at {address} to check its certificate: {e}") from None


def _certificate_name(der: bytes) -> str:
    """A name the certificate answers to: its first DNS or IP subject alt name, else its CN."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    cert = x509.load_der_x509_certificate(der)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns, ips = names.get_values_for_type(x509.DNSName), names.get_values_for_type(x509.IPAddress)
        if dns or ips:
            return dns[0] if dns else str(ips[0])
    except x509.ExtensionNotFound:
        pass
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(cns[0].value) if cns else ""


@dataclass(frozen=True, slots=True)
class ClientTls:
    """What a client trusts for one daemon."""
    roots: bytes            # PEM certificates the daemon's chain must end in
    source: str             # where they came from, for messages
    server_name: str = ""   # checked against the certificate instead of the address's host ("": the host)

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.roots)

    def grpc_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTPS (urllib, the openai client's verify=)."""
        ctx = ssl.create_default_context(cadata=self.roots.decode("ascii"))
        ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN    # the daemon's own certificate as the root, like gRPC
        if self.server_name:            # pinned by fingerprint: the name in it is not what is trusted
            ctx.check_hostname = False
        return ctx


def resolve(address: str, ca_file: str | None, pin: str | None, cert_file: str | None,
            cert_fingerprint: str | None) -> ClientTls | None:
    """The TLS of a client of the daemon at `address`, or None for plaintext.

    ca_file and pin are the operator's (--ca, --fingerprint); cert_file and cert_fingerprint
    the daemon's own, from its runtime file (or its config's certificate path, no fingerprint).
    """
    tls = None
    if ca_file:
        tls = ClientTls(read_certificates(ca_file, "--ca"), f"--ca {ca_file}")
    elif cert_file:
        roots = read_certificates(cert_file, "the daemon's certificate")
        found = fingerprint(certificates(roots)[0])
        if cert_fingerprint and found != normalize_fingerprint(cert_fingerprint):
            raise TlsError(f"the daemon's certificate {cert_file} has SHA-256 fingerprint {found}, but the daemon "
                           f"announced {cert_fingerprint} in its runtime file: the file changed after duckd started; "
                           "restart duckd, or pass --ca / --fingerprint")
        tls = ClientTls(roots, f"the daemon's certificate {cert_file}")
    if pin:
        want = normalize_fingerprint(pin)
        der = fetch_certificate(address)
        if fingerprint(der) != want:
            raise TlsError(f"duckd at {address} presented a certificate with SHA-256 fingerprint {fingerprint(der)}, "
                           f"not the pinned {want}: another server, or the daemon's certificate changed (duckd "
                           "logs its fingerprint at start); nothing was sent")
        if tls is None:     # the pinned certificate is the root: the handshake proves the daemon holds its key
            tls = ClientTls(ssl.DER_cert_to_PEM_cert(der).encode("ascii"), f"--fingerprint {want}",
                            _certificate_name(der))
    return tls


def explain(details: str, tls: ClientTls | None, address: str) -> str | None:
    """A failed call's gRPC details in the operator's words, where the failure is TLS's."""
    text = details or ""
    if "CERTIFICATE_VERIFY_FAILED" in text:
        why = text.rsplit("CERTIFICATE_VERIFY_FAILED", 1)[-1].removesuffix(": OK").strip(": ") or "not verified"
        trusted = tls.source if tls else "this client"
        return (f"TLS: duckd at {address} presented a certificate that {trusted} does not vouch for ({why}); "
                "pass the daemon's certificate with --ca, or pin it with --fingerprint")
    if "Hostname Verification Check failed" in text:
        host = address.rpartition(":")[0]
        return (f"TLS: the certificate of duckd at {address} does not name {host}; connect by a name it has "
                "(duckd logs them when it makes its certificate), or pin it with --fingerprint")
    if tls is not None and ("WRONG_VERSION_NUMBER" in text or "Tls handshake failed" in text
                            or "Handshake failed" in text):
        return f"TLS: the handshake with duckd at {address} failed ({text.strip()}); is daemon.tls on there?"
    if tls is None and ("Socket closed" in text or "Connection reset" in text):
        return (f"duckd at {address} closed the connection ({text.strip()}); if it serves TLS (daemon.tls), "
                "connect with its runtime file, --ca FILE or --fingerprint SHA256")
    return None
