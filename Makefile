# specpair: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install torch test test-fast lint proto run clean

# Each step says what it does; pip shows its own progress (a first install takes minutes).
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@$(MAKE) --no-print-directory torch
	@echo "==> [4/4] specpair and its dependencies (editable, with [dev])"
	$(BIN)/pip install --progress-bar on -e ".[dev]"
	touch $(STAMP)
	@echo "==> $(VENV) is ready"

install: $(STAMP)

# Pinned torch first, the largest download; `[dev]` then keeps it. PyPI's torch wheel for Linux
# is the CUDA build (2.7 GB with its nvidia-* wheels), so where no NVIDIA GPU answers
# `nvidia-smi -L` torch comes from PyTorch's CPU index (about 200 MB; `2.13.0+cpu` satisfies
# `==2.13.0`), asked first whether it answers within 5 s; if it does not (offline, or only PyPI
# or a mirror is reachable), plain `pip install`, which takes what pip's own configuration
# offers (a local CPU wheel where one is configured, else PyPI's). `TORCH_CPU_INDEX=` skips it.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PROBE_TIMEOUT := $(shell command -v timeout >/dev/null 2>&1 && echo timeout 10)

torch:
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		echo "==> [3/4] torch $(TORCH_VERSION): an NVIDIA GPU is here, the CUDA build (about 2.7 GB)"; \
		$(BIN)/pip install --progress-bar on "torch==$(TORCH_VERSION)"; \
	elif [ -n "$(TORCH_CPU_INDEX)" ] && $(PROBE_TIMEOUT) $(BIN)/python -c "import sys, urllib.request; \
			urllib.request.urlopen(sys.argv[1], timeout=5)" "$(TORCH_CPU_INDEX)/torch/" >/dev/null 2>&1; then \
		echo "==> [3/4] torch $(TORCH_VERSION): no NVIDIA GPU, the CPU build from $(TORCH_CPU_INDEX) (about 200 MB)"; \
		$(BIN)/pip install --progress-bar on --extra-index-url "$(TORCH_CPU_INDEX)" "torch==$(TORCH_VERSION)"; \
	else \
		echo "==> [3/4] torch $(TORCH_VERSION): no NVIDIA GPU and no CPU index answered" \
			"($(TORCH_CPU_INDEX)): as pip's configuration resolves it (PyPI alone: the CUDA build, about 2.7 GB)"; \
		$(BIN)/pip install --progress-bar on "torch==$(TORCH_VERSION)"; \
	fi

test: $(STAMP)
	$(BIN)/pytest -q -ra

test-fast: $(STAMP)
	$(BIN)/pytest -q -ra -m "not slow"

# The wire contract in buf's STANDARD style. buf ships as an npm package: npx fetches it once
# (the network, then npm's cache); `make lint BUF=/path/to/buf` uses a local one.
BUF ?= npx --yes --prefer-offline @bufbuild/buf@1.50.0
BUF_TIMEOUT := $(shell command -v timeout >/dev/null 2>&1 && echo timeout 120)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy specpair draft_service target_service controller bench
	@if $(BUF_TIMEOUT) $(BUF) --version >/dev/null 2>&1; then \
		echo "cd protos && $(BUF) lint"; cd protos && $(BUF) lint; \
	else \
		echo "make lint: buf lint SKIPPED: '$(BUF)' cannot run here (offline and not in npm's" \
			"cache, or no Node.js); the other checks passed. 'make lint BUF=/path/to/buf' uses a local buf."; \
	fi

proto: $(STAMP)
	$(BIN)/python -m specpair.rpc.proto_gen

run: $(STAMP)
	$(BIN)/specpair up --demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
