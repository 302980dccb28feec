#!/usr/bin/env bash
# The GPU tier, for a GPU machine with PyTorch (run from the repository root). Logs and bench JSON
# go under ${OUT:-gpu-logs}; with OUT set they end as one archive, logs.tgz. A short summary last.
#   bash tests/run_gpu_tier.sh            everything (longer than one 10-minute device call: use the modes)
#   bash tests/run_gpu_tier.sh tier       the catalog against the reference (MOEGEN_TIER_SPECS=a,b: a part)
#   bash tests/run_gpu_tier.sh verify     features, prefill kernels, EP across GPUs, then the quantized specs (a budget)
#   bash tests/run_gpu_tier.sh tierq      the tier as a queue over every GPU here, largest specs first (MOEGEN_TIER_BUDGET s)
#   bash tests/run_gpu_tier.sh tier1      half of it (every other spec); tier2 the rest; tier1of3 .. tier3of3 thirds
#   bash tests/run_gpu_tier.sh checks     the feature (rules, FP4 and FP8 modes), expert-parallel and oracle tests
#   bash tests/run_gpu_tier.sh sanitize   compute-sanitizer memcheck and racecheck of BF16 and quantized layers
#   bash tests/run_gpu_tier.sh bench      moegen bench of the README's models, LongCat and GPT-OSS-120B
#   bash tests/run_gpu_tier.sh benchq     the quantized layers, each against its BF16 layer in the same run (--vs)
#   bash tests/run_gpu_tier.sh profile    ncu per-kernel durations and stall reasons at N = 1 (Qwen3-30B-A3B: BF16, MXFP4, FP8)
#   bash tests/run_gpu_tier.sh ep         on a machine of 2+ GPUs: the multi-GPU expert-parallel test and bench
#   bash tests/run_gpu_tier.sh prefill    the prefill kernels (wgmma grouped GEMMs) against NumPy, the shared-expert
#                                          prefill tuning against the reference, and the prefill buckets' speed
#   bash tests/run_gpu_tier.sh tune       moegen tune of Qwen3-30B-A3B (warps, down tiles, prefetch, router split)
#   bash tests/run_gpu_tier.sh single     the one-token kernel's tunings against the reference, then timed at N = 1
# Each of the other modes is meant to fit one 10-minute device call (the tier in thirds: tier1of3 ..).
set -uo pipefail
out="${OUT:-gpu-logs}"
mode="${1:-all}"
mkdir -p "$out"
export MOEGEN_CACHE="${MOEGEN_CACHE:-/tmp/moegen-cache}" PYTHONUNBUFFERED=1
summary=()
run() {  # name, command...
  local name=$1; shift
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$name: rc=$rc $(grep -E 'passed|failed|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" | tail -1)")
}
pytest_gpu() { python3 -m pytest -v -rfE --tb=short -W ignore::DeprecationWarning -m gpu "$@"; }
bench() { python3 -W ignore -m moegen bench "$@"; }
if [ "$mode" = profile ]; then
  ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
      --section MemoryWorkloadAnalysis -k regex:"moe_(router|route|gate|down)" \
      python3 -W ignore tests/gpu_sanitize.py qwen3-30b-a3b:1 qwen3-30b-a3b-mxfp4:1 qwen3-30b-a3b-fp8:1 >"$out/ncu.txt" 2>&1
  grep -E "^  moe_|Duration|DRAM Throughput|Achieved Occupancy|Waves Per SM" "$out/ncu.txt"
  exit 0
fi
tierq_run() {  # budget in seconds, comma list of specs (empty: the catalog)
  # the specs as a queue, largest layers first, one worker per GPU; each spec its own pytest on
  # its GPU; nothing new starts within 60 s of the end of the budget
  end=$(( $(date +%s) + $1 ))
  q="$out/queue.txt"
  : >>"$out/tierq.txt"
  QSPECS="$2" python3 - "$q" <<'PY'
import os, sys
from pathlib import Path
from moegen.bench import weight_bytes
from moegen.plan import make_plan
from moegen.spec import load_spec
keep = set(filter(None, os.environ.get("QSPECS", "").split(",")))
specs = [p for p in sorted(Path("specs").glob("*.yaml")) if not keep or p.stem in keep]
specs.sort(key=lambda p: -weight_bytes(make_plan(load_spec(p))))
Path(sys.argv[1]).write_text("".join(p.stem + "\n" for p in specs))
PY
  worker() {  # GPU index
    while :; do
      left=$((end - $(date +%s))); [ "$left" -lt 60 ] && break
      s=$(flock "$q.lock" sh -c "head -1 '$q'; sed -i 1d '$q'")
      [ -z "$s" ] && break
      CUDA_VISIBLE_DEVICES=$1 MOEGEN_TIER_SPECS=$s timeout "$left" python3 -m pytest -v -rfE --tb=short \
        -W ignore::DeprecationWarning -p no:cacheprovider -m gpu tests/test_gpu.py >"$out/tier-$s.log" 2>&1
      echo "gpu$1 $s rc=$? $(tail -1 "$out/tier-$s.log")" >>"$out/tierq.txt"
    done
  }
  ngpu=$(nvidia-smi -L | wc -l)
  for g in $(seq 0 $((ngpu - 1))); do worker "$g" & done
  wait
  cat "$out/tierq.txt"; echo "not run: $(tr '\n' ' ' <"$q")"
  summary+=("tierq: $(grep -c 'rc=0' "$out/tierq.txt") specs passed, $(grep -vc 'rc=0' "$out/tierq.txt") failed or stopped")
}
if [ "$mode" = verify ]; then
  # what changed since the last GPU run, each step within what is left of MOEGEN_TIER_BUDGET
  # seconds: the feature rules (FP8 planted codes among them), the prefill kernels, expert
  # parallelism across the GPUs here, then the quantized catalog specs as a queue over the GPUs
  vend=$(( $(date +%s) + ${MOEGEN_TIER_BUDGET:-540} ))
  bounded() {  # name, seconds at most, command...
    local name=$1 lim=$2; shift 2
    local left=$((vend - $(date +%s) - 30)); [ "$lim" -gt "$left" ] && lim=$left
    [ "$lim" -lt 20 ] && { summary+=("$name: not run (no time left)"); return; }
    run "$name" timeout "$lim" "$@"
  }
  bounded gpu-features 150 python3 -m pytest -v -rfE --tb=short -W ignore::DeprecationWarning -m gpu tests/test_gpu_features.py
  bounded gpu-prefill 120 python3 -m pytest -v -rfE --tb=short -W ignore::DeprecationWarning -m gpu tests/test_gpu_prefill.py
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    bounded gpu-ep 240 python3 -m pytest -v -s -rfE --tb=short -W ignore::DeprecationWarning -m gpu tests/test_gpu_ep.py -k several
  fi
  left=$((vend - $(date +%s) - 20))
  if [ "$left" -gt 90 ]; then
    tierq_run "$left" "$(ls specs | sed -n 's/\.yaml$//p' | grep -E 'fp8|fp4' | paste -sd,)"
  fi
fi
if [ "$mode" = prefill ]; then  # the prefill kernels against NumPy, the shared-expert tuning, then the layers' speed
  run gpu-prefill pytest_gpu tests/test_gpu_prefill.py
  run gpu-prefill-shared pytest_gpu tests/test_gpu_features.py -k prefill_with_a_shared_expert
  run "bench-prefill-qwen3-30b-a3b" bench specs/qwen3-30b-a3b.yaml --tokens 512,2048,8192,16384 --stages --compare
  run "bench-prefill-mixtral-8x7b" bench specs/mixtral-8x7b.yaml --tokens 128,512,2048,8192 --stages --compare
  for f in "$out"/bench-prefill-*.log; do echo "== $f"; grep -E "^ +[0-9]+ " "$f"; done
fi
if [ "$mode" = single ]; then  # grid barriers / down_tiles 1 / plain launch / overlapped route / FP8: correct, then which is fastest
  run gpu-single pytest_gpu tests/test_gpu_features.py -k one_token_kernel_tunings
  for s in qwen3-30b-a3b qwen3-next-80b-a3b; do
    run "tune-single-$s" python3 -W ignore -m moegen tune "specs/$s.yaml" --only single,single_coop,single_tags,single_overlap,down_tiles --tokens 1
    cat "$out/tune-single-$s.log"
  done
  run tune-single-fp8 python3 -W ignore -m moegen tune specs/qwen3-30b-a3b-fp8.yaml --only single_fp8 --tokens 1
  cat "$out/tune-single-fp8.log"
fi
if [ "$mode" = tune ]; then
  for s in qwen3-30b-a3b; do  # 18 variants: one spec fits a 10-minute call
    run "tune-$s" python3 -W ignore -m moegen tune "specs/$s.yaml" --tokens 1,8,64
    cat "$out/tune-$s.log"
  done
fi
if [ "$mode" = ep ]; then
  run gpu-ep pytest_gpu tests/test_gpu_ep.py
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  run bench-ep bench specs/deepseek-v3-fp8.yaml --ep-size "$ngpu" --tokens 1,64,256 --json "$out/bench-ep.json"
  grep -E "^ +[0-9]+ " "$out/bench-ep.log"
fi
if [ "$mode" = all ] || [ "$mode" = tier ]; then
  run gpu-tier pytest_gpu tests/test_gpu.py
fi
if [ "$mode" = tier1 ] || [ "$mode" = tier2 ]; then
  MOEGEN_TIER_PART="${mode#tier}" run "gpu-$mode" pytest_gpu tests/test_gpu.py
fi
if [ "$mode" = tierq ]; then
  tierq_run "${MOEGEN_TIER_BUDGET:-540}" "${MOEGEN_TIER_SPECS:-}"
fi
case "$mode" in tier[1-9]of[1-9])  # e.g. tier1of3: every third spec from the first
  part="${mode#tier}"; MOEGEN_TIER_PART="${part%of*}/${part#*of}" run "gpu-$mode" pytest_gpu tests/test_gpu.py ;;
