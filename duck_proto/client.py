"""The client side of duckd's API, shared by duckctl and duck-console: where
the daemon is and its token (arguments, environment, config file, or the
runtime file a running daemon writes), its TLS (duck_proto.tls), and an
authenticated channel.

Order of precedence: explicit arguments > DUCK_ADDRESS / DUCK_TOKEN >
the config file (--config or $DUCK_CONFIG: daemon.listen, daemon.token or
daemon.token_file) > the runtime file <state dir>/duckd.json of a daemon
running with the default state dir. TLS: --ca / --fingerprint (DUCK_CA /
DUCK_TLS_FINGERPRINT), else the daemon's certificate as its runtime file (or
its config's daemon.tls) names it; a daemon with neither is plaintext.
"""
from __future__ import annotations

import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import grpc

from duck_proto.tls import ClientTls, TlsError, resolve

RUNTIME_FILE = "duckd.json"
DEFAULT_LISTEN = "127.0.0.1:7433"


class DiscoveryError(RuntimeError):
    """No daemon address or token could be found; the message says where we looked."""


SYSTEM_STATE_DIR = Path("/var/lib/duckd")   # the systemd unit's StateDirectory (packaging/duckd.service)


def default_state_dir() -> Path:
    """Where duckd keeps its state when the config names none: systemd's StateDirectory
    under the unit, else the user's $XDG_STATE_HOME/duck (~/.local/state/duck)."""
    if os.environ.get("STATE_DIRECTORY"):
        return Path(os.environ["STATE_DIRECTORY"].split(":")[0])
    if os.geteuid() == 0 and os.environ.get("INVOCATION_ID"):   # a systemd service run as root
        return SYSTEM_STATE_DIR
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "duck"


def add_connection_arguments(ap) -> None:
    """--address, --token, --config, --ca, --fingerprint: duckctl's and duck-console's."""
    ap.add_argument("--address", help="duckd's gRPC host:port (default: $DUCK_ADDRESS, the config, or the runtime "
                                      "file of the running daemon)")
    ap.add_argument("--token", help="bearer token (default: $DUCK_TOKEN, the config, or the runtime file)")
    ap.add_argument("--config", help="duckd's config file, to find its address, token and certificate "
                                     "(default: $DUCK_CONFIG)")
    ap.add_argument("--ca", help="PEM file to trust for duckd's TLS certificate: its certificate (the "
                                 "<state_dir>/tls.crt it generated) or the CA that signed it (default: $DUCK_CA, "
                                 "else the daemon's own certificate as its runtime file names it)")
    ap.add_argument("--fingerprint", help="the SHA-256 fingerprint duckd's certificate must have, as duckd logs it "
                                          "at start (default: $DUCK_TLS_FINGERPRINT); implies TLS")


def discover_from(args) -> "Endpoint":
    """The endpoint of add_connection_arguments' parsed arguments."""
    return discover(args.address, args.token, args.config, ca=args.ca, fingerprint=args.fingerprint)


def join_option_values(argv: list[str], options: tuple[str, ...] = ("--token",)) -> list[str]:
    """`--token -x...` as `--token=-x...`: a token may begin with '-' (older duckd drew
    them from the URL-safe alphabet), which argparse would read as an option."""
    out, it = [], iter(argv)
    for a in it:
        if a in options:
            nxt = next(it, None)
            out.append(a if nxt is None else f"{a}={nxt}")
        else:
            out.append(a)
    return out


@dataclass(slots=True)
class Endpoint:
    address: str
    token: str
    source: str      # where it came from, for messages
    http_address: str = ""   # the OpenAI-compatible HTTP API's host:port, where known
    tls: ClientTls | None = None   # None: plaintext

    @property
    def http_url(self) -> str:
        """The HTTP API's base URL ("" where its address is not known)."""
        return f"{'https' if self.tls else 'http'}://{self.http_address}" if self.http_address else ""


def _from_config(path: Path) -> tuple[str | None, str | None, Path | None, str, str]:
    """listen, token, state_dir, http_listen and the certificate file where daemon.tls is on."""
    data = tomllib.loads(path.read_text())
    daemon = data.get("daemon", {})
    token = daemon.get("token") or None
    if not token and daemon.get("token_file"):
        token = Path(daemon["token_file"]).expanduser().read_text().strip()
    state = Path(daemon["state_dir"]).expanduser() if daemon.get("state_dir") else None
    http = daemon.get("http_listen", "")
    cert = ""
    if daemon.get("tls") is True:
        cert = str(Path(daemon["tls_cert"]).expanduser() if daemon.get("tls_cert")
                   else (state or default_state_dir()) / "tls.crt")
    return (daemon.get("listen"), token, state, http if isinstance(http, str) and not http.endswith(":0") else "",
            cert)


