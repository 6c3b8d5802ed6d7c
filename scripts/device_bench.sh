#!/usr/bin/env bash
# On the lent GPU host (no pip, no network): builds native/ and duckfw, then runs
# the named steps, logs and JSON into $OUT. Steps:
#   gputests   tests/gpu (the CUDA path, the compiled Triton fp8 kernels)
#   gpuquick   the host-contract graph path on the GPU (a subset of tests/gpu/test_cuda_path.py)
#   hosttests  the CPU host decoder on this CPU's kernel sets (AVX-512 where the dev VM has only AVX2):
#              native/host/test_host.c, tests/native/test_host_kernels.py, tests/engine/test_cpu_decode.py
#   fp8tests   tests/gpu/test_fp8_cuda.py alone
#   fp8        bench/gpu_fp8.py (Triton fp8 block-scale linear vs bf16 matmul)
#   deepseek   bench e2e --synthetic deepseek-v32 (full widths, 4 layers: 1 dense + 3 MoE)
#   qwen3      bench e2e --synthetic qwen3-30b-a3b (all 48 layers); qwen3spin: ducks spin DUCK_SPIN us first
#   qwen35     bench e2e --synthetic qwen3.5-35b-a3b (all 40 layers)
#   transport  bench transport, 4 ducks x 4 threads, with a prefill chunk (CHUNK, default 512x2048)
#   kernels    bench kernels at 1, 4 and 16 threads (AVX2 and AVX-512 sets, int8 peers,
#              both MoE shapes, pool wake-up) and the standalone C test of the kernels
#   gemmparts  the C test, then the amx prefill GEMM alone on the DeepSeek and Qwen3 slices (GMODELS)
#              at 8-128 tokens per expert (GTOKENS), 4 and 16 threads (KTHREADS), with each of its
#              parts left out in turn (bench kernels --amx-parts)
# The fleet is 4 ducks x 4 threads on this host's 16 cores (loopback), each duck pinned to
# 4 CPUs of its own as 4 boxes would be, and like such boxes spinning 1000 us before it blocks
# (bench e2e's default with --pin-ducks; "--duck-spin-us 0" in E2E_ARGS: blocking ducks;
# PIN=0: unpinned and blocking). Environment:
#   STEPS (decode steps, 8), E2E_ARGS (more bench e2e arguments, e.g. "--prompts 16 --no-pairs
#   --backends fleet --duck-spin-us 300"; "--batch 1,8,32" adds continuous batching on the torch
#   path, what a GPU host's duckd runs), TAG (suffix of the e2e file names), KTHREADS (1,4,16),
#   DUCKS x DTHREADS (the fleet of the deepseek and qwen3 steps, 4 x 4; the file names then say
#   e.g. -8x2)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bash scripts/device_build.sh >"$OUT/build.log" 2>&1 && python3 firmware/build.py >>"$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
GRAPHS=""
STEPS=${STEPS:-8}
E2E_ARGS=${E2E_ARGS:-}
[ "${PIN:-1}" = 1 ] && E2E_ARGS="--pin-ducks $E2E_ARGS"
TAG=${TAG:-}
DUCKS=${DUCKS:-4}
DTHREADS=${DTHREADS:-4}
[ "$DUCKS" = 4 ] && [ "$DTHREADS" = 4 ] || TAG="-${DUCKS}x${DTHREADS}$TAG"
c_test() {   # the standalone C test of the kernels (on the tiles where the CPU has AMX)
    gcc -std=gnu11 -O2 -Wall $(python3 -c 'from native import sources as s; print(" ".join(
        [f"-I{d}" for d in s.INCLUDE_DIRS] + s.FP9 + s.KERNELS + s.C_TESTS))') -lpthread -lm -o /tmp/test_native \
        && /tmp/test_native 2>&1 | tail -3
}
for step in "$@"; do
    echo "=== $step $(date +%T)"
    case $step in
    gputests)
        python3 -m pytest -q -x -p no:cacheprovider tests/gpu >"$OUT/gputests.log" 2>&1
        rc=$?; tail -25 "$OUT/gputests.log"
        [ $rc -eq 0 ] || GRAPHS="--no-graphs" ;;
    gpuquick)
        timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_cuda_path.py \
            -k "fp9_backend or host_backend_called or pair_graph or driven_from_c" >"$OUT/gpuquick.log" 2>&1
        rc=$?; tail -8 "$OUT/gpuquick.log"
        [ $rc -eq 0 ] || GRAPHS="--no-graphs" ;;
    hosttests)
        gcc -std=gnu11 -O2 -Wall $(python3 -c 'from native import sources as s; print(" ".join([f"-I{d}" for d in
            s.INCLUDE_DIRS] + s.HOST + s.HOST_C_TESTS + ["native/kernels/pool.c"]))') -lpthread -lm -o /tmp/test_host \
            && /tmp/test_host 2>&1 | tail -2
        python3 -m pytest -q -p no:cacheprovider tests/native/test_host_kernels.py tests/engine/test_cpu_decode.py \
            -k "not smollm2" >"$OUT/hosttests.log" 2>&1
        tail -4 "$OUT/hosttests.log" ;;
    fp8tests)
        python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp8_cuda.py >"$OUT/fp8tests.log" 2>&1
        tail -8 "$OUT/fp8tests.log" ;;
    fp8)
        python3 bench/gpu_fp8.py --json "$OUT/gpu_fp8.json" 2>&1 | tail -30 ;;
    deepseek)
        python3 -m bench.e2e_synthetic --synthetic deepseek-v32 --layers 4 --dense-layers 1 --ducks "$DUCKS" --duck-threads "$DTHREADS" \
            --steps "$STEPS" $GRAPHS $E2E_ARGS --json >"$OUT/e2e-deepseek$TAG.json" 2>"$OUT/e2e-deepseek$TAG.log"
        tail -4 "$OUT/e2e-deepseek$TAG.log"; python3 scripts/e2e_table.py "$OUT/e2e-deepseek$TAG.json" ;;
    qwen3)
        python3 -m bench.e2e_synthetic --synthetic qwen3-30b-a3b --ducks "$DUCKS" --duck-threads "$DTHREADS" \
            --steps "$STEPS" $GRAPHS $E2E_ARGS --json >"$OUT/e2e-qwen3$TAG.json" 2>"$OUT/e2e-qwen3$TAG.log"
        tail -4 "$OUT/e2e-qwen3$TAG.log"; python3 scripts/e2e_table.py "$OUT/e2e-qwen3$TAG.json" ;;
    qwen3spin)   # the same with the ducks spinning (yielding) DUCK_SPIN us before they block
        python3 -m bench.e2e_synthetic --synthetic qwen3-30b-a3b --ducks 4 --duck-threads 4 \
            --steps "$STEPS" $GRAPHS $E2E_ARGS --duck-spin-us "${DUCK_SPIN:-300}" --json \
            >"$OUT/e2e-qwen3-spin$TAG.json" 2>"$OUT/e2e-qwen3-spin$TAG.log"
        tail -4 "$OUT/e2e-qwen3-spin$TAG.log"; python3 scripts/e2e_table.py "$OUT/e2e-qwen3-spin$TAG.json" ;;
    qwen35)
        python3 -m bench.e2e_synthetic --synthetic qwen3.5-35b-a3b --ducks 4 --duck-threads 4 --backends fleet,gpu \
            --steps "$STEPS" $GRAPHS $E2E_ARGS --json >"$OUT/e2e-qwen35$TAG.json" 2>"$OUT/e2e-qwen35$TAG.log"
        tail -4 "$OUT/e2e-qwen35$TAG.log"; python3 scripts/e2e_table.py "$OUT/e2e-qwen35$TAG.json" ;;
    transport)   # the per-layer round trip, and a prefill chunk's (CHUNK, 512x2048) on the host's 1 and N threads
        python3 -m bench.transport --ducks 4 --threads 4 --chunk "${CHUNK:-512x2048}" --skip-deepseek --iters 500 \
            --json >"$OUT/transport$TAG.json" 2>"$OUT/transport$TAG.log"
        python3 -c "import json, sys; from bench.transport import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
            "$OUT/transport$TAG.json" ;;
    kernels)
        c_test
        python3 -m bench.kernels --threads "${KTHREADS:-1,4,16}" ${KARGS:-} --json >"$OUT/kernels.json" 2>"$OUT/kernels.log"
        python3 -c "import json, sys; from bench.kernels import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
            "$OUT/kernels.json" ;;
    gemmparts)
        c_test
        python3 -m bench.kernels --threads "${KTHREADS:-4,16}" --rounds 3 --seconds 0.2 --kernels amx --gemm-only \
            --gemm-models "${GMODELS:-deepseek-v3,qwen3-30b-a3b}" --gemm-tokens "${GTOKENS:-8,16,32,128}" --amx-parts --json \
            >"$OUT/kernels-gemmparts$TAG.json" 2>"$OUT/kernels-gemmparts$TAG.log"
        python3 -c "import json, sys; from bench.kernels import format_table; print(format_table(json.load(open(sys.argv[1]))))" \
            "$OUT/kernels-gemmparts$TAG.json" ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
echo "=== done $(date +%T)"
