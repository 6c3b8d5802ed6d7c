#!/usr/bin/env bash
# On the lent GPU host, in one call: bench.long_context (decode at 1k / 32k / 128k context, a 32k prompt's prefill) into
# $OUT/<date>-deepseek-long-<machine>.json, then DeepSeek-V3.2's sparse attention on CUDA (tests/gpu), then
# the indexer kernel's own timings (bench.gpu_dsa).
#   [MACHINE=h100] [SKIP_DUCK_BUILD=1] [TESTS="tests/gpu/x.py ..."] [LONG_ARGS=...] bash scripts/device_long.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
MACHINE=${MACHINE:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o "H[0-9][0-9]*" | head -1 | tr H h)}
t0=$(date +%s); say() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
if [ "${SKIP_DUCK_BUILD:-0}" != 1 ]; then
    bash scripts/device_build.sh >"$OUT/build.log" 2>&1 && python3 firmware/build.py >>"$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 1; }
    say "built"
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
timeout "${LONG_S:-300}" python3 -m bench long_context --pin-ducks ${LONG_ARGS:-} \
    --out "$OUT/$(date +%F)-deepseek-long-$MACHINE.json" 2>"$OUT/long.log" | tail -30
tail -15 "$OUT/long.log"
say "long_context done"
TESTS=${TESTS-tests/gpu/test_dsa_index_cuda.py tests/gpu/test_dsa_cuda.py}
if [ -n "$TESTS" ]; then
    timeout "${TESTS_S:-200}" python3 -m pytest -q -p no:cacheprovider $TESTS >"$OUT/tests.log" 2>&1
    tail -25 "$OUT/tests.log"
    say "tests done"
fi
if [ "${DSA_S:-60}" != 0 ]; then
    timeout "${DSA_S:-60}" python3 -m bench.gpu_dsa --json "$OUT/gpu_dsa.json" >"$OUT/gpu_dsa.log" 2>&1
    tail -20 "$OUT/gpu_dsa.log"
    say "gpu_dsa done"
fi
