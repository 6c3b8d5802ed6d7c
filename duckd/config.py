"""duckd's configuration: one TOML file, validated at start.

docs/duckd-config.md is the reference of every field. An invalid file fails
with ConfigError naming the field and the value.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from duck_proto.client import default_state_dir

SYSTEM_CONFIG = Path("/etc/duckd/duckd.toml")
DEFAULT_LOCAL_DUCKS = 4   # the local and netns drivers' fleet where fleet.ducks is unset (fewer on fewer CPUs)


class ConfigError(ValueError):
    """A config field with a bad value; the message names both."""


@dataclass(slots=True)
class DaemonConfig:
    listen: str = "127.0.0.1:7433"     # gRPC host:port; port 0 picks a free one
    http_listen: str = "127.0.0.1:7434"  # OpenAI-compatible HTTP API and /metrics; "" turns it off
    token: str = ""                    # bearer token; empty: token_file, else generated
    token_file: str = ""               # a file holding the token
    state_dir: str = ""                # host caches, token, runtime file; "" = default
    log_level: str = "info"
    shutdown_grace_s: float = 10.0     # SIGTERM: time in-flight streams get to finish
    watch_interval_s: float = 1.0      # Watch stream period (at most 1 s)
    allow_remote: bool = False         # listen on a non-loopback address (needs tls, or allow_insecure_remote)
    allow_insecure_remote: bool = False  # allow_remote without tls: the token crosses the network in plaintext
    tls: bool = False                  # TLS on gRPC and HTTP (duckd.tls)
    tls_cert: str = ""                 # PEM certificate (chain); "" with tls: generated in state_dir
    tls_key: str = ""                  # its PEM private key, unencrypted
    stall_after_s: float = 5.0         # requests held and no progress this long: not serving (duckd.health)
    max_request_mb: float = 4.0        # the largest request body (HTTP: 413 beyond) or gRPC message taken

    def __post_init__(self):
        self._check_listen("listen", self.listen)
        if self.http_listen:
            self._check_listen("http_listen", self.http_listen)
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"daemon.log_level = {self.log_level!r}: expected debug, info, warning or error")
        _positive("daemon.shutdown_grace_s", self.shutdown_grace_s)
        _positive("daemon.stall_after_s", self.stall_after_s)
        if not 0.01 <= self.max_request_mb <= 1024:
            raise ConfigError(f"daemon.max_request_mb = {self.max_request_mb!r}: expected 0.01 .. 1024")
        if not 0 < self.watch_interval_s <= 1.0:
            raise ConfigError(f"daemon.watch_interval_s = {self.watch_interval_s!r}: expected 0 < value <= 1")
        self._check_tls()

    def _check_tls(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            given, missing = ("tls_cert", "tls_key") if self.tls_cert else ("tls_key", "tls_cert")
            raise ConfigError(f"daemon.{given} = {getattr(self, given)!r} without daemon.{missing}: give both "
                              "(the certificate and its private key), or neither for a generated certificate")
        if self.tls_cert and not self.tls:
            raise ConfigError(f"daemon.tls_cert = {self.tls_cert!r} with daemon.tls = false: set daemon.tls = true "
                              "to serve it")
        for key in ("tls_cert", "tls_key"):
            path = Path(getattr(self, key)).expanduser()
            if getattr(self, key) and not path.is_file():
                raise ConfigError(f"daemon.{key} = {getattr(self, key)!r}: "
                                  f"{'not a file' if path.exists() else 'no such file'}")
        if self.allow_remote and not self.tls and not self.allow_insecure_remote:
            raise ConfigError("daemon.allow_remote = true without daemon.tls: the bearer token and every prompt "
                              "would cross the network in plaintext; set daemon.tls = true (a generated "
                              "certificate, or daemon.tls_cert / tls_key), or daemon.allow_insecure_remote = true "
                              "for a network you trust")

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 2**20)

    def _check_listen(self, key: str, value: str) -> None:
        host, _, port = value.rpartition(":")
        if not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"daemon.{key} = {value!r}: expected host:port")
        if not self.allow_remote and not _is_loopback(host):
            raise ConfigError(f"daemon.{key} = {value!r}: not a loopback address; "
                              "set daemon.allow_remote = true to listen beyond this host")


@dataclass(slots=True)
class ModelConfig:
    path: str = "default"              # "default" (SmolLM2-135M-Instruct), a HF folder or a .gguf
    backend: str = "fleet"             # fleet | fp9 | torch
    max_model_len: int | str = 2048    # tokens per conversation, or "auto": the longest that fits kv_cache_budget
    kv_cache_budget: str = "auto"      # memory for max_seqs sequences' decode cache (duckd.context_size): auto (half
                                       # of what is free on the model's device after loading), bytes, or a fraction
    max_tokens: int = 256              # a chat's default limit
    max_queued: int = 64               # requests waiting for the model; one more is refused (busy)
    max_seqs: int = 32                 # sequences decoded together (continuous batching; 1: one at a time)
    step_tokens: int = 256             # tokens per batched step: every sequence's next token, then prompt chunks
    prefill_chunk: int = 1024          # prompt tokens per step while no sequence decodes (a lone prompt reads in
                                       # larger steps than step_tokens; the CPU host's native decoder takes 1024)
    prefix_cache: bool = True          # a prompt's beginning that a batch slot holds is not read again (engine.batch)
    gpu_prefill: str = "auto"          # long prompts' experts over PCIe to the GPU, ducks beside: auto (a CUDA host
                                       # with a fleet) | hybrid | gpu (the GPU takes every expert held) | off
    gpu_prefill_min_tokens: int = 0    # 0: a prompt goes that way when it is estimated faster than the fleet alone
    gpu_prefill_chunk: int = 16384     # tokens per streamed pass: each weight crosses PCIe once per pass
    gpu_prefill_host_mb: int = 0       # host memory for the experts' copy (0: all of them; less: the rest stays
                                       # the ducks')
    gpu_ffn_budget: str = "auto"       # GPU memory for FFN weights computed beside the ducks (engine.placement):
                                       # auto (what is free after the model, less a margin; 0 off CUDA), bytes
                                       # ("24G", "512M", "0"), or a fraction of auto ("0.5")
    mtp: bool = True                   # MTP1 speculative decoding where the checkpoint has the head
    special_tokens_in_content: bool = False   # "<|im_start|>" in a message: text (False) or a control token
    # sampling defaults for requests that name none (unset: the checkpoint's generation_config.json, else greedy)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    device: str = "auto"               # auto | cpu | cuda

    def __post_init__(self):
        if self.backend not in ("fleet", "fp9", "torch"):
            raise ConfigError(f"model.backend = {self.backend!r}: expected fleet, fp9 or torch")
        if self.path != "default" and not Path(self.path).expanduser().exists():
            raise ConfigError(f"model.path = {self.path!r}: no such file or folder")
        if self.max_model_len != "auto":
            _positive("model.max_model_len", self.max_model_len)
        self.kv_cache_budget = str(self.kv_cache_budget)
        parse_budget(self.kv_cache_budget, 0, key="model.kv_cache_budget")
        _positive("model.max_tokens", self.max_tokens)
        _positive("model.max_queued", self.max_queued)
        _positive("model.max_seqs", self.max_seqs)
        if not self.max_seqs <= self.step_tokens <= 1024:
            raise ConfigError(f"model.step_tokens = {self.step_tokens!r}: expected max_seqs ({self.max_seqs}) .. 1024 "
                              f"(every sequence's next token fits one step; the native decoder takes 1024)")
        if not isinstance(self.prefill_chunk, int) or not 1 <= self.prefill_chunk <= 65536:
            raise ConfigError(f"model.prefill_chunk = {self.prefill_chunk!r}: expected 1..65536 tokens")
        if self.gpu_prefill not in ("auto", "hybrid", "gpu", "off"):
            raise ConfigError(f"model.gpu_prefill = {self.gpu_prefill!r}: expected auto, hybrid, gpu or off")
        if not 1 <= self.gpu_prefill_chunk <= 65536:
            raise ConfigError(f"model.gpu_prefill_chunk = {self.gpu_prefill_chunk!r}: expected 1..65536 tokens")
        for key in ("gpu_prefill_min_tokens", "gpu_prefill_host_mb"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model.{key} = {getattr(self, key)!r}: expected >= 0")
        if self.temperature is not None and not 0 <= self.temperature <= 10:
            raise ConfigError(f"model.temperature = {self.temperature!r}: expected 0 (greedy) .. 10")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"model.top_p = {self.top_p!r}: expected 0 < top_p <= 1")
        if self.top_k is not None and self.top_k < 0:
            raise ConfigError(f"model.top_k = {self.top_k!r}: expected >= 0 (0: off)")
        if self.repetition_penalty is not None and not 0 < self.repetition_penalty <= 10:
            raise ConfigError(f"model.repetition_penalty = {self.repetition_penalty!r}: expected 0 < value <= 10")
        self.gpu_ffn_budget = str(self.gpu_ffn_budget)
        parse_budget(self.gpu_ffn_budget, 0)   # raises ConfigError naming the key
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"model.device = {self.device!r}: expected auto, cpu or cuda")


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_budget(text: str, auto: int, key: str = "model.gpu_ffn_budget") -> int:
    """A memory budget (model.gpu_ffn_budget, model.kv_cache_budget) in bytes: "auto" is `auto`;
    "24G" / "512M" / "1000" bytes; "0.5" half of auto."""
    t = str(text).strip().upper().removesuffix("B")
    if t == "AUTO":
        return auto
    try:
        if "." in t and t[-1:].isdigit():
            f = float(t)
            if not 0 <= f <= 1:
                raise ValueError
            return int(f * auto)
        unit = t[-1:] if t[-1:] in _UNITS else ""
        n = int(t[:len(t) - len(unit)])
        if n < 0:
            raise ValueError
        return n * _UNITS[unit]
    except ValueError:
        raise ConfigError(f"{key} = {text!r}: expected auto, bytes (e.g. 24G, 512M, 0) or a "
                          f"fraction of auto (0 .. 1, e.g. 0.5)") from None


@dataclass(slots=True)
class NetnsConfig:
    subnets: int = 4                   # broadcast domains, ducks spread round-robin
    prefix: str = "10.77"              # subnet i is <prefix>.<i+1>.0/24, host .1
    name: str = "duck"                 # namespace/bridge name prefix
    # link emulation (tc): each duck's own link, and each subnet's host port (0: no limit)
    duck_rate_mbit: float = 0.0        # e.g. 2500: a 2.5GbE duck
    duck_delay_us: float = 0.0         # one way, each direction
    duck_jitter_us: float = 0.0        # +- around duck_delay_us (needs the kernel's netem)
    duck_loss: float = 0.0             # fraction of datagrams lost, each direction
    port_rate_mbit: float = 0.0        # e.g. 25000: the host's 25GbE port of each subnet
    port_delay_us: float = 0.0         # one way, each direction (the switch)
    link_mtu: int = 1500               # the veths' MTU: 1500 plain Ethernet, 9000 jumbo frames

    def __post_init__(self):
        if not 1 <= self.subnets <= 64:
            raise ConfigError(f"fleet.netns.subnets = {self.subnets!r}: expected 1..64")
        if not self.name or len(self.name) > 8 or not self.name.isalnum():
            raise ConfigError(f"fleet.netns.name = {self.name!r}: expected 1..8 letters or digits "
                              "(interface names are at most 15 characters: <name>br<subnet>, <name>h<duck>)")
        for key in ("duck_rate_mbit", "port_rate_mbit"):
            v = getattr(self, key)
            if not 0 <= v <= 400000:
                raise ConfigError(f"fleet.netns.{key} = {v!r}: expected 0 (no limit) .. 400000 Mbit/s")
            if 0 < v < 1:
                raise ConfigError(f"fleet.netns.{key} = {v!r}: below 1 Mbit/s; 0 means no limit")
        for key in ("duck_delay_us", "duck_jitter_us", "port_delay_us"):
            v = getattr(self, key)
            if not 0 <= v <= 1000000:
                raise ConfigError(f"fleet.netns.{key} = {v!r}: expected 0 .. 1000000 us")
        if self.duck_jitter_us > self.duck_delay_us:
            raise ConfigError(f"fleet.netns.duck_jitter_us = {self.duck_jitter_us!r}: more than duck_delay_us "
                              f"({self.duck_delay_us!r}); a delay cannot go below zero")
        if not 1280 <= self.link_mtu <= 65535:
            raise ConfigError(f"fleet.netns.link_mtu = {self.link_mtu!r}: expected 1280..65535 (1500: Ethernet, "
                              "9000: jumbo frames)")
        if not 0 <= self.duck_loss < 1:
            raise ConfigError(f"fleet.netns.duck_loss = {self.duck_loss!r}: expected a fraction 0 <= loss < 1")
        try:
            ipaddress.ip_network(f"{self.prefix}.0.0/16")
        except ValueError:
            raise ConfigError(f"fleet.netns.prefix = {self.prefix!r}: expected two octets like 10.77") from None


@dataclass(slots=True)
class WolDuck:
    mac: str
    address: str                       # ip:port the duck answers on once awake

    def __post_init__(self):
        parts = self.mac.replace("-", ":").split(":")
        if len(parts) != 6 or not all(len(p) == 2 and all(c in "0123456789abcdefABCDEF" for c in p) for p in parts):
            raise ConfigError(f"fleet.wol.ducks.mac = {self.mac!r}: expected six hex octets like 00:11:22:33:44:55")
        if ":" not in self.address:
            raise ConfigError(f"fleet.wol.ducks.address = {self.address!r}: expected ip:port")


@dataclass(slots=True)
class WolConfig:
    broadcast: str = "127.255.255.255:9"   # where magic packets go
    ducks: list[WolDuck] = field(default_factory=list)


@dataclass(slots=True)
class PxeDuck:
    mac: str
    address: str                       # the IPv4 address dnsmasq leases to this MAC

    def __post_init__(self):
        WolDuck(self.mac, "x:0")       # the same MAC check
        self.mac = self.mac.replace("-", ":").lower()
        try:
            ipaddress.IPv4Address(self.address)
        except ValueError:
            raise ConfigError(f"fleet.pxe.ducks.address = {self.address!r}: expected an IPv4 address "
                              "(the port is fleet.pxe.port)") from None


@dataclass(slots=True)
class PxeConfig:
    interface: str = ""                # the host's interface on the fleet subnet: dnsmasq serves there
    ducks: list[PxeDuck] = field(default_factory=list)
    port: int = 7700                   # the ducks' UDP port
    power: str = "wol"                 # wol (magic packet) | command (power_on / power_cycle)
    power_on: list = field(default_factory=list)      # argv; {index} {mac} {address} filled in
    power_cycle: list = field(default_factory=list)   # argv that resets a duck: the driver can restart ducks
    boot_timeout_s: float = 180.0      # power-on to the duck's hello
    lease_s: int = 3600                # DHCP lease time
    threads: int = 0                   # duckfw threads on a duck; 0: all its CPUs
    cache: str = "auto"                # auto (partition labelled duckcache, else RAM) | ram | /dev/NAME
    modules: list = field(default_factory=list)       # kernel modules beyond the image's defaults
    kernel: str = ""                   # "" = the newest /boot/vmlinuz-*
    busybox: str = ""                  # "" = /bin/busybox (busybox-static)
    dnsmasq: str = ""                  # "" = dnsmasq on PATH or /usr/sbin/dnsmasq

    def __post_init__(self):
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"fleet.pxe.port = {self.port!r}: expected 1..65535")
        if self.power not in ("wol", "command"):
            raise ConfigError(f"fleet.pxe.power = {self.power!r}: expected wol or command")
        if self.power == "command" and not self.power_on:
            raise ConfigError("fleet.pxe.power_on = []: power = \"command\" needs the command that powers a duck on")
        for key in ("power_on", "power_cycle", "modules"):
            if not all(isinstance(a, str) and a for a in getattr(self, key)):
                raise ConfigError(f"fleet.pxe.{key} = {getattr(self, key)!r}: expected an array of non-empty strings")
        _positive("fleet.pxe.boot_timeout_s", self.boot_timeout_s)
        _positive("fleet.pxe.lease_s", self.lease_s)
        if not 0 <= self.threads <= 1024:
            raise ConfigError(f"fleet.pxe.threads = {self.threads!r}: expected 0 (all CPUs) .. 1024")
        macs = [d.mac for d in self.ducks]
        addrs = [d.address for d in self.ducks]
        if len(set(macs)) != len(macs) or len(set(addrs)) != len(addrs):
            raise ConfigError("fleet.pxe.ducks: each MAC and each address may appear once")


TWICE = {"auto": 0, "always": 1, "never": -1}   # fleet.send_twice -> duck_transport_config.twice


@dataclass(slots=True)
class FleetConfig:
    driver: str = "local"              # local | netns | wol | pxe
    ducks: int | None = None           # unset: local and netns, 4 or this host's CPUs where fewer (ducks
                                       # that share the host's cores: on 2 cores 2 ducks serve 3-23 % faster
                                       # than 4); wol and pxe, their list's
    threads_per_duck: int = 1
    tp: int = 0                        # tensor-parallel ranks; 0 = one per duck
    multiple_of: int = 64
    mtu: int = 0                       # ceiling on the datagram size; 0: as agreed with each duck at hello
    link_timeout_s: float = 20.0
    health_interval_s: float = 0.5
    fail_after_s: float = 1.5          # no answer for this long -> FAILED
    restart: bool = True               # restart failed ducks where the driver can
    restart_delay_s: float = 1.0       # wait before a restart (no restart storms)
    cache_capacity_mb: int = 0         # per duck; 0 = unbounded
    spin: bool | None = None           # ducks spin-then-block when idle; unset: where they are dedicated
                                       # hardware (pxe), not where they share this host's cores (local, netns)
    spin_us: int = 1000                # how long they spin (yielding the CPU) before blocking
    host_spin_us: int = 0              # the host polls for replies this long before blocking
    retransmit_ms: float = 0.5         # the floor of the host's retransmit timer (it follows each duck's round trip)
    send_twice: str = "auto"           # a decode forward's datagrams, and its reply's, sent twice: auto (to a duck
                                       # whose link is found to lose datagrams), always, never (docs/wire.md, Loss)
    replicas: int = 1                  # 2: each slice also on the next duck, which computes it when its duck is lost
    host_cover_mb: int = 4096          # the most MB of lost ducks' slices the host computes (0: none; the request fails)
    host_cover_threads: int = 1        # threads computing them (1: the forwarding thread alone)
    fault_drop_rate: float = 0.0       # tests only: each duck drops this fraction of datagrams (fault injection)
    data_mac: bool = True              # forwards and partials carry the link MAC; false only on trusted links
    netns: NetnsConfig = field(default_factory=NetnsConfig)
    wol: WolConfig = field(default_factory=WolConfig)
    pxe: PxeConfig = field(default_factory=PxeConfig)

    def __post_init__(self):
        if self.driver not in ("local", "netns", "wol", "pxe"):
            raise ConfigError(f"fleet.driver = {self.driver!r}: expected local, netns, wol or pxe")
        if self.driver in ("wol", "pxe"):
            self.ducks = len(getattr(self, self.driver).ducks)
            if not self.ducks:
                raise ConfigError(f"fleet.{self.driver}.ducks = []: the {self.driver} driver needs at least one duck")
        _positive("fleet.threads_per_duck", self.threads_per_duck)
        if self.ducks is None:   # no more ducks' threads than the host has CPUs, at most the default's
            self.ducks = max(1, min(DEFAULT_LOCAL_DUCKS, len(os.sched_getaffinity(0)) // self.threads_per_duck))
        if self.driver == "pxe" and not self.pxe.interface:
            raise ConfigError('fleet.pxe.interface = "": the pxe driver needs the host\'s interface on the fleet '
                              'subnet (e.g. "eth1" or a bridge)')
        if not 1 <= self.ducks <= 256:
            raise ConfigError(f"fleet.ducks = {self.ducks!r}: expected 1..256")
        if self.tp < 0:
            raise ConfigError(f"fleet.tp = {self.tp!r}: expected >= 0")
        self.tp = self.tp or self.ducks
        if self.tp != self.ducks:
            raise ConfigError(f"fleet.tp = {self.tp!r}: must equal fleet.ducks ({self.ducks}); "
                              "each duck holds one tensor-parallel slice")
        if self.multiple_of <= 0 or self.multiple_of % 64:
            raise ConfigError(f"fleet.multiple_of = {self.multiple_of!r}: expected a positive multiple of 64")
        from native._native import lib   # the wire's bounds, from its header (native/wire/wire.h)
        if self.mtu and not lib.WIRE_MTU_MIN <= self.mtu <= lib.WIRE_MTU_MAX:
            raise ConfigError(f"fleet.mtu = {self.mtu!r}: expected 0 (as agreed with each duck) or "
                              f"{lib.WIRE_MTU_MIN}..{lib.WIRE_MTU_MAX} (the wire's datagram sizes)")
        if self.spin is None:
            self.spin = self.driver == "pxe"
        if not isinstance(self.spin, bool):
            raise ConfigError(f"fleet.spin = {self.spin!r}: expected true or false")
        if not 1 <= self.spin_us <= 1000000:
            raise ConfigError(f"fleet.spin_us = {self.spin_us!r}: expected 1..1000000")
        if not 0 <= self.host_spin_us <= 100000:
            raise ConfigError(f"fleet.host_spin_us = {self.host_spin_us!r}: expected 0..100000")
        if not 0.1 <= self.retransmit_ms <= self.fail_after_s * 1000:
            raise ConfigError(f"fleet.retransmit_ms = {self.retransmit_ms!r}: expected 0.1 .. fail_after_s in ms")
        if self.send_twice not in TWICE:
            raise ConfigError(f"fleet.send_twice = {self.send_twice!r}: expected one of {', '.join(TWICE)}")
        if self.replicas not in (1, 2) or (self.replicas == 2 and self.ducks < 2):
            raise ConfigError(f"fleet.replicas = {self.replicas!r}: expected 1, or 2 with at least two ducks")
        if not 0 <= self.host_cover_mb <= 1 << 24:
            raise ConfigError(f"fleet.host_cover_mb = {self.host_cover_mb!r}: expected 0 (no host cover) .. 16777216")
        if not 1 <= self.host_cover_threads <= 1024:
            raise ConfigError(f"fleet.host_cover_threads = {self.host_cover_threads!r}: expected 1..1024")
        if not 0 <= self.fault_drop_rate < 1:
            raise ConfigError(f"fleet.fault_drop_rate = {self.fault_drop_rate!r}: expected 0 <= rate < 1 (tests only)")
        if self.restart_delay_s < 0:
            raise ConfigError(f"fleet.restart_delay_s = {self.restart_delay_s!r}: expected >= 0")
        for name in ("link_timeout_s", "health_interval_s", "fail_after_s"):
            _positive(f"fleet.{name}", getattr(self, name))


@dataclass(slots=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    source: str = "<embedded default>"

    @property
    def state_path(self) -> Path:
        return Path(self.daemon.state_dir).expanduser() if self.daemon.state_dir else default_state_dir()


def _positive(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} = {value!r}: expected a positive number")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


_AUTO = {(ModelConfig, "max_model_len", "auto")}   # numbers that may also be "auto"


def _build(cls, table: dict, where: str):
    """A dataclass from a TOML table, naming unknown keys and bad types."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: expected a table, got {table!r}")
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        if key not in known:
            raise ConfigError(f"{where}.{key}: unknown field (known: {', '.join(sorted(known))})".lstrip("."))
        sub = _SUBTABLES.get((cls, key))
        if sub is not None:
            value = _build(sub, value, f"{where}.{key}".lstrip("."))
        elif (cls, key) in _DUCK_LISTS:
            if not isinstance(value, list):
                raise ConfigError(f"{where}.ducks = {value!r}: expected an array of tables")
            value = [_build(_DUCK_LISTS[cls, key], v, f"{where}.ducks") for v in value]
        else:
            default = getattr(cls(), key) if cls not in (WolDuck, PxeDuck) else None
            if default is not None and not _same_kind(default, value) and (cls, key, value) not in _AUTO:
                raise ConfigError(f"{where}.{key} = {value!r}: expected {type(default).__name__}".lstrip("."))
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _same_kind(default, value) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type(default)) and not (isinstance(value, bool) and not isinstance(default, bool))


_SUBTABLES = {(Config, "daemon"): DaemonConfig, (Config, "model"): ModelConfig, (Config, "fleet"): FleetConfig,
              (FleetConfig, "netns"): NetnsConfig, (FleetConfig, "wol"): WolConfig, (FleetConfig, "pxe"): PxeConfig}
_DUCK_LISTS = {(WolConfig, "ducks"): WolDuck, (PxeConfig, "ducks"): PxeDuck}


def load(path: str | os.PathLike | None) -> Config:
    """The config at path, or the embedded default when path is None."""
    if path is None:
        return Config()
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {str(p)!r}: not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(p)!r}: not valid TOML: {e}") from None
    data.pop("source", None)
    cfg = _build(Config, data, "")
    cfg.source = str(p)
    return cfg
