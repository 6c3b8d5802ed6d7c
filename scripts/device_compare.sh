#!/usr/bin/env bash
# On the lent GPU host, in one call: llama.cpp (the peer, experts in CPU memory, several micro-batches)
# and duck (bench.prefill_compare: the fleet alone, the GPU alone, both) on the same machine, one
# after the other, merged into $OUT/<date>-compare-<shape>-<machine>.json (bench.compare_merge).
#   PEERS=dir LLAMA_SRC=dir [LLAMA_BUILD=dir] SHAPES="qwen3 deepseek" MACHINE=h100 bash scripts/device_compare.sh
# PEERS holds llamacpp_cpu_moe.sh and its GGUF writers; LLAMA_BUILD a llama.cpp build kept between
# calls (built there if it has no bin/llama-bench). BUILD_ONLY=1 builds and stops; SKIP_DUCK_BUILD=1
# takes duck's build as it is. PROMPTS
# (512,2048,8192) and UBATCHES (512,2048,8192) go to both tools; DUCK_ARGS to bench.prefill_compare.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PROMPTS=${PROMPTS:-512,2048,8192}; UBATCHES=${UBATCHES:-512,2048,8192}; MACHINE=${MACHINE:-h100}
LLAMA_BUILD=${LLAMA_BUILD:-/tmp/llama-build}; SHAPES=${SHAPES:-qwen3}
t0=$(date +%s); say() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
if [ "${SKIP_DUCK_BUILD:-0}" != 1 ]; then
    bash scripts/device_build.sh >"$OUT/build.log" 2>&1 && python3 firmware/build.py >>"$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD
if [ ! -x "$LLAMA_BUILD/bin/llama-bench" ]; then
    say "building llama.cpp into $LLAMA_BUILD"
    cmake -S "${LLAMA_SRC:?set LLAMA_SRC}" -B "$LLAMA_BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_NATIVE=ON -DGGML_CUDA_NCCL=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DGGML_CUDA_COMPRESSION_MODE=none >"$OUT/llama-cmake.log" 2>&1 || { tail -20 "$OUT/llama-cmake.log"; exit 1; }
    cmake --build "$LLAMA_BUILD" --target llama-bench -j"$(nproc)" >"$OUT/llama-build.log" 2>&1 \
        || { tail -20 "$OUT/llama-build.log"; exit 1; }
    say "llama.cpp built"
fi
[ "${BUILD_ONLY:-0}" = 1 ] && exit 0
for shape in $SHAPES; do
    case $shape in
    qwen3) synth="--synthetic qwen3-30b-a3b"; gpu_layers=12 ;;         # a quarter of the layers' experts
    deepseek) synth="--synthetic deepseek-v3 --layers 4 --dense-layers 1"; gpu_layers= ;;
    *) echo "SHAPES: qwen3 or deepseek, not $shape"; exit 2 ;;
    esac
    say "$shape: llama.cpp"
    SHAPE=$shape PROMPTS=$PROMPTS UBATCHES=$UBATCHES DEPTHS=0 CPU_ONLY=0 GPU_LAYERS=$gpu_layers BUILD=$LLAMA_BUILD \
        OUT="$OUT/llama-$shape" \
        bash "${PEERS:?set PEERS}/llamacpp_cpu_moe.sh" >"$OUT/llama-$shape.log" 2>&1
    grep "^|" "$OUT/llama-$shape.log" | tail -12
    say "$shape: duck"
    python3 -m bench.prefill_compare $synth --pin-ducks --prompts "$PROMPTS" ${DUCK_ARGS:-} \
        --json "$OUT/duck-$shape.json" 2>"$OUT/duck-$shape.log"
    rc=$?; grep -E "prefill [0-9]+:|Error|error" "$OUT/duck-$shape.log" | tail -12
    [ $rc -eq 0 ] || { tail -30 "$OUT/duck-$shape.log"; continue; }
    name="$(date +%F)-compare-$shape-$MACHINE.json"
    gpu_rows=()
    [ -n "$gpu_layers" ] && gpu_rows=(--llama-gpu "$OUT/llama-$shape/${shape}_cpu_moe_gpu$gpu_layers.jsonl")
    python3 -m bench.compare_merge --duck "$OUT/duck-$shape.json" --llama "$OUT/llama-$shape/${shape}_cpu_moe.jsonl" \
        "${gpu_rows[@]}" --shape "$shape" --machine "$MACHINE" >"$OUT/$name" && python3 - "$OUT/$name" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("duck", "duck_gpu_only", "duck_fleet_only", "llama_cpp", "llama_cpp_ub512"):
    print(f"{k:16s} decode {d[k]['decode_tok_s']}  prefill {d[k]['prefill_tok_s']}")
print("pcie", d["pcie_gbps"], "read", d["read_gbps"], "ttft_1024", d["duck"]["ttft_s_1024"], "limit", d["duck"]["pcie_limit_tok_s"])
print("ratios", json.dumps(d["ratios"]))
for k, v in d.items():
    if k.startswith("duck_budget_"):
        print(f"{k:22s} decode {v['decode_tok_s']:.1f}  ducks {v['duck_gb_per_token']:.3f} GB/token  gpu {v['plan'].get('gpu_gb')} GB")
print("llama gb/token", d.get("llama_cpp_gb_per_token"), "llama gpu quarter", d.get("llama_cpp_gpu_quarter", {}).get("decode_tok_s"))
print("placement", json.dumps(d.get("placement_ratios")))
PY
    say "$shape: done"
done
