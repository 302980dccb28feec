#!/usr/bin/env bash
# The GPU tier in one go, for a GPU machine with PyTorch (run from the repository root):
# tests, sanitizer and benchmarks, logs under ${OUT:-gpu-logs}. Prints a short summary last.
#   bash tests/run_gpu_tier.sh            everything (about 6-8 minutes on one H200)
#   bash tests/run_gpu_tier.sh quick      the GPU tests only
#   bash tests/run_gpu_tier.sh profile    ncu per-kernel durations and stall reasons at N = 1 (Qwen3-30B-A3B)
set -uo pipefail
out="${OUT:-gpu-logs}"
mkdir -p "$out"
export MOEGEN_CACHE="${MOEGEN_CACHE:-/tmp/moegen-cache}" PYTHONUNBUFFERED=1
summary=()
run() {  # name, command...
  local name=$1; shift
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc $(grep -E 'passed|failed|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" | tail -1)")
}
if [ "${1:-}" = profile ]; then
  ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
      --section MemoryWorkloadAnalysis -k regex:"moe_(router|route|gate|down)" \
      python3 -W ignore tests/gpu_sanitize.py qwen3-30b-a3b:1 qwen3-next-80b-a3b:1 >"$out/ncu.txt" 2>&1
  grep -E "^  moe_|Duration|DRAM Throughput|Achieved Occupancy|Waves Per SM" "$out/ncu.txt"
  exit 0
fi
run gpu-tests python3 -m pytest -q -W ignore::DeprecationWarning -m gpu tests/test_gpu.py
run gpu-features python3 -m pytest -q -W ignore::DeprecationWarning -m gpu tests/test_gpu_features.py tests/test_gpu_ep.py
run gpu-oracle python3 -m pytest -q -W ignore::DeprecationWarning -m gpu tests/test_oracle.py tests/test_hf.py
if [ "${1:-}" != quick ]; then
  run memcheck compute-sanitizer --tool memcheck --report-api-errors no python3 -W ignore tests/gpu_sanitize.py \
      qwen3-next-80b-a3b:1,64 deepseek-v2-lite:1,64
  run racecheck compute-sanitizer --tool racecheck --report-api-errors no python3 -W ignore tests/gpu_sanitize.py \
      olmoe-1b-7b:1,16 deepseek-v2-lite:2
  for s in qwen3-30b-a3b qwen3-next-80b-a3b mixtral-8x7b qwen3-30b-a3b-fp8 deepseek-v3; do
    run "bench-$s" python3 -W ignore -m moegen bench "specs/$s.yaml" --tokens 1,2,8,64,256 --stages --compare \
        --json "$out/bench-$s.json"
  done
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
# the device tool brings back few files: one archive of every log and JSON
if [ -n "${OUT:-}" ]; then (cd "$out" && tar czf logs.tgz --remove-files ./*.log ./*.json ./*.txt 2>/dev/null); fi