esac
if [ "$mode" = all ] || [ "$mode" = checks ]; then
  run gpu-features pytest_gpu tests/test_gpu_features.py tests/test_gpu_ep.py
  run gpu-oracle pytest_gpu tests/test_oracle.py tests/test_hf.py
fi
if [ "$mode" = all ] || [ "$mode" = sanitize ]; then
  run memcheck compute-sanitizer --tool memcheck --report-api-errors no python3 -W ignore tests/gpu_sanitize.py \
      qwen3-next-80b-a3b:1,64 deepseek-v2-lite:1,64 qwen3-30b-a3b-nvfp4:1,16 qwen3-30b-a3b-fp8:1,16 \
      mixtral-8x7b:200 qwen3-30b-a3b:1,600 qwen3-30b-a3b-fp8-a8:600,3000 qwen3-30b-a3b-fp8-a8+xrows+idle:3000
  # the quantized layers share each chunk's scales across a warp's lanes through shared memory
  run racecheck compute-sanitizer --tool racecheck --report-api-errors no python3 -W ignore tests/gpu_sanitize.py \
      olmoe-1b-7b:1,16 deepseek-v2-lite:2 qwen3-30b-a3b-mxfp4:1,16 qwen3-30b-a3b-fp8:2 mixtral-8x7b:130 \
      qwen3-30b-a3b:1 qwen3-30b-a3b-fp8-a8+xrows+idle:3000
