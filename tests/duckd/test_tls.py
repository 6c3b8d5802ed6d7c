"""TLS on duckd's gRPC and HTTP APIs (daemon.tls): a real daemon on loopback, real
handshakes. The generated certificate is made once, kept 0600 and reused; duckctl finds
and verifies it through the runtime file; a plaintext client, a wrong pin or a wrong CA
gets nothing through, with an error that says so; an operator's CA-signed certificate
serves the same way; bad certificate files are named at start."""
import json
import os
import ssl
import stat
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duck_proto.client import DiscoveryError, Endpoint, discover, sync_channel
from duckd import tls
from duckd.config import Config, ConfigError, DaemonConfig
from tests.duckd_fixture import RunningDaemon, write_config
from tests.tls_fixture import issue, make_ca


def duckctl(*args, state_home, timeout=180):
    return subprocess.run([sys.executable, "-m", "duckd.ctl", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "XDG_STATE_HOME": str(state_home)})


def runtime(daemon) -> dict:
    return json.loads((daemon.state_dir / "duckd.json").read_text())


def health(endpoint: Endpoint):
    return health_pb2_grpc.HealthStub(sync_channel(endpoint)).Check(health_pb2.HealthCheckRequest(), timeout=10)


def https_get(endpoint: Endpoint, path: str, context: ssl.SSLContext | None = None):
    req = urllib.request.Request(f"{endpoint.http_url}{path}", headers={"Authorization": f"Bearer {endpoint.token}"})
    with urllib.request.urlopen(req, timeout=10, context=context or endpoint.tls.ssl_context()) as r:
        return r.status, r.read()


def test_the_runtime_file_names_scheme_certificate_and_its_fingerprint(tls_daemon):
    info = runtime(tls_daemon)
    assert info["scheme"] == "https"
    assert info["tls_cert"] == str(tls_daemon.state_dir / "tls.crt")
    der = ssl.PEM_cert_to_DER_cert((tls_daemon.state_dir / "tls.crt").read_text())
    assert info["tls_fingerprint"] == tls.fingerprint(der)
    assert f"SHA-256 fingerprint {info['tls_fingerprint']}" in tls_daemon.log()
    assert stat.S_IMODE((tls_daemon.state_dir / "tls.key").stat().st_mode) == 0o600


def test_duckctl_status_and_chat_go_through_tls(tls_daemon):
    home = tls_daemon.state_dir.parent          # no arguments: found, and trusted, from the runtime file
    r = duckctl("status", "--json", state_home=home)
    assert r.returncode == 0, r.stderr
    assert [d["state"] for d in json.loads(r.stdout)["ducks"]] == ["SERVING"] * 2
    r = duckctl("chat", "--greedy", "Which city is the capital of France?", state_home=home)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_https_serves_the_openai_api_and_health(tls_daemon):
    ep = tls_daemon.endpoint
    assert ep.http_url.startswith("https://")
    assert https_get(ep, "/health") == (200, b'{"ready":true}')
    status, body = https_get(ep, "/v1/models")
    assert status == 200 and json.loads(body)["data"]


def test_the_openai_client_chats_over_https(tls_daemon):
    import openai
    ep = tls_daemon.endpoint
    with openai.OpenAI(base_url=f"{ep.http_url}/v1", api_key=ep.token, max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=ep.tls.ssl_context())) as client:
        model = client.models.list().data[0].id
        out = client.chat.completions.create(model=model, max_tokens=12, temperature=0,
                                             messages=[{"role": "user", "content": "Which city is the capital "
                                                                                   "of France?"}])
    assert "Paris" in out.choices[0].message.content


def test_plaintext_clients_are_refused(tls_daemon, tmp_path):
    plain = Endpoint(tls_daemon.address, tls_daemon.token, "test")
    with pytest.raises(grpc.RpcError) as e:
        rpc.FleetStub(sync_channel(plain)).List(pb.ListDucksRequest(), timeout=10)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{tls_daemon.http_address}/health", timeout=10)
    # duckctl with the address and token but no runtime file to learn TLS from: refused, and told why
    r = duckctl("--address", tls_daemon.address, "--token", tls_daemon.token, "status", state_home=tmp_path)
    assert r.returncode == 1
    assert "if it serves TLS" in r.stderr and "--fingerprint" in r.stderr


