#!/usr/bin/env bash
# The served-path benchmark of docs/benchmarks.md (issue 11's figures), one app per scenario:
#   1. 64 concurrent streams, 128 -> 64 tokens, base model, 3 bursts from the moment the
#      app reports ready, against the engine offline (same options, separate process);
#   2. one stream at a time over a 768-token shared prefix + 32 tokens -> 32 (ITL);
#   3. the 64-stream workload spread over 8 random rank-8 adapters vs the base model,
#      alternating (base, adapters, base, adapters).
# Usage: bash scripts/bench_serve.sh [OUTPUT_DIR]   (default: bench-serve-results)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-bench-serve-results}
CONFIG=scripts/bench_serve_config.yaml
BENCH=(.venv/bin/loraplex bench serve --serve-config "$CONFIG")
export RAY_USAGE_STATS_ENABLED=0
mkdir -p "$OUT"
{
    echo "== 1. 64 concurrent streams, base model, first burst after ready + 2 more"
    "${BENCH[@]}" --bursts 3 --offline-baseline --cpu-breakdown auto --output-dir "$OUT/concurrent"
    echo "== 2. single stream, 768-token shared prefix + 32 -> 32"
    "${BENCH[@]}" --max-concurrency 1 --num-prompts 8 --prefix-len 768 --prompt-len 32 \
        --output-len 32 --offline-baseline --cpu-breakdown auto --output-dir "$OUT/single"
    echo "== 3. 64 concurrent streams over 8 adapters vs the base model"
    "${BENCH[@]}" --synthetic-adapters 8 --compare-base --bursts 2 --output-dir "$OUT/adapters"
} 2>&1 | grep -v "it/s\]" | tee "$OUT/summary.txt"
