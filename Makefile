# Two entry points: `make demo` (the embedded default job) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default (this is what CI and a laptop need). On a CUDA machine: make TORCH_SPEC="torch==2.11.*" ...
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
BIN := $(VENV)/bin

.PHONY: setup test lint demo clean-demo

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	# DeepSpeed builds against the torch already installed (no isolated build env that would pull another torch).
	$(BIN)/python -m pip install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

test: setup
	$(BIN)/python -m pytest -q --timeout=900

lint: setup
	$(BIN)/ruff check tapetrain tools tests

demo: setup
	$(BIN)/python tools/demo.py

clean-demo:
	rm -rf demo-work demo-report
