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

# The etcd backend's tests start an etcd server of their own: Debian's etcd-server.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ETCD := $(shell command -v etcd || echo /usr/bin/etcd)

$(ETCD):
	@command -v apt-get >/dev/null || { echo "install etcd 3.4+ (the etcd backend's tests need it)"; exit 1; }
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server

.PHONY: install demo test lint
install: $(BIN)/unbroken $(ETCD)

demo: install
	$(BIN)/unbroken demo

test: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/pytest -q tests

lint: install
	$(BIN)/ruff check src tests benchmarks examples
