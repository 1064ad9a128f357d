# Two entry points: `make demo` (the embedded default job) and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV ?= .venv
# CPU wheel by default (this is what CI and a laptop need). On a CUDA machine: make TORCH_SPEC="torch==2.11.*" ...
TORCH_SPEC ?= torch==2.13.0
DEEPSPEED_SPEC ?= deepspeed==0.19.8
BIN := $(VENV)/bin

.PHONY: setup test lint demo clean-demo gpu-wheels gpu-check kernel-report

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	# DeepSpeed builds against the torch already installed (no isolated build env that would pull another torch).
	$(BIN)/python -m pip install -q --no-build-isolation "$(DEEPSPEED_SPEC)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

test: setup $(VENV)/.lm-eval
	$(BIN)/python -m pytest -q --timeout=900

# lm-evaluation-harness with RULER's dependencies (about a minute to install): the suite's lm-eval and RULER tests
# run it (they skip without it); `make demo` does not need it.
$(VENV)/.lm-eval: $(VENV)/.installed
	$(BIN)/python -m pip install -q -e ".[lm-eval]"
	touch $@

lint: setup
	$(BIN)/ruff check tapetrain tools tests

demo: setup
	$(BIN)/python tools/demo.py

clean-demo:
	rm -rf demo-work demo-report

# A bare GPU machine (torch + triton, no internet): `make gpu-wheels` here, copy the repo with gpu-wheels/ there,
# then `make gpu-check` (= tools/gpu_check.sh gpu-check-out). GPU_PYTHON: the Python version of that machine.
GPU_PYTHON ?= 3.12
GPU_WHEELS_DIR ?= gpu-wheels
GPU_WHEEL_SPECS ?= hjson==3.1.0 pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 zstandard==0.25.0 liger-kernel==0.8.5 xxhash==4.1.0
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheels: setup
	rm -rf $(GPU_WHEELS_DIR).tmp && mkdir -p $(GPU_WHEELS_DIR).tmp
	# DeepSpeed is pure Python; building its wheel here needs torch present, hence no build isolation.
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation "$(DEEPSPEED_SPEC)" -w $(GPU_WHEELS_DIR).tmp
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS_DIR).tmp $(GPU_WHEEL_SPECS)
	rm -rf $(GPU_WHEELS_DIR) && mv $(GPU_WHEELS_DIR).tmp $(GPU_WHEELS_DIR)
	ls $(GPU_WHEELS_DIR)

# Stages by priority within GPU_BUDGET seconds (tests first); the .tgz carries every file back in one.
GPU_BUDGET ?= 540
gpu-check:
	tools/gpu_check.sh gpu-check-out --budget $(GPU_BUDGET) --tar gpu-check-out.tgz

# Registers / spills / shared memory of every Triton kernel for sm_80 and sm_90a (no GPU needed).
kernel-report: setup
	$(BIN)/python tools/kernel_report.py --out docs/benchmarks/kernel-report.json
