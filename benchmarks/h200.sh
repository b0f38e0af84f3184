#!/usr/bin/env bash
# One run on the lent H200: build Lily with the CUDA backend, run the CUDA op and model tests, time the ops, then
# the whole-model benchmark. Usage (device tool): bash benchmarks/h200.sh [tests|ops|model|sanitize]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lily-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests ops model}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q . > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
for step in $steps; do
  case $step in
    tests) timeout 300 python3 -m pytest tests/ops tests/test_cuda.py -q -rs --durations=5 -s -p no:cacheprovider \
             > "$OUT/tests.log" 2>&1; grep -E "passed|failed|^FAILED|^ERROR|relative error|perplexity|agreement" "$OUT/tests.log" | tail -40 ;;
    ops) timeout 240 python3 benchmarks/bench_ops.py --backend cuda --json "$OUT/ops.json" 2>&1 | tee "$OUT/ops.log" ;;
    model) timeout 400 python3 benchmarks/bench_model.py --backend cuda --out "$OUT/bench_model.json" ${BENCH_ARGS:-} \
             2>&1 | tee "$OUT/model.log" ;;
    sanitize) for tool in memcheck racecheck; do
        LILY_OP_TAGS=edge timeout 250 compute-sanitizer --tool $tool --error-exitcode 1 \
          python3 -m pytest tests/ops -q -x -p no:cacheprovider 2>&1 \
          | tail -15 | tee "$OUT/sanitize-$tool.log"; done ;;
  esac
done
