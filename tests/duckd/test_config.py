"""duckd's [fleet] idle policy and datagram ceiling: what the local driver asks
duckfw for, and values refused by name."""
import re
from pathlib import Path

import pytest

from duckd.config import ConfigError, FleetConfig, ModelConfig
from duckd.drivers.local import duckfw_command


def command(**fleet) -> list[str]:
    return duckfw_command(FleetConfig(**fleet), 0, "127.0.0.1", 0, Path("/tmp/d"), Path("/tmp/k"))


def test_ducks_block_by_default_and_agree_their_datagram_size():
    cmd = command()
    assert cmd[cmd.index("--idle") + 1] == "block" and "--spin-us" not in cmd
    assert cmd[cmd.index("--mtu") + 1] == "auto"


def test_spin_is_spin_then_block_for_spin_us():
    cmd = command(spin=True, spin_us=300, mtu=9000)
    assert cmd[cmd.index("--idle") + 1:cmd.index("--idle") + 4] == ["spin", "--spin-us", "300"]
    assert cmd[cmd.index("--mtu") + 1] == "9000"


@pytest.mark.parametrize("fleet,text", [({"mtu": 1000}, "fleet.mtu = 1000: expected 0"),
                                        ({"spin_us": 0}, "fleet.spin_us = 0"),
                                        ({"host_spin_us": -1}, "fleet.host_spin_us = -1"),
                                        ({"replicas": 3}, "fleet.replicas = 3: expected 1, or 2"),
                                        ({"replicas": 2, "ducks": 1}, "fleet.replicas = 2"),
                                        ({"host_cover_mb": -1}, "fleet.host_cover_mb = -1"),
                                        ({"host_cover_threads": 0}, "fleet.host_cover_threads = 0"),
                                        ({"fault_drop_rate": 1.0}, "fleet.fault_drop_rate = 1.0"),
                                        ({"retransmit_ms": 0.0}, "fleet.retransmit_ms = 0.0"),
                                        ({"send_twice": "sometimes"}, "fleet.send_twice = .sometimes.: expected one of auto, always, never")])
def test_bad_values_are_named(fleet, text):
    with pytest.raises(ConfigError, match=text):
        FleetConfig(**fleet)


@pytest.mark.parametrize("chunk", [0, 65537, 8.0])
def test_prefill_chunk_is_checked(chunk):
    from duckd.config import ModelConfig
    assert ModelConfig().prefill_chunk == 1024
    with pytest.raises(ConfigError, match=f"model.prefill_chunk = {chunk!r}: expected 1..65536"):
        ModelConfig(prefill_chunk=chunk)


def test_fault_drop_rate_turns_on_the_ducks_fault_injection():
    assert "--enable-fault-injection" not in command()
    cmd = command(fault_drop_rate=0.05)
    assert "--enable-fault-injection" in cmd and cmd[cmd.index("--drop-rate") + 1] == "0.05"


@pytest.mark.parametrize("netns,text", [({"duck_rate_mbit": -1}, "fleet.netns.duck_rate_mbit = -1: expected 0"),
                                        ({"port_rate_mbit": 0.5}, "fleet.netns.port_rate_mbit = 0.5: below 1"),
                                        ({"duck_delay_us": 2e6}, "fleet.netns.duck_delay_us = 2000000.0"),
                                        ({"duck_delay_us": 10, "duck_jitter_us": 20},
                                         "fleet.netns.duck_jitter_us = 20: more than duck_delay_us"),
                                        ({"duck_loss": 1.0}, "fleet.netns.duck_loss = 1.0: expected a fraction"),
                                        ({"name": "much-too-long"}, "fleet.netns.name = 'much-too-long'"),
                                        ({"prefix": "10.999"}, "fleet.netns.prefix = '10.999': expected two octets")])
def test_bad_link_emulation_values_are_named(netns, text):
    from duckd.config import NetnsConfig
    with pytest.raises(ConfigError, match=text):
        NetnsConfig(**netns)


def test_link_shapes_become_tc_arguments_and_duckfw_stands_in_for_a_missing_netem():
    from duckd.drivers.links import LinkError, Shape, Shaper, netem_args, tbf_args
    tbf = tbf_args(2500)
    assert tbf[:3] == ["tbf", "rate", "2500mbit"] and int(tbf[tbf.index("burst") + 1]) == 2500
    assert int(tbf_args(100)[4]) == 1564 and int(tbf_args(25000)[4]) == 25000   # one frame at least
    assert netem_args(Shape(delay_us=50, jitter_us=5, loss=0.01)) == ["netem", "limit", "100000", "delay", "50us",
                                                                      "5us", "loss", "1%"]
    shaper = Shaper()
    duck, port = Shape(2500, 50, 0, 0.01), Shape(25000, 5)
    assert shaper.duck_fallback(duck, port) == []          # netem not tried yet: nothing to stand in for
    shaper.netem = False
    assert shaper.duck_fallback(duck, port) == ["--enable-fault-injection", "--delay-us", "110", "--drop-rate", "0.01"]
    with pytest.raises(LinkError, match="duck_jitter_us needs the kernel's netem"):
        shaper.duck_fallback(Shape(2500, 50, 10), port)


