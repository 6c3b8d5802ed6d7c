"""`duckd`: the daemon's entry point and lifecycle: the gRPC API, the
OpenAI-compatible HTTP API with /metrics (daemon.http_listen), the fleet and the model.
With daemon.tls both APIs serve the certificate of duckd.tls.

Signal handlers only set events. The first SIGTERM (or SIGINT) drains: no
new calls, in-flight chats get shutdown_grace_s to finish (they are ended at
the next token shortly before it runs out, so their streams still close
cleanly), sessions close, spawned ducks stop, exit 0. A second one forces:
the process ends within FORCED_EXIT_S (5 s), whatever its engine is doing
(status 1 when it had to leave without the clean stop); a drain that has
not ended DRAIN_OVERRUN_S after its grace is forced the same way.
SIGHUP reloads what can change safely (log level, Watch interval, the chat
token limit). READY=1 goes to systemd once the fleet is SERVING and the API
is bound; WATCHDOG=1 keep-alives while the engine makes progress on the work
it holds (duckd.health: a stall turns the health checks to NOT_SERVING and
stops the keep-alives, so systemd restarts it); STOPPING=1 on the way out.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

from duckd.config import Config, ConfigError, load

log = logging.getLogger("duckd")

FORCED_EXIT_S = 5.0      # a second SIGTERM ends the process within this
DRAIN_OVERRUN_S = 15.0   # a drain still running this long after its grace is forced


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def resolve_token(cfg: Config) -> tuple[str, Path]:
    """The bearer token and the file a client reads it from."""
    state = cfg.state_path
    if cfg.daemon.token_file:
        path = Path(cfg.daemon.token_file).expanduser()
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise ConfigError(f"daemon.token_file = {str(path)!r}: cannot read it ({e.strerror})") from None
        if not token:
            raise ConfigError(f"daemon.token_file = {str(path)!r}: the file is empty")
        return token, path
    path = state / "token"
    token = cfg.daemon.token or (path.read_text().strip() if path.exists() else "") or secrets.token_hex(24)
    if path.exists() and path.stat().st_mode & 0o077:
        log.warning("token file %s was readable by others: rewritten 0600", path)
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, path


def claim_state_dir(state: Path):
    """The state folder, made private (0700) and held by this duckd alone: a lock on
    <state>/duckd.lock for the process's life (returned: keep it). Another duckd on the
    same folder, or a folder that cannot be written, is one line naming it."""
    import fcntl
    try:
        state.mkdir(parents=True, exist_ok=True)
        if state.stat().st_mode & 0o077:
            state.chmod(0o700)
            log.warning("state folder %s was readable by others: now 0700", state)
        lock = open(state / "duckd.lock", "a+")
    except OSError as e:
        raise OSError(f"state folder {state}: {e.strerror}; duckd needs to write there (set daemon.state_dir "
                      "to a writable folder)") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        other = lock.read().strip() or "?"
        lock.close()
        raise OSError(f"another duckd (pid {other}) uses the state folder {state}: stop it first, or give this "
                      "one another daemon.state_dir") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


async def run(cfg: Config, config_path: str | None) -> int:
    from duckd.daemon import Daemon
    from duckd.sdnotify import Notifier
    from duckd.server import ApiServer
    from duckd.tls import server_cert

    notifier = Notifier()
    os.umask(0o077)    # what duckd and its ducks write (token, key, caches, packs, logs) is theirs alone
    state_lock = claim_state_dir(cfg.state_path)  # noqa: F841 (held until the process exits)
    token, token_file = resolve_token(cfg)
    tls = server_cert(cfg)
    if cfg.daemon.allow_remote and tls is None:
        log.warning("daemon.allow_insecure_remote: the API takes remote connections without TLS; the bearer "
                    "token and every prompt cross the network in plaintext (set daemon.tls = true)")
    daemon = Daemon(cfg)
    server = ApiServer(daemon, cfg.daemon.listen, token, cfg.daemon.watch_interval_s, cfg.daemon.max_request_bytes,
                       tls)
    await server.start()
    http = None
    if cfg.daemon.http_listen:
        from duckd.http_api import HttpApi, HttpServer
        from duckd.metrics import Metrics
        http = HttpServer(HttpApi(daemon, token, Metrics(daemon), cfg.daemon.max_request_bytes), cfg.daemon.http_listen,
                          tls)
        await http.start()
    runtime = daemon.write_runtime_file(server.address, token_file, http.address if http else "", tls)
    loop = asyncio.get_running_loop()
    stop, force, hup = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def on_term(signame: str):
        if stop.is_set():
            log.warning("second %s: forcing shutdown (the process ends within %.0f s)", signame, FORCED_EXIT_S)
            force.set()
            _exit_after(FORCED_EXIT_S, f"the forced shutdown did not end within {FORCED_EXIT_S:.0f} s")
        else:
            log.info("%s: draining (grace %.0f s)", signame, cfg.daemon.shutdown_grace_s)
            stop.set()
            bound = cfg.daemon.shutdown_grace_s + DRAIN_OVERRUN_S
            _exit_after(bound, f"the drain did not end within {bound:.0f} s (grace + {DRAIN_OVERRUN_S:.0f} s)")
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_term, sig.name)
    loop.add_signal_handler(signal.SIGHUP, hup.set)

    code = 0
    starting = asyncio.create_task(daemon.start(), name="daemon-start")
    waiting = asyncio.create_task(stop.wait())
    await asyncio.wait([starting, waiting], return_when=asyncio.FIRST_COMPLETED)
    if starting.done() and starting.exception() is not None:
        log.error("start failed: %s", starting.exception())
        code = 1
        stop.set()
    elif starting.done():
        await server.set_serving(True)
        notifier.ready(f"serving {daemon.model.name} on {cfg.fleet.ducks} ducks at {server.address}")
        log.info("ready: %s on %d ducks, API at %s", daemon.model.name, cfg.fleet.ducks, server.address)
    side = [asyncio.create_task(_watchdog(notifier, daemon, server, stop)),
            asyncio.create_task(_reloader(hup, cfg, config_path))]

    await stop.wait()
    notifier.stopping()
    starting.cancel()
    grace = cfg.daemon.shutdown_grace_s
    await server.set_serving(False)
    # end running generations shortly before the grace runs out, so they close cleanly
    late = loop.call_later(max(0.0, grace - 1.0), daemon.stopping.set)
    stopping = asyncio.create_task(server.stop(grace))
    forced = asyncio.create_task(force.wait())
    await asyncio.wait([stopping, forced], return_when=asyncio.FIRST_COMPLETED)
    if force.is_set():
        daemon.stopping.set()
        await server.stop(0)
    late.cancel()
    for t in side:
        t.cancel()
    if http is not None:
        await http.stop()
    await daemon.stop()
    runtime.unlink(missing_ok=True)
    log.info("stopped")
    return code


def _exit_after(seconds: float, why: str) -> None:
    """Ends the process after `seconds` unless it has ended by itself: a timer thread, so a
    stuck engine thread or an awaited stop that never returns cannot hold it. Spawned ducks
    die with the daemon (drivers/local.py)."""
    def exit_now():
        log.error("%s: exiting now", why)
        for h in logging.getLogger().handlers:
            h.flush()
        os._exit(1)
    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


async def _watchdog(notifier, daemon, server, stop: asyncio.Event) -> None:
    """About every second: the engine's health (duckd.health) to the health checks; the
    systemd watchdog's keep-alive only while it is healthy."""
    period = min(1.0, notifier.watchdog_s / 2) if notifier.watchdog_s else 1.0
    while True:
        try:
            if daemon.health.check() and not stop.is_set():
                await server.set_serving(daemon.serving)
        except Exception:   # a broken check must not end the keep-alives silently: systemd would restart us
            log.exception("the health check failed")
        if notifier.watchdog_s and daemon.health.ok:
            notifier.watchdog()
        await asyncio.sleep(period)


