# Two commands set up a fresh machine:  `make demo`  and  `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

$(BIN)/unbroken: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)" -e ".[dev]"
	@touch $@

.PHONY: install demo test lint
install: $(BIN)/unbroken

demo: install
	$(BIN)/unbroken demo

test: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/pytest -q tests

lint: install
	$(BIN)/ruff check src tests benchmarks examples
