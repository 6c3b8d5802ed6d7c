"""engine.gpu.moe, the every-FFN-on-the-GPU backend: its Triton grouped GEMV under the
Triton interpreter (a subprocess with TRITON_INTERPRET=1, as Triton decides between
interpreter and compiler at import) against the torch reference and float64, on odd
shapes, with outputs NaN-poisoned; the stacked layout against the per-expert reference."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from engine.ffn import ExpertWeights, torch_experts_forward
from engine.gpu.moe import GpuExpertsFfn, stack_experts

ROOT = Path(__file__).parents[2]


def _experts(n: int, hidden: int, inter: int, gen: torch.Generator) -> list[ExpertWeights]:
    return [ExpertWeights(torch.randn(inter, hidden, generator=gen) / hidden ** 0.5,
                          torch.randn(inter, hidden, generator=gen) / hidden ** 0.5,
                          torch.randn(hidden, inter, generator=gen) / inter ** 0.5) for _ in range(n)]


def check_grouped_kernel() -> None:
    """Runs in the interpreter subprocess: grouped GEMV and the whole grouped forward."""
    from engine.gpu import moe

    gen = torch.Generator().manual_seed(3)
    for t, k, e, hidden, inter in [(1, 3, 5, 200, 72), (2, 4, 7, 130, 40), (3, 2, 3, 64, 150)]:
        experts = _experts(e, hidden, inter, gen)
        gate_up, down = stack_experts(experts)
        x = torch.randn(t, hidden, generator=gen)
        ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
        w = torch.rand(t, k, generator=gen)
        h = moe.grouped_gemv(x, ids.to(torch.int32), gate_up, k)
        exact_h = torch.stack([gate_up[ids.flatten()[j]].double() @ x[j // k].double() for j in range(t * k)])
        assert not h.isnan().any(), "grouped GEMV left elements unwritten"
        err = ((h.double() - exact_h).abs().max() / exact_h.abs().max()).item()
        assert err < 1e-5, f"grouped GEMV T={t} k={k} E={e}: rel err {err:.1e}"
        y = moe.grouped_experts_forward(gate_up, down, x, ids.to(torch.int32), w)
        ref = torch_experts_forward([ExpertWeights(*(p.double() for p in (x_.gate, x_.up, x_.down)))
                                     for x_ in experts], x.double(), ids, w.double())
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-5, f"grouped forward T={t} k={k} E={e}: rel err {err:.1e} vs float64"


def test_grouped_gemv_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", "from tests.engine.test_gpu_moe import check_grouped_kernel as c; c()"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, f"interpreted grouped GEMV failed:\n{run.stdout}\n{run.stderr[-3000:]}"


def test_stacked_layout_on_the_cpu_equals_the_reference():
    gen = torch.Generator().manual_seed(4)
    experts = _experts(6, 48, 20, gen)
    backend = GpuExpertsFfn()
    backend.add_stacked(0, *stack_experts(experts))
    x = torch.randn(5, 48, generator=gen)
    ids = torch.randint(0, 6, (5, 2), generator=gen)
    w = torch.rand(5, 2, generator=gen)
    torch.testing.assert_close(backend.forward(0, x, ids, w), torch_experts_forward(experts, x, ids, w))
