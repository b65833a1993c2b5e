# specpair: every target installs what it needs into .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install test test-fast lint proto run clean

# Each step says what it does; pip shows its own progress (a first install takes minutes).
$(STAMP): pyproject.toml
	@echo "==> [1/4] creating $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)
	@echo "==> [2/4] upgrading pip"
	$(BIN)/pip install -q --upgrade pip
	@echo "==> [3/4] torch $(TORCH_VERSION) (the largest download)"
	# Pinned torch first: on a CPU machine this is the CPU build; `[dev]` then keeps it.
	$(BIN)/pip install --progress-bar on "torch==$(TORCH_VERSION)"
	@echo "==> [4/4] specpair and its dependencies (editable, with [dev])"
	$(BIN)/pip install --progress-bar on -e ".[dev]"
	touch $(STAMP)
	@echo "==> $(VENV) is ready"

install: $(STAMP)

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
	$(BIN)/python -m specpair.proto_gen

run: $(STAMP)
	$(BIN)/specpair up --demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