fi
if [ "$mode" = all ] || [ "$mode" = bench ]; then
  for s in qwen3-30b-a3b qwen3-next-80b-a3b mixtral-8x7b; do
    run "bench-$s" bench "specs/$s.yaml" --tokens 1,2,8,64,256 --stages --compare --json "$out/bench-$s.json"
  done
  for s in longcat-flash gpt-oss-120b; do
    run "bench-$s" bench "specs/$s.yaml" --tokens 1,8,64 --stages --json "$out/bench-$s.json"
  done
fi
if [ "$mode" = all ] || [ "$mode" = benchq ]; then
  # the quantized layers against their BF16 layer in the same run (time ratio per N)
  for s in qwen3-30b-a3b-fp8 qwen3-30b-a3b-mxfp4 qwen3-30b-a3b-nvfp4; do
    run "bench-$s" bench "specs/$s.yaml" --tokens 1,8,64 --stages --vs specs/qwen3-30b-a3b.yaml --json "$out/bench-$s.json"
  done
  for s in deepseek-v3-fp8 deepseek-v3-nvfp4; do
    run "bench-$s" bench "specs/$s.yaml" --tokens 1,64 --vs specs/deepseek-v3.yaml --json "$out/bench-$s.json"
  done
  run bench-gpt-oss-120b-mxfp4 bench specs/gpt-oss-120b-mxfp4.yaml --tokens 1,64 --vs specs/gpt-oss-120b.yaml \
      --json "$out/bench-gpt-oss-120b-mxfp4.json"
  for s in qwen3-30b-a3b-fp8-a8 qwen3-30b-a3b-fp8-tensor; do  # the other FP8 modes
    run "bench-$s" bench "specs/$s.yaml" --tokens 1,8,64 --stages --vs specs/qwen3-30b-a3b.yaml --json "$out/bench-$s.json"
  done
fi
if [ "$mode" = all ] || [ "$mode" = bench ] || [ "$mode" = benchq ]; then
  for f in "$out"/bench-*.log; do echo "== $f"; grep -E "^ +[0-9]+ |^time " "$f"; done
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
# one archive of every log and JSON, for machines that return only a few files
if [ -n "${OUT:-}" ]; then (cd "$out" && tar czf logs.tgz --remove-files ./*.log ./*.json ./*.txt 2>/dev/null); fi
