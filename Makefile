# Everything a fresh machine needs: `make demo` runs the stack, `make test` the tests.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test test-unit test-e2e bench lint envoy-config clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) -m bench.demo

test: install
	$(PY) -m pytest -q

test-unit: install
	$(PY) -m pytest -q -m 'not e2e'

test-e2e: install
	$(PY) -m pytest -q -m e2e

bench: install
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m bench.run

lint: install
	$(VENV)/bin/ruff check extproc console bench tests

envoy-config: install
	$(PY) -m extproc envoy-config policies -o envoy/demo.yaml

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
