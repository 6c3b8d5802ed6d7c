"""engine.gpu.fp8 on CPU: the Triton kernels under the Triton interpreter against the
torch reference and a float64 product, on shapes that are no multiple of the 128x128
scale blocks, outputs NaN-poisoned beforehand; Fp8Linear swapped into a tiny DeepSeek
fp8 checkpoint reproduces the dequantized model.

Triton decides between interpreter and compiler when a @triton.jit decorator runs:
its own library functions (tl.cdiv, tl.sum, ...) when triton is imported, ours when
engine.gpu.fp8 is. The two cannot share a process, so the interpreted checks run in
one worker process started with TRITON_INTERPRET=1 (the `interpreted` fixture of
tests/engine/conftest.py); this process, which may hold compiled kernels (GPU tests),
never sets it.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from engine.generate import forward_logits
from engine.gpu import fp8
from engine.loader import load_model
from engine.weights import WeightError, dequantize_fp8_blocks
from tests.engine.conftest import write_word_tokenizer
from tests.engine.test_deepseek import hf_deepseek
from tests.engine.test_deepseek_fp8 import _quantized, quantize_ue8m0

FP32_RTOL = 1e-5         # fp32 x: max |y - exact| / max |exact|; fp32 sums of K <= 300 products
BF16_ULP = 2.0 ** -8     # bf16 x: one bf16 ulp of |exact| (a rounding of sums that differ in the last fp32 bits)
LOGITS_RTOL = 1e-5       # Fp8Linear model vs the dequantized nn.Linear model, fp32

Cfg = fp8.Fp8LinearConfig


def random_fp8_weight(n: int, k: int, gen: torch.Generator, block=(128, 128), ue8m0: bool = True):
    """Codes [n, k] and block scales: from our ue8m0 quantizer (powers of two) of a weight
    whose magnitude varies by row and column, or random codes with arbitrary float scales."""
    if ue8m0:
        assert block == (128, 128), "quantize_ue8m0 makes 128x128 blocks"
        w = torch.randn(n, k, generator=gen) * 2.0 ** torch.randint(-3, 4, (n, 1), generator=gen)
        return quantize_ue8m0(w * 2.0 ** torch.randint(-3, 4, (1, k), generator=gen))
    codes = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) + 0.5) * 1e-3
    return codes, scale


def assert_close_to_exact(y: torch.Tensor, exact: torch.Tensor, what: str):
    assert not y.isnan().any(), f"{what}: NaN in the output: elements left unwritten"
    top = exact.abs().max().item()
    if y.dtype == torch.float32:
        err = (y.double() - exact).abs().max().item() / top
        assert err <= FP32_RTOL, f"{what}: max err {err:.2e} of max |y| > {FP32_RTOL:.0e}"
    else:
        bound = BF16_ULP * exact.abs() + FP32_RTOL * top
        worst = ((y.double() - exact).abs() / bound).max().item()
        assert worst <= 1.0, f"{what}: error {worst:.2f}x the bound of one bf16 ulp + {FP32_RTOL:.0e} of max |y|"


def check_kernel(t: int, n: int, k: int, dtype: torch.dtype, config, seed: int, block=(128, 128),
                 ue8m0: bool = True, transposed_x: bool = False) -> None:
    """Triton vs the reference vs float64 for one shape and tiling (in the worker)."""
    gen = torch.Generator().manual_seed(seed)
    codes, scale = random_fp8_weight(n, k, gen, block, ue8m0)
    # the weight as a view of a wider tensor (row stride > K): kernels must follow its strides
    padded = torch.full((n + 8, k + 16), 448.0, dtype=torch.float8_e4m3fn)
    padded[:n, :k] = codes
    codes = padded[:n, :k]
    x = torch.randn(k, t, generator=gen).T if transposed_x else torch.randn(t, k, generator=gen)
    x = x.to(dtype)
    full = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    exact = x.double() @ (codes.double() * full).T                                                # [T, N]
    ref = fp8.fp8_linear_ref(x, codes, scale, block)
    cfg = config or fp8.choose_config(t, n, k, block, sm_count=4)
    splits, _ = fp8.k_splits(k, cfg)
    out = torch.full((t, n), float("nan"), dtype=dtype)
    workspace = torch.full((splits, t, n), float("nan"))
    y = fp8.fp8_linear_triton(x, codes, scale, block, config=cfg, out=out, workspace=workspace)
    what = f"T={t} N={n} K={k} {dtype} {cfg} seed={seed}"
    assert y is out and y.dtype == dtype
    assert_close_to_exact(ref, exact, "reference " + what)
    assert_close_to_exact(y, exact, "triton " + what)


# T from a decode step to a prefill; the default tiling (sm_count=4) and explicit ones,
# split-K included; N=200, K=300: two and three scale blocks, each dimension's last one short
KERNEL_CASES = [
    (1, None), (1, Cfg("gemv", 1, 16, 32, split_k=3)), (1, Cfg("gemm", 16, 32, 64, split_k=2)),
    (2, None), (2, Cfg("gemm", 16, 16, 32)),
    (5, None), (5, Cfg("gemv", 8, 32, 64, split_k=2)),
    (64, None), (64, Cfg("gemm", 32, 64, 32, split_k=4)),
    (150, None), (150, Cfg("gemm", 64, 32, 64)),
]


@pytest.mark.parametrize("t,config", KERNEL_CASES, ids=[f"T{t}-{c.kind if c else 'auto'}{i}"
                                                        for i, (t, c) in enumerate(KERNEL_CASES)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference_and_float64(interpreted, t, config, dtype):
    interpreted(check_kernel, t, 200, 300, dtype, config, 1000 * t + KERNEL_CASES.index((t, config)))


def check_short_single_block_and_strided_x() -> None:
    for t, cfg in [(3, None), (3, Cfg("gemm", 16, 16, 16, split_k=3)), (17, None)]:
        check_kernel(t, 40, 72, torch.bfloat16, cfg, seed=t, transposed_x=True)


def test_triton_short_single_block_and_strided_x(interpreted):
    """Both dimensions within one short block; x read through strides (a transposed view)."""
    interpreted(check_short_single_block_and_strided_x)


def check_other_scale_blocks_and_float_scales() -> None:
    for t, cfg in [(2, Cfg("gemv", 2, 32, 32, split_k=2)), (20, Cfg("gemm", 16, 32, 16, split_k=2)), (9, None)]:
        check_kernel(t, 100, 150, torch.float32, cfg, seed=50 + t, block=(64, 32), ue8m0=False)
    with pytest.raises(ValueError, match="block_k=64 does not divide"):
        check_kernel(2, 100, 150, torch.float32, Cfg("gemv", 2, 32, 64), seed=0, block=(64, 32), ue8m0=False)


def test_triton_other_scale_blocks_and_float_scales(interpreted):
    """Scale blocks other than 128x128 (a k tile covers part of one) and non-power-of-two scales."""
    interpreted(check_other_scale_blocks_and_float_scales)


def test_reference_and_kernel_refuse_mismatched_inputs():
    codes = torch.zeros(200, 300, dtype=torch.float8_e4m3fn)
    with pytest.raises(WeightError, match=r"weight_scale_inv has shape \(2, 2\), expected \(2, 3\)"):
        fp8.fp8_linear_ref(torch.zeros(1, 300), codes, torch.ones(2, 2))
    with pytest.raises(WeightError, match="float8_e4m3fn"):
        fp8.fp8_linear_triton(torch.zeros(1, 300), codes.float(), torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"x must be \[T, 300\]"):
        fp8.fp8_linear_triton(torch.zeros(1, 299), codes, torch.ones(2, 3))
    with pytest.raises(ValueError, match="tiles must be powers of two|powers of two"):
        Cfg("gemm", 16, 48, 32)


def test_compiled_kernels_on_cpu_fall_back_to_the_reference():
    """Without the interpreter the kernels need CUDA: Fp8Linear falls back, the kernel says why."""
    if fp8.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set for the whole run: engine.gpu.fp8 is interpreted here too")
    gen = torch.Generator().manual_seed(7)
    codes, scale = random_fp8_weight(130, 140, gen)
    x = torch.randn(3, 140, generator=gen)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fp8.fp8_linear_triton(x, codes, scale)
    layer = fp8.Fp8Linear(codes, scale)
    assert torch.equal(layer(x), fp8.fp8_linear_ref(x, codes, scale))


HOPPER = ("cuda", 90, 32)     # the GPU host's target (H100 / H200)
ALIGNED_INTS = {"N", "K", "stride_xt", "stride_wn", "stride_ot", "numel"}   # multiples of 16 on real shapes


def compile_for_hopper(kernel, constexprs: dict, x_type: str, num_warps: int, num_stages: int):
    """The kernel compiled for sm_90 by Triton's own ptxas, without a GPU, specialized as a
    launch on 16-byte aligned contiguous tensors would be (unit strides are constants)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    pointer_types = {"x_ptr": x_type, "w_ptr": "fp8e4nv", "s_ptr": "fp32", "out_ptr": "bf16", "ws_ptr": "fp32"}
    signature = {a: "constexpr" if a in constexprs else f"*{pointer_types[a]}" if a.endswith("_ptr") else "i32"
                 for a in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names)
             if a not in constexprs and (a.endswith("_ptr") or a in ALIGNED_INTS)}
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget(*HOPPER),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def stack_bytes(cubin: bytes) -> int:
    """Local memory per thread (register spills) of a cubin, from cuobjdump -res-usage."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    assert tool.exists(), f"{tool} is missing: triton's wheel ships it (is triton pinned in the test extra?)"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"STACK:(\d+)", usage)
    assert found, f"no STACK figure in cuobjdump's output: {usage[:500]}"
    return int(found.group(1))


def test_default_tilings_compile_for_hopper_without_spills():
    """What the interpreter cannot show: the compiled kernels lower for sm_90, the tl.dot
    kernel on wgmma, and no default tiling spills registers."""
    if fp8.INTERPRETED:
        pytest.skip("TRITON_INTERPRET=1 is set for the whole run: nothing here is compiled")
    configs = {fp8.choose_config(t, n, k, sm_count=132) for t in (1, 2, 4, 16, 64, 1024)
               for n, k in ((1536, 7168), (7168, 16384))}
    unit = dict(stride_xk=1, stride_wk=1, stride_sk=1, stride_on=1, SCALE_BN=128, SCALE_BK=128)
    launches = [(fp8._fp8_gemv_kernel if c.kind == "gemv" else fp8._fp8_gemm_kernel, "bf16", c) for c in configs]
    launches.append((fp8._fp8_gemm_kernel, "fp32", Cfg("gemm", 16, 64, 128, num_stages=3)))
    for kernel, x_type, cfg in sorted(launches, key=str):
        constexprs = dict(unit, BLOCK_T=cfg.block_t, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        if cfg.kind == "gemm":
            constexprs["DOT_FP32"] = x_type == "fp32"
        compiled = compile_for_hopper(kernel, constexprs, x_type, cfg.num_warps, cfg.num_stages)
        if cfg.kind == "gemm" and x_type == "bf16":
            assert "wgmma" in compiled.asm["ptx"], f"{cfg}: tl.dot did not lower to wgmma"
        spilled = stack_bytes(compiled.asm["cubin"])
        assert spilled == 0, f"{cfg} x {x_type}: {spilled} bytes of registers spilled per thread on sm_90"
    summed = compile_for_hopper(fp8._sum_splits_kernel, dict(BLOCK=fp8.SUM_BLOCK), "fp32", 4, 1)
    assert stack_bytes(summed.asm["cubin"]) == 0


def check_fp8_linear_module() -> None:
    gen = torch.Generator().manual_seed(11)
    codes, scale = random_fp8_weight(136, 200, gen)
    bias = torch.randn(136, generator=gen)
    layer = fp8.Fp8Linear(codes, scale, bias)
    x = torch.randn(2, 3, 200, generator=gen)                                   # [B, S, K]
    want = F.linear(x, dequantize_fp8_blocks(codes, scale), bias)
    got = layer(x)
    assert got.shape == (2, 3, 136)
    assert (got - want).abs().max() <= FP32_RTOL * want.abs().max()
    assert set(layer.state_dict()) == {"weight", "weight_scale_inv", "bias"}
    layer.to(torch.bfloat16)   # a model-wide dtype change must not re-type the codes or scales
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale_inv.dtype == torch.float32
    assert layer.bias.dtype == torch.bfloat16 and torch.equal(layer.weight.view(torch.uint8), codes.view(torch.uint8))
    got16 = layer(x.to(torch.bfloat16))
    assert got16.dtype == torch.bfloat16
    assert (got16.float() - want).abs().max() <= 0.02 * want.abs().max()   # bf16 x, bias and output
    with pytest.raises(WeightError, match="expected a 2-D float8_e4m3fn weight"):
        fp8.Fp8Linear(codes.float(), scale)


def test_fp8_linear_module(interpreted):
    """3-D input, bias, the checkpoint's buffer names; model.to(bf16) leaves the codes fp8."""
    interpreted(check_fp8_linear_module)


