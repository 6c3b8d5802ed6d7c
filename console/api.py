"""The console's handle on duckd: one authenticated grpc.aio channel and the
stubs of proto/duck.proto, plus the words an operator reads when a call fails.

Discovery and the channel are duck_proto.client's; nothing here knows duckd.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc

from duck_proto import client
from duck_proto import duck_pb2_grpc as rpc
from duck_proto.tls import explain

log = logging.getLogger("console.api")


@dataclass(frozen=True, slots=True)
class Connection:
    """What the banner shows: status is connecting, connected, lost or auth."""
    status: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class ActionOutcome:
    """How an operator's action on a duck (restart, invalidate) ended."""
    action: str
    duck_id: int
    ok: bool
    text: str


class DaemonApi:
    """Stubs over one channel; `reopen()` starts a fresh channel (and re-reads the
    daemon's runtime file when that is where the endpoint came from, since a restarted
    daemon may listen elsewhere with a new token)."""

    def __init__(self, endpoint: client.Endpoint, rediscover=None):
        self.endpoint = endpoint
        self._rediscover = rediscover
        self._channel: grpc.aio.Channel | None = None
        self._open()

    def _open(self) -> None:
        self._channel = client.channel(self.endpoint)
        self.fleet = rpc.FleetStub(self._channel)
        self.cache = rpc.CacheStub(self._channel)
        self.chat = rpc.ChatStub(self._channel)
        self.model = rpc.ModelStub(self._channel)

    async def reopen(self) -> None:
        await self.close()
        if self._rediscover is not None:
            try:
                self.endpoint = self._rediscover()
            except client.DiscoveryError as e:
                log.info("rediscovery failed, keeping %s: %s", self.endpoint.address, e)
        self._open()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def describe_error(e: grpc.aio.AioRpcError, endpoint: client.Endpoint) -> Connection:
    """The banner for a failed call: auth and TLS failures are told apart from a lost daemon."""
    code = e.code()
    if "CERTIFICATE_VERIFY_FAILED" in (e.details() or ""):   # not the daemon's certificate: retrying will not help
        return Connection("auth", explain(e.details(), endpoint.tls, endpoint.address))
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return Connection("auth", f"authentication failed: duckd at {endpoint.address} refused the token "
                                  f"from {endpoint.source} ({e.details()}); pass --token or set DUCK_TOKEN")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
        return Connection("lost", f"no connection to duckd at {endpoint.address}: {e.details() or code.name}")
    return Connection("lost", f"duckd at {endpoint.address} answered {code.name}: {e.details()}")


def call_error_text(e: grpc.aio.AioRpcError) -> str:
    """One line for a failed action (restart, invalidate, chat)."""
    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
        return f"authentication failed: {e.details()}"
    return f"{e.code().name}: {e.details()}"
