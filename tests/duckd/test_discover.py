"""duck_proto.client.discover: where a client finds the daemon, its token and, for the
OpenAI API, its HTTP address (runtime file, config, arguments)."""
import json

import pytest

from duck_proto.client import DiscoveryError, discover


def _runtime(state, address="127.0.0.1:7500", http="127.0.0.1:7501"):
    state.mkdir(parents=True, exist_ok=True)
    (state / "token").write_text("secret\n")
    (state / "duckd.json").write_text(json.dumps({"address": address, "token_file": str(state / "token"),
                                                  "pid": 1, "http_address": http}))


def test_the_runtime_file_gives_address_token_and_http(tmp_path):
    _runtime(tmp_path)
    e = discover(state_dir=tmp_path)
    assert (e.address, e.token, e.http_address) == ("127.0.0.1:7500", "secret", "127.0.0.1:7501")
    assert "runtime file" in e.source


def test_explicit_address_takes_http_only_from_the_same_daemons_runtime_file(tmp_path):
    _runtime(tmp_path)
    assert discover("127.0.0.1:7500", "t", state_dir=tmp_path).http_address == "127.0.0.1:7501"
    assert discover("127.0.0.1:9999", "t", state_dir=tmp_path).http_address == ""   # another daemon


def test_the_config_names_http_listen_unless_its_port_is_picked_at_start(tmp_path):
    cfg = tmp_path / "duckd.toml"
    cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:7600"\nhttp_listen = "127.0.0.1:7601"\ntoken = "x"\n'
                   f'state_dir = "{tmp_path / "s"}"\n')
    assert discover(config=str(cfg)).http_address == "127.0.0.1:7601"
    cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:7600"\nhttp_listen = "127.0.0.1:0"\ntoken = "x"\n'
                   f'state_dir = "{tmp_path / "s"}"\n')
    assert discover(config=str(cfg)).http_address == ""


def test_no_daemon_names_where_it_looked(tmp_path):
    with pytest.raises(DiscoveryError, match="duckd.json does not exist"):
        discover(state_dir=tmp_path)


def test_tls_comes_from_the_runtime_file_or_the_config_and_plaintext_otherwise(tmp_path):
    from duckd import tls
    from duckd.config import Config, DaemonConfig
    cert = tls.server_cert(Config(daemon=DaemonConfig(tls=True, state_dir=str(tmp_path))))
    _runtime(tmp_path)
    assert discover(state_dir=tmp_path).tls is None                       # a plaintext daemon
    info = json.loads((tmp_path / "duckd.json").read_text())
    info.update(tls_cert=str(cert.cert_file), tls_fingerprint=cert.fingerprint)
    (tmp_path / "duckd.json").write_text(json.dumps(info))
    e = discover(state_dir=tmp_path)
    assert e.tls.roots == cert.chain_pem and e.http_url == "https://127.0.0.1:7501"
    assert discover("127.0.0.1:7500", "t", state_dir=tmp_path).tls is not None   # that daemon, address given
    cfg = tmp_path / "duckd.toml"
    cfg.write_text(f'[daemon]\nlisten = "127.0.0.1:7600"\ntoken = "x"\ntls = true\nstate_dir = "{tmp_path}"\n')
    assert discover(config=str(cfg)).tls.source == f"the daemon's certificate {cert.cert_file}"


def test_a_bad_fingerprint_or_ca_file_is_named(tmp_path):
    _runtime(tmp_path)
    with pytest.raises(DiscoveryError, match="fingerprint 'abc': expected the certificate's SHA-256"):
        discover(state_dir=tmp_path, fingerprint="abc")
    with pytest.raises(DiscoveryError, match=f"--ca {tmp_path}/none.pem: cannot read it"):
        discover(state_dir=tmp_path, ca=str(tmp_path / "none.pem"))
    (tmp_path / "token.pem").write_text("secret\n")
    with pytest.raises(DiscoveryError, match="no PEM certificate in it"):
        discover(state_dir=tmp_path, ca=str(tmp_path / "token.pem"))
