#!/usr/bin/env bash
# One run on the lent H200: install Lily (a wheel carried in .whl/ when there is one, else a build), then the steps
# asked for: tests (CUDA op + model tests; TESTS=paths for others), bench (the default path, 4K..128K), ablate (each
# switch off alone), agent (agent turns through the server against the engine: benchmarks/bench_agent.py; needs
# starlette, uvicorn and openai, carried as wheels), serve (a new conversation's TTFT through the server against the
# library at 4K and 32K: benchmarks/bench_serve.py, the same wheels), profile (per-kernel times of a prefill chunk
# and a decode step under ncu), stalls (ncu's warp-state and memory sections for the Hopper GEMMs), dstalls (the same
# for the decode step's GEMV and MoE kernels), trace (each kernel's share of the replayed decode step's critical path:
# benchmarks/probes/step_trace.py, on a build made with TRACE=1), persist (benchmarks/probes/persist_probe.cu: one
# persistent kernel, and a tensor-core GEMV, against the graph of PDL kernels on chains of GEMVs), sanitize (memcheck +
# racecheck). PROFILE_ARGS go to profile_step.py in profile and stalls (e.g. --prefix 28672: the 4096-token chunk
# that sees 28K earlier tokens).
# Usage (device tool): bash benchmarks/h200.sh [tests|bench|ablate|agent|serve|profile|stalls|dstalls|trace|persist|sanitize]...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/lily-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-tests bench}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
t0=$(date +%s)
if ls .whl/lily-*-cp312-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; exit 1; }
  export PYTHONPATH=/tmp/site
else
  python3 -m pip install --no-build-isolation --no-deps -q ${TRACE:+-C cmake.define.LILY_STEP_TRACE=ON} . \
    > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
  if ls .whl/*.whl >/dev/null 2>&1; then  # the server's dependencies (agent, serve), carried as wheels
    python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl >> "$OUT/build.log" 2>&1 \
      || { tail -30 "$OUT/build.log"; exit 1; }
    export PYTHONPATH=/tmp/site
  fi
fi
python3 -c "import lily; print('lily', lily.__file__); print(*lily.backends(), sep='\n')" || exit 1
echo "install: $(( $(date +%s) - t0 )) s"
for step in $steps; do
  t=$(date +%s)
  case $step in
    tests) timeout ${TESTS_TIMEOUT:-420} python3 -m pytest ${TESTS:-tests/ops tests/test_cuda.py} -q -rs -x --durations=8 -s \
             -p no:cacheprovider > "$OUT/tests.log" 2>&1
           grep -E "passed|failed|^FAILED|^ERROR|Error|error|perplexity|agreement|assert" "$OUT/tests.log" | tail -30 ;;
    bench) timeout 400 python3 benchmarks/bench_model.py --backend cuda --lengths ${BENCH_LENGTHS:-4096,32768,131072} \
             ${BENCH_GREEDY:+--greedy} --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" ;;
    ablate) timeout 500 python3 benchmarks/bench_model.py --backend cuda --ablate \
              --lengths ${ABLATE_LENGTHS:-4096,32768,131072} --out "$OUT/ablation.json" 2>&1 | tee "$OUT/ablate.log" ;;
    agent) timeout 300 python3 benchmarks/bench_agent.py --model random --backend cuda --out "$OUT/agent.json" 2>&1 \
             | tee "$OUT/agent.log" ;;
    serve) timeout 300 python3 benchmarks/bench_serve.py --model random --backend cuda --out "$OUT/serve.json" 2>&1 \
             | tee "$OUT/serve.log" ;;
    profile) NCU="ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum"
             for what in decode prefill; do
               timeout 200 $NCU python3 benchmarks/profile_step.py --what $what ${PROFILE_ARGS:-} > "$OUT/$what.csv" \
                 2> "$OUT/$what.err"
               python3 benchmarks/profile_step.py --summarize "$OUT/$what.csv" --top 24
             done ;;
    stalls) # why a prefill GEMM waits: warp states, scheduler issue and memory sections of the first calls of
            # the kernels named by STALL_KERNELS (a regex) in one 4096-token chunk
            timeout 300 ncu --profile-from-start off --clock-control none \
              --kernel-name "regex:${STALL_KERNELS:-qmm_sm90|moe_sm90}" --launch-count ${STALL_COUNT:-4} \
              --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
              --section ComputeWorkloadAnalysis python3 benchmarks/profile_step.py --what prefill ${PROFILE_ARGS:-} \
              > "$OUT/stalls.txt" 2> "$OUT/stalls.err"
            grep -E "Stall|Issue|Eligible|Throughput|Hit Rate|Bandwidth|qmm_sm90|moe_sm90" "$OUT/stalls.txt" | head -80 ;;
    dstalls) # the same sections for the decode step's bandwidth kernels (DSTALL_KERNELS, a regex), replayed nodes:
             # the first layer's in_proj, out_proj, router, MoE gate+up and down are its first 5 matches
            timeout 300 ncu --profile-from-start off --clock-control none \
              --kernel-name "regex:${DSTALL_KERNELS:-qmv_stream|moe_gate_up|moe_down|qmv_kernel}" \
              --launch-count ${DSTALL_COUNT:-5} --section WarpStateStats --section SchedulerStats \
              --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section LaunchStats \
              --section Occupancy python3 benchmarks/profile_step.py --what decode \
              > "$OUT/dstalls.txt" 2> "$OUT/dstalls.err"
            grep -E "Stall|Issue|Eligible|Throughput|Bandwidth|qmv|moe_" "$OUT/dstalls.txt" | head -80 ;;
    trace) # the replayed decode step's critical path kernel by kernel: needs a LILY_STEP_TRACE build (TRACE=1)
           for L in ${TRACE_LENGTHS:-4096 32768}; do
             timeout 150 python3 benchmarks/probes/step_trace.py --context $L --out "$OUT/trace_$L.json" \
               | tee "$OUT/trace_$L.txt" | head -20
           done ;;
    persist) # what a persistent decode kernel would buy over the graph of PDL kernels (benchmarks/probes/
             # persist_probe.cu: chains of real-size 4-bit GEMVs, each variant checked, then timed; its `tc`
             # variant is the tensor-core GEMV with K split over warps)
             nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/persist benchmarks/probes/persist_probe.cu \
               && timeout 200 /tmp/persist 2>&1 | tee "$OUT/persist.txt" ;;
    sanitize) for tool in memcheck racecheck; do
        LILY_OP_TAGS=edge timeout 250 compute-sanitizer --tool $tool --error-exitcode 1 \
          python3 -m pytest tests/ops -q -x -p no:cacheprovider 2>&1 | tail -6 | tee "$OUT/sanitize-$tool.log"; done ;;
  esac
  echo "== $step: $(( $(date +%s) - t )) s"
done
