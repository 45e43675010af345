# Two commands for a newcomer: `make run` (install and run the bus on ./sbus.socket)
# and `make test` (install what the tests need and run them all).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SOCKET ?= sbus.socket

.PHONY: run test bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e . --config-settings editable_mode=compat
	touch $@

$(VENV)/.test-installed: setup.py | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $@

run: $(VENV)/.installed
	$(BIN)/twistd -n sbus --socket $(SOCKET)

test: $(VENV)/.test-installed
	$(BIN)/pytest

bench: $(VENV)/.installed
	$(BIN)/python bench/run.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info bench/out
