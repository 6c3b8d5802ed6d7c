"""model.gpu_ffn_budget in a real daemon: the model's device (here the CPU, told a budget: a GPU
host takes what is free by default) computes the FFN layers the plan gives it and the ducks the
rest; duckctl status, ModelInfo and /metrics say where the bytes are, and the greedy answer is
the one the ducks alone give. Real duckd, real duckfw, real gRPC."""
import json
import urllib.request

import pytest

from duck_proto import duck_pb2 as pb
from duck_proto import duck_pb2_grpc as rpc
from duckd.config import ConfigError, ModelConfig, parse_budget
from tests.duckd.test_api import duckctl
from tests.duckd_fixture import RunningDaemon, write_config

QUESTION = "Which city is the capital of France?"


def test_budget_parses_bytes_fractions_and_auto_and_names_the_key_when_wrong():
    assert parse_budget("auto", 1000) == 1000 and parse_budget("0", 1000) == 0
    assert parse_budget("24G", 0) == 24 << 30 and parse_budget("512M", 0) == 512 << 20
    assert parse_budget("0.5", 1000) == 500 and parse_budget("100", 7) == 100
    for bad in ("lots", "-1G", "1.5", "12Q"):
        with pytest.raises(ConfigError, match="model.gpu_ffn_budget"):
            ModelConfig(gpu_ffn_budget=bad)


def test_a_budget_puts_layers_on_the_models_device_and_status_shows_it(tmp_path, duckd_daemon):
    want, _ = duckd_daemon.chat(QUESTION, max_tokens=12)
    state = tmp_path / "state"
    # SmolLM2-135M: 30 dense MLP layers of 2.65 M weights, on the CPU decoded fp32 copies: 35 MB holds 3 whole
    d = RunningDaemon(write_config(tmp_path / "duckd.toml", state, ducks=2, model={"gpu_ffn_budget": "35M"}),
                      state).start()
    try:
        info = rpc.ModelStub(d.channel()).Info(pb.ModelInfoRequest(), timeout=10)
        assert info.gpu_layers_whole == 3 and info.duck_calls_per_token == 27
        assert 0.03 < info.gpu_ffn_gb <= 0.037 and info.duck_gb_per_token > 0
        got, stats = d.chat(QUESTION, max_tokens=12)
        assert got == want and "Paris" in got
        r = duckctl(d, "--config", str(d.config), "status")
        assert r.returncode == 0, r.stderr
        assert "3 layers whole" in r.stdout and "in 27 calls" in r.stdout
        status = json.loads(duckctl(d, "--config", str(d.config), "status", "--json").stdout)
        assert status["model"]["gpuLayersWhole"] == 3
        req = urllib.request.Request(f"http://{d.http_address}/metrics", headers={"Authorization": f"Bearer {d.token}"})
        text = urllib.request.urlopen(req, timeout=10).read().decode()
        assert "duck_placement_gpu_layers_whole 3.0" in text and "duck_placement_duck_bytes_per_token" in text
        # placed again without a restart: none, then six layers; the answer stays
        r = duckctl(d, "--config", str(d.config), "placement", "--budget", "0")
        assert r.returncode == 0 and "0 layers whole" in r.stdout and "in 30 calls" in r.stdout, r.stderr
        assert d.chat(QUESTION, max_tokens=12)[0] == want
        r = duckctl(d, "--config", str(d.config), "placement", "--budget", "70M", "--json")
        assert r.returncode == 0 and json.loads(r.stdout)["gpuLayersWhole"] == 6, r.stderr
        assert d.chat(QUESTION, max_tokens=12)[0] == want
        r = duckctl(d, "--config", str(d.config), "placement", "--budget", "lots")
        assert r.returncode == 1 and "INVALID_ARGUMENT" in r.stderr and "budget = 'lots'" in r.stderr
        info = rpc.ModelStub(d.channel()).Info(pb.ModelInfoRequest(), timeout=10)
        assert info.gpu_layers_whole == 6           # a refused request changed nothing
    finally:
        d.stop()