def _runtime_info(runtime: Path, address: str) -> dict:
    """A daemon's runtime file, if that file is the daemon at `address` ({} otherwise)."""
    try:
        info = json.loads(runtime.read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) and info.get("address") == address else {}


def discover(address: str | None = None, token: str | None = None, config: str | None = None,
             state_dir: str | os.PathLike | None = None, ca: str | None = None,
             fingerprint: str | None = None) -> Endpoint:
    address = address or os.environ.get("DUCK_ADDRESS") or None
    token = token or os.environ.get("DUCK_TOKEN") or None
    source = "arguments/environment"
    config = config or os.environ.get("DUCK_CONFIG")
    state = Path(state_dir) if state_dir else None
    http = cfg_cert = ""
    if config and (not address or not token):
        cfg_addr, cfg_token, cfg_state, http, cfg_cert = _from_config(Path(config))
        state = state or cfg_state
        runtime = (state or default_state_dir()) / RUNTIME_FILE
        if not runtime.exists() or (cfg_addr and not cfg_addr.endswith(":0")):
            # the address as configured (a port of 0 is only known to the running daemon)
            address = address or (cfg_addr if cfg_addr and not cfg_addr.endswith(":0") else None)
            token = token or cfg_token
            source = f"config {config}"
    runtime = (state or default_state_dir()) / RUNTIME_FILE
    if not address or not token:
        if state is None and not runtime.exists() and (SYSTEM_STATE_DIR / RUNTIME_FILE).exists():
            runtime = SYSTEM_STATE_DIR / RUNTIME_FILE    # duckd running as the system service
        try:
            info = json.loads(runtime.read_text())
            address = address or info["address"]
            token = token or Path(info["token_file"]).read_text().strip()
            source = f"runtime file {runtime}"
        except FileNotFoundError:
            raise DiscoveryError(f"no running duckd found: {runtime} does not exist; start duckd, or pass "
                                 "--address and --token (or DUCK_ADDRESS / DUCK_TOKEN)") from None
        except (KeyError, ValueError, OSError) as e:
            raise DiscoveryError(f"cannot read the daemon's runtime file {runtime}: {e}") from None
    # the runtime file of the daemon at that address (even one given): its HTTP port and certificate
    running = _runtime_info(runtime, address)
    http = running.get("http_address") or http
    try:
        tls = resolve(address, ca or os.environ.get("DUCK_CA"), fingerprint or os.environ.get("DUCK_TLS_FINGERPRINT"),
                      running.get("tls_cert") or cfg_cert, running.get("tls_fingerprint"))
    except TlsError as e:
        raise DiscoveryError(str(e)) from None
    return Endpoint(address, token, source, http, tls)


def channel(endpoint: Endpoint) -> grpc.aio.Channel:
    """An asyncio channel that sends the bearer token with every call: TLS where the
    endpoint has it, else plaintext (a daemon on loopback with daemon.tls off)."""
    # grpc.aio files each interceptor under one kind only: one object per kind
    return _open(endpoint, grpc.aio.insecure_channel, grpc.aio.secure_channel,
                 interceptors=[_UnaryAuth(endpoint.token), _StreamAuth(endpoint.token)])


def sync_channel(endpoint: Endpoint) -> grpc.Channel:
    return grpc.intercept_channel(_open(endpoint, grpc.insecure_channel, grpc.secure_channel),
                                  _SyncAuth(endpoint.token))


def _open(endpoint: Endpoint, insecure, secure, **kw):
    """The endpoint's channel by grpc's (or grpc.aio's) insecure_channel or secure_channel."""
    if endpoint.tls is None:
        return insecure(endpoint.address, **kw)
    return secure(endpoint.address, endpoint.tls.grpc_credentials(), options=endpoint.tls.grpc_options(), **kw)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready = d.credentials, getattr(d, "wait_for_ready", None)
        self.compression = getattr(d, "compression", None)


class _UnaryAuth(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(_aio_details(details, self.token), request)


class _StreamAuth(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(_aio_details(details, self.token), request)


def _aio_details(d, token):
    metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()))
    metadata.add("authorization", f"Bearer {token}")
    return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


class _SyncAuth(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str):
        self.token = token

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_Details(details, list(details.metadata or ()) + [("authorization", f"Bearer {self.token}")]),
                            request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_Details(details, list(details.metadata or ()) + [("authorization", f"Bearer {self.token}")]),
                            request)
