# Two entry points: `make demo` (the embedded default job) and `make test`. Both create .venv on first use, from
# the hashed locks in requirements/ (docs/dependencies.md): exactly the versions CI tested. `make lock` refreshes them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
LOCKS := requirements
DEV_LOCK := $(LOCKS)/dev.lock
BUILD_LOCK := $(LOCKS)/build.lock
LM_EVAL_LOCK := $(LOCKS)/lm-eval.lock
# Empty: the lock's CPU torch (what CI and a laptop need). On a CUDA machine: make TORCH_SPEC="torch==2.11.*" ...
# installs that torch and every other package from the lock.
TORCH_SPEC ?=
DEEPSPEED_SPEC ?= $(shell $(PYTHON) tools/lockfile.py pins $(DEV_LOCK) deepspeed)
PIP := $(BIN)/python -m pip
# Two pytest-xdist workers, one per CI core (alone, the suite kept ~1.1 cores busy: launches, waits on timeouts);
# tests/conftest.py makes the units (a module, or modules sharing a session fixture) and sends the heaviest first.
PYTEST_ARGS ?= -q --timeout=900 --durations=15 -n 2 --dist loadfile
# uv (from requirements/tools.lock, in .venv-tools) installs the locks into .venv: 13-18 s against pip's 60-70 s here.
# INSTALLER=pip: the same locks, the same packages, with pip alone.
INSTALLER ?= uv
TOOLS := .venv-tools
# uv does not read pip's configuration: it gets pip's find-links (where this machine's CPU torch wheel lies).
UV_ARGS ?= $(foreach d,$(sort $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null) $(PIP_FIND_LINKS)),\
	--find-links $(d))
ifeq ($(INSTALLER),uv)
# --compile-bytecode: pip compiles .pyc at install, uv does not by default; where PYTHONDONTWRITEBYTECODE is set (as
# on CI's machines) Python then never writes them and every process recompiles torch's, DeepSpeed's and transformers'
# sources at import: ~0.8 s of CPU per process, hundreds of processes in the suite.
INSTALL = $(TOOLS)/bin/uv pip install -q --compile-bytecode --python $(BIN)/python $(UV_ARGS)
INSTALL_TOOLS = $(TOOLS)/.installed
else
INSTALL = $(PIP) install -q
INSTALL_TOOLS =
endif

.PHONY: setup test test-latest lock lint demo clean-demo gpu-wheels gpu-check kernel-report

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(DEV_LOCK) $(BUILD_LOCK) | $(INSTALL_TOOLS)
	$(PYTHON) -m venv $(VENV)
ifeq ($(strip $(TORCH_SPEC)),)
	# torch first: DeepSpeed's sdist is built against the installed torch (no isolated build env with another one).
	$(INSTALL) --require-hashes -r $(BUILD_LOCK)
	$(INSTALL) --require-hashes --no-build-isolation -r $(DEV_LOCK)
else
	$(INSTALL) "$(TORCH_SPEC)" $$($(PYTHON) tools/lockfile.py pins $(DEV_LOCK) pip setuptools)
	$(PYTHON) tools/lockfile.py without $(DEV_LOCK) torch > $(VENV)/lock-without-torch.txt
	# Hash-checked still (uv verifies the hashes given, pip switches to hash-checking mode), but torch has none.
	$(INSTALL) --no-build-isolation -r $(VENV)/lock-without-torch.txt
endif
	$(INSTALL) --no-deps --no-build-isolation -e .
	touch $@

$(TOOLS)/.installed: $(LOCKS)/tools.lock
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q --require-hashes -r $(LOCKS)/tools.lock
	touch $@

test: setup $(VENV)/.lm-eval
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# lm-evaluation-harness with RULER's dependencies (about a minute to install): the suite's lm-eval and RULER tests
# run it (they skip without it); `make demo` does not need it.
$(VENV)/.lm-eval: $(VENV)/.installed $(LM_EVAL_LOCK)
	$(INSTALL) --require-hashes --no-build-isolation -r $(LM_EVAL_LOCK)
	touch $@

# Rewrites the locks from pyproject.toml, keeping every pin that still satisfies it (a new dependency gets its newest
# version); `make lock UPGRADE=1` moves every pin to the newest version allowed. Python 3.11, this machine's indexes.
COMPILE_LOCK = CUSTOM_COMPILE_COMMAND="make lock" $(TOOLS)/bin/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
	--no-emit-find-links $(if $(UPGRADE),--upgrade) $(LOCK_ARGS)
