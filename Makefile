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

# transformers 4.57 next to the venv's 5.x: tests/integration/test_hf_trainer_v4.py's workers
# import it from here (on PYTHONPATH it shadows 5.x), with the hub, tokenizers and datasets
# releases it needs; the venv itself is unchanged.
T4 := $(VENV)/transformers-4.57
$(T4)/.installed: $(BIN)/unbroken
	$(BIN)/pip install -q --upgrade --no-deps --target $(T4) transformers==4.57.6 \
	  huggingface_hub==0.36.2 tokenizers==0.22.2 datasets==4.1.1
	@touch $@

# The etcd backend's tests start an etcd server of their own: Debian's etcd-server. The
# failover tests make three hosts of network namespaces with `ip` (iproute2; they run as
# root, and are skipped, saying why, where namespaces cannot be made). The HTML report's
# test opens the page in a headless Chromium: Debian's chromium.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ETCD := $(shell command -v etcd || echo /usr/bin/etcd)
IP := $(shell command -v ip || echo /usr/sbin/ip)
CHROMIUM := $(shell command -v chromium || echo /usr/bin/chromium)
# The metrics tests start a Prometheus of their own and run promtool over the shipped rules:
# Debian's prometheus (2.42, the oldest the rules must work on). Never its system service.
PROMETHEUS := $(shell command -v prometheus || echo /usr/bin/prometheus)

$(ETCD):
	@command -v apt-get >/dev/null || { echo "install etcd 3.4+ (the etcd backend's tests need it)"; exit 1; }
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends etcd-server

$(IP):
	@command -v apt-get >/dev/null || { echo "install iproute2 (the failover tests need ip)"; exit 1; }
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2

$(CHROMIUM):
	@command -v apt-get >/dev/null || { echo "install chromium (the HTML report's test opens the page in it)"; exit 1; }
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium

$(PROMETHEUS):
	@command -v apt-get >/dev/null || { echo "install prometheus 2.42+ and promtool (the metrics tests need them)"; exit 1; }
	$(SUDO) apt-get update -q
	$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
	-$(SUDO) systemctl disable --now prometheus 2>/dev/null || true

.PHONY: install demo test test-fast coverage lint docs
install: $(BIN)/unbroken $(T4)/.installed $(ETCD) $(IP) $(CHROMIUM) $(PROMETHEUS)

demo: $(BIN)/unbroken  # the demo needs only the package: no etcd, ip or chromium
	$(BIN)/unbroken demo

# The integration tier's tests run JOBS at a time (a test's job is mostly waiting: about one
# core of two is busy with one test), a module per worker; those marked serial alone after.
JOBS ?= 2

# Two tiers: tests/unit (no processes, sockets or sleeps; under a minute) answers first, then
# tests/integration (real agents, workers, faults, etcd, namespaces, a browser).
test: install
	$(BIN)/ruff check src tests benchmarks examples
	$(MAKE) docs
	$(BIN)/pytest -q tests/unit
	$(BIN)/pytest -q -n $(JOBS) --dist loadfile -m "not serial" --durations=60 tests/integration
	$(BIN)/pytest -q -m serial --durations=5 tests/integration

# The documentation site (mkdocs.yml: docs/ and the API reference from the docstrings), built
# with warnings as errors into a temporary directory: a broken link or a missing object fails.
# SITE=dir keeps the site there.
docs: $(BIN)/unbroken
	@site="$${SITE:-$$(mktemp -d)}"; $(BIN)/mkdocs build --strict --quiet --site-dir "$$site"; \
	  rc=$$?; [ -n "$${SITE:-}" ] || rm -rf "$$site"; exit $$rc

test-fast: $(BIN)/unbroken
	$(BIN)/pytest -q tests/unit

# Line coverage of both tiers, every process included (slower than `make test`); pytest-cov
# combines each process's data file into .coverage-data/cov at the end.
coverage: install
	rm -rf .coverage-data && mkdir -p .coverage-data
	COVERAGE_FILE=$(CURDIR)/.coverage-data/cov $(BIN)/pytest -q --cov --cov-report=term tests/unit tests/integration

# lint-imports: the layering contracts of pyproject.toml (`make test` checks them too, in
# tests/unit/test_layers.py).
lint: install
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/lint-imports --no-cache --no-logo
