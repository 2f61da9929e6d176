# Everything a fresh machine needs: `make demo` runs the stack, `make test` the tests.
# Both install what is missing, Python packages and Debian packages alike.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# setuptools says "Editable installation ... be careful with folders in your working
# directory with the same name as your package" on every editable install: here those
# folders are the packages. Only that notice is filtered; real warnings still show.
PIP_WARNINGS := ignore:Editable installation

# Debian packages by what needs them: the browser test drives Debian's chromium (never a
# downloaded browser) and needs a font to render text; the shared-state tests start redis-server.
TEST_SYSTEM_PACKAGES := chromium fonts-dejavu-core redis-server
# `make demo REPLICAS=3`: three extproc replicas behind one Envoy, sharing a local
# redis-server (port 6380, bench/demo.py), which is then installed too.
REPLICAS ?= 1
# More flags for bench.demo, e.g. `make demo DEMO_ARGS=--show-token` (the replicas' API token in the banner).
DEMO_ARGS ?=
DEMO_SYSTEM_PACKAGES := $(if $(filter-out 1,$(REPLICAS)),redis-server,)
# `make bench` measures the Redis state store (bench.state_store) against a local redis-server.
BENCH_SYSTEM_PACKAGES := redis-server

.PHONY: install system-packages-test system-packages-demo system-packages-bench demo test test-unit test-e2e bench lint docs envoy-config clean

$(STAMP): pyproject.toml
	@echo "installing Sluice and its Python packages into $(VENV)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@PYTHONWARNINGS="$(PIP_WARNINGS)" $(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# Idempotent and quick when everything is present (one dpkg query, no apt-get).
system-packages-test:
	@sh bench/system_packages.sh $(TEST_SYSTEM_PACKAGES)

system-packages-demo:
	@sh bench/system_packages.sh $(DEMO_SYSTEM_PACKAGES)

system-packages-bench:
	@sh bench/system_packages.sh $(BENCH_SYSTEM_PACKAGES)

demo: install system-packages-demo
	@$(PY) -m bench.demo --replicas $(REPLICAS) $(DEMO_ARGS)

# The suite waits on processes (Envoy, extproc, engines, Redis, chromium) far more than it
# computes: TEST_WORKERS modules run side by side, each module on one worker (its fixtures
# start one stack per module) and the load tests one after another on one worker
# (tests/conftest.py), in collection order: the load tests and then the end-to-end modules,
# the longest, go out first (xdist's default reorder, most tests first, sent them out last).
# TEST_WORKERS=0 runs it in this process, one test at a time.
TEST_WORKERS ?= 4
PYTEST_PARALLEL := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE, set
# on some CI and sandbox images): the suite starts a few hundred Python processes (extproc,
# engines, the console), and without a cache each compiles every module it imports again
# (~0.13 s of CPU per extproc start), and each worker rewrites every test module (~7 s).
# An empty value turns the setting off.
PYTEST := PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q $(PYTEST_PARALLEL)

test: install system-packages-test
	$(PYTEST)

test-unit: install
	$(PYTEST) -m 'not e2e'

test-e2e: install system-packages-test
	$(PYTEST) -m e2e

bench: install system-packages-bench
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.run

lint: install
	$(VENV)/bin/ruff check extproc console bench tests

# The documentation site (mkdocs.yml, docs/) into site/; make test runs the same strict build.
docs: install
	$(VENV)/bin/mkdocs build --strict

envoy-config: install
	$(PY) -m extproc envoy-config policies -o envoy/demo.yaml --eds-dir var/eds

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
