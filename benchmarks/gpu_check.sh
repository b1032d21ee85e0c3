#!/usr/bin/env bash
# The checks that need an NVIDIA GPU (FP8: compute capability 8.9+), as one script for a machine that has one:
#   bash benchmarks/gpu_check.sh            (after `make setup`; about 5 minutes on an H200)
# 1. the CUDA-only tests (format rounding on the GPU, real FP8 matmuls in bf16 against the simulation);
# 2. ptq compare on the default model, simulated and with real FP8 matmuls, side by side;
# 3. make bench on the GPU (bf16 compute), with a shorter compare.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
OUT=${OUT:-/tmp/ptq-gpu-check}
mkdir -p "$OUT"
"$BIN/python" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
PTQ_COMPILE=1 "$BIN/python" -m pytest -q -rs tests/test_formats.py tests/test_quantize.py -k cuda
for matmul in simulated fp8; do
  "$BIN/ptq" compare --recipes fp8-e4m3,fp8-e4m3-dynamic --calib-samples 8 --max-windows 8 --matmul "$matmul" \
      --out "$OUT/compare-$matmul" --force --quiet --no-plots
done
"$BIN/python" - "$OUT" <<'PY'
import json, sys
runs = {m: json.load(open(f"{sys.argv[1]}/compare-{m}/results.json")) for m in ("simulated", "fp8")}
for a, b in zip(runs["simulated"]["variants"], runs["fp8"]["variants"]):
    print(f"{a['name']:18s} perplexity simulated {a['perplexity']:.4f}  real FP8 {b['perplexity']:.4f}  "
          f"({100 * (b['perplexity'] / a['perplexity'] - 1):+.3f}%)")
print(runs["fp8"]["device"])
PY
"$BIN/python" -m ptq.bench --repeats 3 --compare-windows 8
