"""A real duckd for tests: the `duckd` process with a local fleet of real
duckfw processes on loopback, gRPC on a free port, state in a temp folder.
It lives in bench/live_daemon.py, which the benchmarks (bench.chaos,
bench.lost_duck) start too."""
from bench.live_daemon import ROOT, RunningDaemon, all_serving, max_gap, raw_post, write_config

__all__ = ["ROOT", "RunningDaemon", "all_serving", "max_gap", "raw_post", "write_config"]