def test_a_new_token_never_reads_as_an_option_and_an_old_one_still_passes(tmp_path):
    """A token that began with '-' made `duckctl --token <it>` an argparse error (CI drew one)."""
    from duck_proto.client import join_option_values
    from duckd.config import load
    from duckd.ctl import build_parser
    from duckd.main import resolve_token
    cfg_file = tmp_path / "duckd.toml"
    cfg_file.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    for _ in range(64):
        token, path = resolve_token(load(cfg_file))
        assert not token.startswith("-") and path.read_text().strip() == token
        path.unlink()
    argv = join_option_values(["--address", "127.0.0.1:1", "--token", "-Zx_9", "status", "--json"])
    args = build_parser().parse_args(argv)
    assert args.token == "-Zx_9" and args.cmd == "status" and args.json
    assert join_option_values(["status", "--token"]) == ["status", "--token"]


def test_an_unset_fleet_has_4_ducks_or_as_many_as_the_cpus_hold(tmp_path):
    """Local ducks share the host's cores: no more of their threads than it has CPUs (on the 2-core
    development machine 2 ducks decoded 3-23 % faster than 4 in three runs, one stream and 32 alike), at most 4."""
    import os

    from duckd.config import DEFAULT_LOCAL_DUCKS, load
    cpus = len(os.sched_getaffinity(0))
    assert load(None).fleet.ducks == FleetConfig().ducks == max(1, min(DEFAULT_LOCAL_DUCKS, cpus)) == min(4, cpus)
    assert FleetConfig(threads_per_duck=2).ducks == max(1, min(4, cpus // 2))
    assert FleetConfig(driver="netns").ducks == min(4, cpus)
    assert FleetConfig(ducks=7).ducks == 7 == FleetConfig(ducks=7).tp   # a number given is kept, above the CPUs too
    path = tmp_path / "duckd.toml"
    path.write_text("[fleet]\nducks = 3\n")
    assert load(path).fleet.ducks == 3
    path.write_text('[fleet]\nducks = "four"\n')
    with pytest.raises(ConfigError, match="fleet.ducks = 'four': expected int"):
        load(path)


@pytest.mark.parametrize("field,value,text", [
    ("gpu_prefill", "fast", "model.gpu_prefill = 'fast': expected auto, hybrid, gpu or off"),
    ("gpu_prefill_chunk", 0, "model.gpu_prefill_chunk = 0: expected 1..65536 tokens"),
    ("gpu_prefill_min_tokens", -1, "model.gpu_prefill_min_tokens = -1: expected >= 0"),
    ("gpu_prefill_host_mb", -5, "model.gpu_prefill_host_mb = -5: expected >= 0")])
def test_the_streamed_prefill_settings_are_checked(field, value, text):
    assert ModelConfig().gpu_prefill == "auto" and ModelConfig().gpu_prefill_chunk == 16384
    with pytest.raises(ConfigError, match=re.escape(text)):
        ModelConfig(**{field: value})


@pytest.mark.parametrize("daemon,text", [
    ({"tls_cert": "/etc/hosts"}, "daemon.tls_cert = '/etc/hosts' without daemon.tls_key: give both"),
    ({"tls_key": "/etc/hosts", "tls": True}, "daemon.tls_key = '/etc/hosts' without daemon.tls_cert"),
    ({"tls_cert": "/etc/hosts", "tls_key": "/etc/hosts"}, "with daemon.tls = false: set daemon.tls = true"),
    ({"tls": True, "tls_cert": "/nonexistent.crt", "tls_key": "/etc/hosts"}, "'/nonexistent.crt': no such file"),
    ({"tls": True, "tls_cert": "/etc", "tls_key": "/etc/hosts"}, "daemon.tls_cert = '/etc': not a file"),
    ({"allow_remote": True}, "daemon.allow_remote = true without daemon.tls: .* set daemon.tls = true")])
def test_tls_settings_are_checked(daemon, text):
    from duckd.config import DaemonConfig
    with pytest.raises(ConfigError, match=text):
        DaemonConfig(**daemon)


def test_allow_remote_takes_tls_or_the_explicit_override():
    from duckd.config import DaemonConfig
    assert DaemonConfig(allow_remote=True, tls=True, listen="0.0.0.0:7433").tls
    assert DaemonConfig(allow_remote=True, allow_insecure_remote=True, listen="0.0.0.0:7433").allow_insecure_remote