lock: $(TOOLS)/.installed
	$(COMPILE_LOCK) --extra dev -o $(DEV_LOCK) pyproject.toml $(LOCKS)/build.in
	$(COMPILE_LOCK) -c $(DEV_LOCK) -o $(BUILD_LOCK) $(LOCKS)/build.in
	$(COMPILE_LOCK) --extra dev --extra lm-eval -c $(DEV_LOCK) -o $(LM_EVAL_LOCK) pyproject.toml $(LOCKS)/build.in
	$(COMPILE_LOCK) -c $(DEV_LOCK) -o $(LOCKS)/tools.lock $(LOCKS)/tools.in

# The suite on the newest versions pyproject.toml allows (not the lock), in its own venv: what `make lock UPGRADE=1`
# would bring. torch stays the CPU wheel (LATEST_TORCH_SPEC): any other torch here pulls gigabytes of CUDA.
LATEST_VENV ?= .venv-latest
LATEST_TORCH_SPEC ?= torch==2.13.0
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip setuptools
	$(LATEST_VENV)/bin/python -m pip install -q "$(LATEST_TORCH_SPEC)"
	$(LATEST_VENV)/bin/python -m pip install -q --no-build-isolation -e ".[dev,lm-eval]"
	$(LATEST_VENV)/bin/python -m pip freeze
	$(LATEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

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
# Versions from the lock; ==X: the version for a package the lock does not hold. xxhash: checkpoint manifests.
# torchao: train.float8 (a cp310-abi3 manylinux wheel, 3.4 MB: any CPython from 3.10 on).
GPU_WHEEL_NAMES ?= hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions zstandard \
	xxhash liger-kernel==0.8.5 torchao
# flash-attn-4 (tapetrain/kernels/flash4.py) and what its wheels' metadata requires for CUDA 13 torch: CuTe DSL with
# only its cu13 libraries (it picks the flavour the driver supports), TVM FFI, quack, the DLPack extension and
# cuda-bindings (cuda-pathfinder), protobuf, einops. Pinned: flash-attn-4 calls into its interface module.
GPU_FA4_SPECS ?= flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
	nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
	quack-kernels==0.6.5 torch-c-dlpack-ext==0.1.5 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 \
	protobuf==7.36.2 einops==0.8.2
GPU_WHEEL_SPECS ?= $(shell $(PYTHON) tools/lockfile.py pins $(DEV_LOCK) $(GPU_WHEEL_NAMES)) $(GPU_FA4_SPECS)
# One device call carries 64 MiB with the repository (~8 MiB): the set goes in parts (tools/gpu_wheels.py), one call
# each. Part 1 holds everything but flash-attn-4's set, so the first call runs the campaign; FA4's 92 MB CuTe DSL
# libraries follow in parts 2-3 (calls on the warm machine).
GPU_PART_MIB ?= 54
comma := ,
space := $(subst ,, )
GPU_FIRST_PART := deepspeed $(foreach spec,$(GPU_WHEEL_NAMES),$(firstword $(subst ==, ,$(spec))))
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-wheels: setup
	rm -rf $(GPU_WHEELS_DIR).tmp && mkdir -p $(GPU_WHEELS_DIR).tmp
	# DeepSpeed is pure Python; building its wheel here needs torch present, hence no build isolation.
	$(BIN)/python -m pip wheel -q --no-deps --no-build-isolation "$(DEEPSPEED_SPEC)" -w $(GPU_WHEELS_DIR).tmp
	$(BIN)/python -m pip download -q --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) \
		--implementation cp $(GPU_PLATFORMS) -d $(GPU_WHEELS_DIR).tmp $(GPU_WHEEL_SPECS)
	$(BIN)/python tools/gpu_wheels.py split $(GPU_WHEELS_DIR).tmp --max-mib $(GPU_PART_MIB) \
		--first "$(subst $(space),$(comma),$(strip $(GPU_FIRST_PART)))"
	rm -rf $(GPU_WHEELS_DIR) && mv $(GPU_WHEELS_DIR).tmp $(GPU_WHEELS_DIR)
	ls $(GPU_WHEELS_DIR)

# Stages by priority within GPU_BUDGET seconds (tests first); the .tgz carries every file back in one.
GPU_BUDGET ?= 540
gpu-check:
	tools/gpu_check.sh gpu-check-out --budget $(GPU_BUDGET) --tar gpu-check-out.tgz

# Registers / spills / shared memory of every Triton kernel for sm_80 and sm_90a (no GPU needed).
kernel-report: setup
	$(BIN)/python tools/kernel_report.py --candidates bf16 --out docs/benchmarks/kernel-report.json