def test_a_pinned_fingerprint_connects_from_elsewhere_and_a_wrong_one_is_refused(tls_daemon, tmp_path):
    right = runtime(tls_daemon)["tls_fingerprint"]
    args = ("--address", tls_daemon.address, "--token", tls_daemon.token)
    r = duckctl(*args, "--fingerprint", right.replace(":", "").lower(), "status", state_home=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "SERVING" in r.stdout
    wrong = "AB" * 32
    r = duckctl(*args, "--fingerprint", wrong, "status", state_home=tmp_path)
    assert r.returncode == 1
    assert f"presented a certificate with SHA-256 fingerprint {right}" in r.stderr
    assert ":".join(["AB"] * 32) in r.stderr and "nothing was sent" in r.stderr


def test_a_certificate_that_is_not_the_daemons_is_a_clear_error(tls_daemon, tmp_path):
    other, _, _ = make_ca(tmp_path, "some other CA")
    r = duckctl("--address", tls_daemon.address, "--token", tls_daemon.token, "--ca", str(other), "status",
                state_home=tmp_path)
    assert r.returncode == 1
    assert f"presented a certificate that --ca {other} does not vouch for" in r.stderr
    # the daemon's own certificate, copied elsewhere, is trusted the same way
    r = duckctl("--address", tls_daemon.address, "--token", tls_daemon.token, "--ca",
                str(tls_daemon.state_dir / "tls.crt"), "status", state_home=tmp_path)
    assert r.returncode == 0, r.stderr


def test_a_runtime_file_whose_certificate_changed_is_refused(tls_daemon, tmp_path):
    state = tmp_path / "duck"
    state.mkdir()
    info = runtime(tls_daemon)
    info["tls_fingerprint"] = "00" * 32
    (state / "duckd.json").write_text(json.dumps(info))
    with pytest.raises(DiscoveryError, match="the file changed after duckd started"):
        discover(state_dir=state)


def test_the_generated_certificate_is_reused_across_restarts_and_its_key_is_private(tmp_path):
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=1, daemon={"tls": True}), state)
    try:
        first = runtime(daemon.start(wait_ready=False))["tls_fingerprint"]
        assert health(daemon.endpoint).status in (health_pb2.HealthCheckResponse.SERVING,
                                                  health_pb2.HealthCheckResponse.NOT_SERVING)
        daemon.stop()
        assert runtime(daemon.start(wait_ready=False))["tls_fingerprint"] == first
        assert stat.S_IMODE((state / "tls.key").stat().st_mode) == 0o600
    finally:
        daemon.stop()
    assert "made a TLS certificate" in daemon.log() and daemon.log().count(f"fingerprint {first}") == 2