# hidden 192 = 128 + 64, q_lora 136, shared expert 72: projections in short blocks
TINY_ODD = dict(hidden_size=192, q_lora_rank=136, intermediate_size=200, moe_intermediate_size=72,
                num_hidden_layers=2)


def write_fp8_checkpoint(folder, seed: int = 5):
    """A tiny DeepSeek-V3 saved by transformers, its projections stored as ue8m0 fp8."""
    plain = folder / "plain"
    hf_deepseek("deepseek_v3", seed=seed, **TINY_ODD).save_pretrained(plain)
    (file,) = plain.glob("*.safetensors")
    stored = {}
    for name, t in load_file(file).items():
        if _quantized(name, t):
            stored[name], stored[name + "_scale_inv"] = quantize_ue8m0(t.float())
        else:
            stored[name] = t
    quant = folder / "fp8"
    quant.mkdir()
    save_file(stored, quant / file.name, metadata={"format": "pt"})
    cfg = json.loads((plain / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}
    (quant / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(quant, cfg["vocab_size"])
    return quant


def check_tiny_deepseek(folder: str) -> str:
    (file,) = Path(folder).glob("*.safetensors")
    stored = load_file(file)
    dense = load_model(folder, backend="torch").model
    model = load_model(folder, backend="torch").model
    prompt = torch.randint(2, dense.config.vocab_size, (11,), generator=torch.Generator().manual_seed(6)).tolist()
    want = forward_logits(dense, prompt)
    swapped = fp8.fp8_linears_from_checkpoint(model)
    kinds = {name.rsplit(".", 1)[-1] for name in swapped}
    assert kinds == {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all("self_attn" in n or "shared_experts" in n for n in swapped), f"an FFN of the backend in {swapped}"
    for name in swapped:
        layer = model.get_submodule(name)
        assert isinstance(layer, fp8.Fp8Linear)
        assert torch.equal(layer.weight.view(torch.uint8), stored[name + ".weight"].view(torch.uint8))
    before = sum(dense.get_submodule(n).weight.nbytes for n in swapped)
    after = sum(model.get_submodule(n).weight.nbytes + model.get_submodule(n).weight_scale_inv.nbytes for n in swapped)
    assert after < 0.26 * before, f"the swapped projections hold {after} bytes, dense fp32 {before}"

    got = forward_logits(model, prompt)                                          # prefill: the gemm kernel
    rel = ((got - want).abs().max() / want.abs().max()).item()
    ids, positions = torch.tensor(prompt), torch.arange(len(prompt))
    cache = model.make_cache(len(prompt))
    model(ids[:-1], positions[:-1], cache)
    last = model.compute_logits(model(ids[-1:], positions[-1:], cache))[0]      # a decode step: the gemv kernel
    rel_decode = ((last - want[-1]).abs().max() / want[-1].abs().max()).item()
    assert rel <= LOGITS_RTOL, f"prefill logits rel err {rel:.2e} > {LOGITS_RTOL:.0e}"
    assert rel_decode <= LOGITS_RTOL, f"decode logits rel err {rel_decode:.2e} > {LOGITS_RTOL:.0e}"
    return (f"tiny deepseek_v3 fp8: Fp8Linear (Triton, interpreted) vs dequantized nn.Linear logits: prefill "
            f"{rel:.1e}, decode {rel_decode:.1e}; {len(swapped)} host projections {before / after:.1f}x smaller")


def test_fp8_linears_from_checkpoint_on_tiny_deepseek(interpreted, tmp_path, report):
    """Attention and shared-expert projections become Fp8Linear holding the checkpoint's
    codes; kv_b_proj (read as a matrix) and the backend's FFNs stay; logits unchanged."""
    report(interpreted(check_tiny_deepseek, str(write_fp8_checkpoint(tmp_path))))


def test_bench_smoke_runs(tmp_path):
    """bench/gpu_fp8.py on the CPU under the interpreter: the script the GPU host runs stays runnable."""
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "bench" / "gpu_fp8.py"), "--smoke",
                          "--shapes", "kv_a", "--tokens", "1,16", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"bench --smoke exited {run.returncode}:\n{run.stdout}\n{run.stderr}"
    cases = json.loads(out.read_text())["cases"]
    assert [(c["shape"], c["t"]) for c in cases] == [("kv_a", 1), ("kv_a", 16)]
    assert all(c["rel_err_triton"] < 1e-2 for c in cases)



def test_load_model_keeps_fp8_when_asked(tmp_path):
    """load_model(keep_fp8=True): the projections come out as Fp8Linear holding the checkpoint's
    codes (the default on CUDA); the default on the CPU dequantizes, as before."""
    folder = write_fp8_checkpoint(tmp_path)
    kept = load_model(folder, backend="torch", keep_fp8=True).model
    plain = load_model(folder, backend="torch").model
    names = [n for n, m in kept.named_modules() if isinstance(m, fp8.Fp8Linear)]
    assert names and all("self_attn" in n or "shared_experts" in n for n in names)
    assert not any(isinstance(m, fp8.Fp8Linear) for m in plain.modules())
    assert all(kept.get_submodule(n).weight.dtype == torch.float8_e4m3fn for n in names)
