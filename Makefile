# Two commands: `make demo` (the whole pipeline on the embedded default) and `make test` (the suite).
# Both create .venv from requirements.lock first, and only when the lock changed. `make demo ARGS=--verbose`
# prints Prefect's, Ray's and vLLM's logs too (otherwise they go to the run folder, outputs/runs/<run_id>/).
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha256sum requirements.lock | cut -c1-12)
ARGS ?=
# vLLM on CPU sizes its KV cache from the NUMA node; 1 GiB is plenty for tiny models.
export VLLM_CPU_KVCACHE_SPACE ?= 1
export WANDB_MODE ?= offline
export PYTHONPATH := $(CURDIR)

.PHONY: venv demo test test-kernels clean

venv: $(STAMP)

# The stamp's name carries the lock's hash, so a changed lock is a missing stamp; no dependency on the lock's
# mtime, which a checkout or clone changes without changing the lock.
$(STAMP):
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	@echo "installing requirements.lock into $(VENV) (about 2 minutes; log in $(VENV)/install.log)"
	$(PY) -m pip install pip==26.3 > $(VENV)/install.log 2>&1 || (cat $(VENV)/install.log; exit 1)
	$(PY) -m pip install --no-deps -r requirements.lock >> $(VENV)/install.log 2>&1 || (tail -50 $(VENV)/install.log; exit 1)
	$(PY) -c "import torch, vllm, ray, prefect, transformers, peft, datasets, duckdb, s3fs, wandb, moto" 
	touch $@

demo: venv
	$(PY) -m flows.post_train recipes/demo.yaml $(ARGS)

# Triton's kernels run on CUDA only, and the CPU venv leaves Triton out (0.6 GB, unused by the CPU stack).
# `make test` runs them a second time on the CPU under Triton's interpreter, with Triton installed beside the
# venv (.venv/triton), only when no ARGS narrow the run.
TRITON := $(VENV)/triton
TRITON_STAMP := $(TRITON)/.installed-$(shell sha256sum requirements-triton.lock | cut -c1-12)

$(TRITON_STAMP): $(STAMP)
	rm -rf $(TRITON)
	$(PY) -m pip install --no-deps --target $(TRITON) -r requirements-triton.lock >> $(VENV)/install.log 2>&1 \
		|| (tail -20 $(VENV)/install.log; exit 1)
	touch $@

test: venv
	$(PY) -m pytest -q $(ARGS)
	@if [ -z "$(ARGS)" ]; then $(MAKE) --no-print-directory test-kernels; fi

# Under the interpreter the kernels run as numpy: a RuntimeWarning there (0 * inf, overflow) is a nan or inf in a
# lane, so it fails the test.
test-kernels: $(TRITON_STAMP)
	TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR):$(CURDIR)/$(TRITON) $(PY) -m pytest -q -m triton -W error::RuntimeWarning

# A running persistent Ray head (make ray-up) is stopped first: outputs/ray/cluster.json is all that finds it.
clean:
	@if [ -f outputs/ray/cluster.json ]; then $(MAKE) --no-print-directory ray-down; fi
	rm -rf outputs

# A persistent local Ray head for runs with ray.address=... (infra/cluster.py); `make ray-up ARGS="--port 6380"`.
.PHONY: ray-up ray-down
ray-up: venv
	$(PY) -m infra.cluster up $(ARGS)

ray-down:
	$(PY) -m infra.cluster down
