"""The C decode-step driver (native/transport/step.c) where there is no GPU: it says
why it cannot run and touches nothing. On a GPU, tests/gpu/test_cuda_path.py holds it
to the Python driver bit for bit."""
from __future__ import annotations

import pytest

from native._native import ffi, lib
from native.transport.step import cuda_driver_problem

no_driver = cuda_driver_problem()


@pytest.mark.skipif(no_driver is None, reason="a CUDA driver is here: tests/gpu covers the step")
def test_without_a_cuda_driver_the_step_says_so():
    assert "libcuda" in no_driver or "CUDA" in no_driver
    step, res = ffi.new("duck_step *"), ffi.new("duck_step_result *")
    assert lib.duck_step_run(ffi.NULL, step, res) == lib.DUCK_STEP_ENOCUDA
    assert "CUDA" in ffi.string(res.message).decode()
    assert res.failed_call == -1


@pytest.mark.skipif(no_driver is None, reason="a CUDA driver is here: tests/gpu covers the step")
def test_the_lane_falls_back_to_python_without_cuda():
    """native_step needs a session, host io and the driver: without any of them, None (run_lane
    then drives the lane from Python)."""
    from engine.gpu.graphs import GraphLane

    class Backend:
        def step_session(self):
            return object()

    lane = GraphLane.__new__(GraphLane)   # no CUDA here to capture one: the selection logic alone
    lane._native, lane.drive_from_c, lane.host_io, lane.name = None, True, True, "test"
    assert lane.native_step(object()) is None and not lane.driven_from_c   # no session
    assert lane.native_step(Backend()) is None and not lane.driven_from_c  # no CUDA driver
