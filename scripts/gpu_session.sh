#!/usr/bin/env bash
# One lease of a GPU machine (the device tool), in one call: the engine's GPU tests, with
# SHAPES=1 the LoRA kernels' shapes (scripts/bench_gpu_lora_shapes.py), then
# scripts/bench_gpu_engine.py on the code before a change and after it, then their ratios.
#
#   .baseline/  an export of the code before (git archive REV _loraplex platform kernels
#               adapters deployments tools | tar -x -C .baseline; echo /.baseline/ >>
#               .git/info/exclude), carried with the call (carry: [".baseline"])
#   $OUT        where the logs and JSON figures go (the device tool brings them back)
#
# TESTS, TEST_TIMEOUT, BENCH_ARGS ("--rounds 5"), BENCH_TIMEOUT and SIDES ("after before
# after") size the call to the lease: on an H200 (2026-11-28) the machine started in about
# 35 s, the engine tests took 40-130 s and each bench 30-60 s (the first one also writes the
# random 1B checkpoint).
#
# Each side imports loraplex through a shim folder on PYTHONPATH (loraplex -> its
# _loraplex/), so nothing is installed on the machine. Runs the machine's own python3.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT" /tmp/shim-before /tmp/shim-after
ln -sfn "$PWD/_loraplex" /tmp/shim-after/loraplex
ln -sfn "$PWD/.baseline/_loraplex" /tmp/shim-before/loraplex
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
python3 -c 'import torch, triton, transformers, peft; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'

echo "== tests on CUDA"
PYTHONPATH=/tmp/shim-after timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -p no:cacheprovider \
    -n 0 -q -x ${TESTS:-tests/platform/test_decode_graphs.py tests/platform/test_triton_path.py tests/platform/test_sleep_mode.py} \
    >"$OUT/tests.log" 2>&1
echo "tests exit $?"; tail -n 25 "$OUT/tests.log"

if [ -n "${SHAPES:-}" ]; then  # the LoRA kernels and their fused forms, each in a CUDA graph
    echo "== LoRA kernel shapes"
    PYTHONPATH=/tmp/shim-after timeout "${SHAPES_TIMEOUT:-120}" python3 scripts/bench_gpu_lora_shapes.py \
        >"$OUT/shapes.log" 2>&1
    echo "shapes exit $?"; grep "layer " "$OUT/shapes.log" | tail -n 40
fi

# SIDES may name a side more than once (alternating runs: "before after before after");
# run i of a side writes $OUT/<side>.json, then <side>-2.json, ... PROFILE=1 adds a
# cProfile report to the last "after" run (it slows the host: its figures are not
# comparable with an unprofiled run's).
declare -A runs=()
for side in ${SIDES:-before after}; do
    runs[$side]=$(( ${runs[$side]:-0} + 1 ))
    name=$side; [ "${runs[$side]}" -gt 1 ] && name=$side-${runs[$side]}
    echo "== bench: $name"
    extra=()
    [ "$side" = after ] && [ -n "${PROFILE:-}" ] && extra=(--profile "$OUT/profile.txt")
    PYTHONPATH=/tmp/shim-$side timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench_gpu_engine.py \
        --output "$OUT/$name.json" "${extra[@]}" ${BENCH_ARGS:-} >"$OUT/$name.log" 2>&1
    echo "bench $name exit $?"; grep -v "adapters\.\(store\|slots\|peft_format\)" "$OUT/$name.log" | tail -n 4
done
for run in "" -2 -3; do
    [ -f "$OUT/before$run.json" ] && [ -f "$OUT/after$run.json" ] &&
        PYTHONPATH=/tmp/shim-after python3 scripts/bench_gpu_engine.py --compare "$OUT/before$run.json" "$OUT/after$run.json" 2>&1 | tail -n 12
done