def test_an_operators_ca_signed_certificate_serves_grpc_and_https(tmp_path):
    ca_file, ca_key, ca_cert = make_ca(tmp_path)
    cert_file, key_file = issue(tmp_path, ca_key, ca_cert, ["localhost", "127.0.0.1"])
    state = tmp_path / "duck"
    daemon = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=1,
                                    daemon={"tls": True, "tls_cert": str(cert_file), "tls_key": str(key_file)}), state)
    try:
        daemon.start(wait_ready=False)
        assert runtime(daemon)["tls_cert"] == str(cert_file) and not (state / "tls.crt").exists()
        health(daemon.endpoint)                     # trusting the daemon's certificate, from the runtime file
        by_ca = discover(daemon.address, daemon.token, ca=str(ca_file), state_dir=tmp_path / "elsewhere")
        health(by_ca)                               # trusting the CA that signed it
        try:
            status, _ = https_get(daemon.endpoint, "/health", by_ca.tls.ssl_context())
        except urllib.error.HTTPError as e:          # 503 while the model loads: TLS went through all the same
            status = e.code
        assert status in (200, 503)
    finally:
        daemon.stop()
    assert "operator's certificate" in daemon.log()


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def test_bad_certificate_files_are_named(tmp_path):
    ca_file, ca_key, ca_cert = make_ca(tmp_path)
    cert_file, key_file = issue(tmp_path, ca_key, ca_cert, ["localhost"])

    def start(cert, key):
        return tls.server_cert(Config(daemon=DaemonConfig(tls=True, tls_cert=str(cert), tls_key=str(key))))

    with pytest.raises(ConfigError, match=f"daemon.tls_cert = '{tmp_path}/missing.crt': no such file"):
        start(tmp_path / "missing.crt", key_file)
    garbage = tmp_path / "garbage.key"
    garbage.write_text("not a key\n")
    with pytest.raises(ConfigError, match=f"daemon.tls_key = '{garbage}': not a PEM private key"):
        start(cert_file, garbage)
    with pytest.raises(ConfigError, match=f"daemon.tls_cert = '{garbage}': not a PEM certificate"):
        start(garbage, key_file)
    other_key = tmp_path / "other.key"
    other_key.write_bytes(_pem_key(ca_key))     # a real key, not the certificate's
    with pytest.raises(ConfigError, match=f"daemon.tls_key = '{other_key}' is not the key of daemon.tls_cert = "
                                          f"'{cert_file}' \\(their public keys differ\\)"):
        start(cert_file, other_key)
    expired_dir = tmp_path / "expired"
    expired_dir.mkdir()
    old_cert, old_key = issue(expired_dir, ca_key, ca_cert, ["localhost"], days=-1)
    with pytest.raises(ConfigError, match=f"daemon.tls_cert = '{old_cert}': expired on"):
        start(old_cert, old_key)


def test_duckd_refuses_to_start_on_a_key_that_is_not_the_certificates(tmp_path):
    ca_file, ca_key, ca_cert = make_ca(tmp_path)
    cert_file, _ = issue(tmp_path, ca_key, ca_cert, ["localhost"])
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(_pem_key(ca_key))
    cfg = write_config(tmp_path / "duckd.toml", tmp_path / "duck", ducks=1,
                       daemon={"tls": True, "tls_cert": str(cert_file), "tls_key": str(wrong)})
    r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert f"config error: daemon.tls_key = '{wrong}' is not the key of daemon.tls_cert" in r.stderr


def test_allow_remote_without_tls_is_refused_at_start_unless_overridden(tmp_path):
    cfg = tmp_path / "duckd.toml"
    cfg.write_text('[daemon]\nlisten = "0.0.0.0:7433"\nallow_remote = true\n')
    r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(cfg), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2
    assert "daemon.allow_remote = true without daemon.tls" in r.stderr
    assert "set daemon.tls = true" in r.stderr and "daemon.allow_insecure_remote = true" in r.stderr
    cfg.write_text('[daemon]\nlisten = "0.0.0.0:7433"\nallow_remote = true\nallow_insecure_remote = true\n')
    r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(cfg), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cfg.write_text('[daemon]\nlisten = "0.0.0.0:7433"\nallow_remote = true\ntls = true\n')
    r = subprocess.run([sys.executable, "-m", "duckd.main", "--config", str(cfg), "--check"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_generated_certificate_names_loopback_the_host_and_the_bind_address(tmp_path):
    import socket
    d = DaemonConfig(tls=True, state_dir=str(tmp_path), listen="127.0.0.2:7433", http_listen="[::1]:7434")
    cert = tls.server_cert(Config(daemon=d))
    from cryptography import x509
    sans = x509.load_pem_x509_certificate(cert.chain_pem).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    names = set(sans.get_values_for_type(x509.DNSName)) | {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    assert names == {"localhost", "127.0.0.1", "::1", "127.0.0.2", socket.gethostname().lower()}
    assert tls.server_cert(Config(daemon=d)).fingerprint == cert.fingerprint
    # another bind address: a new certificate that names it too
    d2 = DaemonConfig(tls=True, state_dir=str(tmp_path), listen="127.0.0.3:7433")
    assert tls.server_cert(Config(daemon=d2)).fingerprint != cert.fingerprint
