#!/usr/bin/env bash
# On the lent GPU host, in one call: the request loop against the one-request path
# (bench.loop_compare: one request, the same alone in the batch loop, many users, a chat's two
# turns with the prefix cache on and off), shape by shape, into $OUT/<date>-loop-<shape>-<machine>.json.
#   SHAPES="qwen3 deepseek" MACHINE=h100 [BUDGETS="0 auto"] [SKIP_DUCK_BUILD=1] [TESTS="tests/gpu/x.py ..."] \
#       [STEPS=1,41,512,4096] bash scripts/device_loop.sh
# STEPS: bench.gpu_placement --tokens first (the placed experts' share of steps that size, each way);
# TESTS run next (pytest); LOOP_ARGS go to bench.loop_compare; BUDGETS: its --budget values (the GPU's
# share of the experts, duckd's model.gpu_ffn_budget; one file each, "-budget-<b>" in its name past 0).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; MACHINE=${MACHINE:-h100}; SHAPES=${SHAPES-qwen3 deepseek}
t0=$(date +%s); say() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
if [ "${SKIP_DUCK_BUILD:-0}" != 1 ]; then
    bash scripts/device_build.sh >"$OUT/build.log" 2>&1 && python3 firmware/build.py >>"$OUT/build.log" 2>&1 \
        || { tail -30 "$OUT/build.log"; exit 1; }
    say "built"
fi
export PYTHONPATH=/tmp/site:$PWD
if [ -n "${STEPS:-}" ]; then   # the placed experts' share of steps of STEPS tokens, each way (bench.gpu_placement)
    python3 -m bench.gpu_placement --tokens "$STEPS" >"$OUT/$(date +%F)-placement-steps-$MACHINE.json" 2>"$OUT/steps.log" \
        || tail -20 "$OUT/steps.log"
    say "steps done"
fi
if [ -n "${TESTS:-}" ]; then
    python3 -m pytest -q -x -p no:cacheprovider $TESTS 2>&1 | tail -15
    say "tests done"
fi
for shape in $SHAPES; do
    case $shape in
    qwen3) synth="--synthetic qwen3-30b-a3b" ;;
    deepseek) synth="--synthetic deepseek-v3 --layers 4 --dense-layers 1" ;;
    *) echo "SHAPES: qwen3 or deepseek, not $shape"; exit 2 ;;
    esac
    for budget in ${BUDGETS:-0}; do
        tag=$shape; [ "$budget" = 0 ] || tag="$shape-budget-$budget"
        name="$(date +%F)-loop-$tag-$MACHINE.json"
        python3 -m bench.loop_compare $synth --pin-ducks --budget "$budget" ${LOOP_ARGS:-} --json "$OUT/$name" \
            2>"$OUT/loop-$tag.log"
        rc=$?; grep -E "loop_compare|Error|error" "$OUT/loop-$tag.log" | tail -12
        [ $rc -eq 0 ] || tail -30 "$OUT/loop-$tag.log"
        say "$tag: done"
    done
done