def _restart_only(c: Config) -> tuple:
    """The settings a SIGHUP cannot apply: a change of one of them is logged as needing a restart."""
    return c.fleet, c.model.path, c.model.backend, c.daemon.tls, c.daemon.tls_cert, c.daemon.tls_key


async def _reloader(hup: asyncio.Event, cfg: Config, config_path: str | None) -> None:
    while True:
        await hup.wait()
        hup.clear()
        if not config_path:
            log.info("SIGHUP: no config file to reload (embedded default)")
            continue
        try:
            new = load(config_path)
        except ConfigError as e:
            log.error("SIGHUP: config not reloaded: %s", e)
            continue
        logging.getLogger().setLevel(getattr(logging, new.daemon.log_level.upper()))
        cfg.daemon.log_level = new.daemon.log_level
        cfg.daemon.watch_interval_s = new.daemon.watch_interval_s
        cfg.model.max_tokens = new.model.max_tokens
        if _restart_only(new) != _restart_only(cfg):
            log.warning("SIGHUP: fleet, model and TLS changes need a restart of duckd; applied only log level, "
                        "watch interval and max_tokens")
        log.info("SIGHUP: configuration reloaded from %s", config_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="duckd", description="The duck daemon: owns the fleet, hosts the engine, "
                                 "serves the gRPC API.")
    ap.add_argument("--config", help="TOML config (default: the embedded default: 4 local ducks, fewer on "
                                     "fewer CPUs; SmolLM2)")
    ap.add_argument("--check", action="store_true", help="validate the config and exit")
    args = ap.parse_args(argv)
    try:
        cfg = load(args.config)
    except ConfigError as e:
        print(f"duckd: config error: {e}", file=sys.stderr)
        return 2
    if args.check:
        print(f"duckd: {cfg.source}: OK")
        return 0
    _setup_logging(cfg.daemon.log_level)
    log.info("config: %s; state in %s", cfg.source, cfg.state_path)
    try:
        return asyncio.run(run(cfg, args.config))
    except ConfigError as e:
        log.error("config error: %s", e)
        return 2
    except OSError as e:      # an API port in use, a state folder that cannot be written
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    sys.exit(main())
