# Two commands for a newcomer: `make run` (install and run the bus on ./sbus.socket)
# and `make test` (install what the tests need and run them).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SOCKET ?= sbus.socket
# extra pytest arguments, e.g. `make test PYTEST_ARGS='-m slow'` (the slow tests: install paths)
PYTEST_ARGS ?=

.PHONY: run test sim bench clean

# An editable install of this tree (PEP 660; setup.py says why the twistd plugins stay
# visible). The markers are remade when setup.py or pyproject.toml (extras, entry points)
# change, and also when the venv's `sbus` is not this tree's any more (a later
# `pip install .`, `pip uninstall sbus`, or a venv moved to another clone).
INSTALLED_HERE := $(shell test -x $(BIN)/python && cd / && $(abspath $(BIN))/python -c \
	'import os, sys, sbus; sys.exit(os.path.dirname(os.path.dirname(os.path.realpath(sbus.__file__))) != sys.argv[1])' \
	'$(realpath $(CURDIR))' 2>/dev/null && echo yes)
ifneq ($(INSTALLED_HERE),yes)
.PHONY: $(VENV)/.installed $(VENV)/.test-installed
endif

# Twisted's plugin cache, made once after install: without it the first twistd run imports
# every plugin module to make it, Twisted's endpoints among them, which take systemd's
# LISTEN_FDS from the environment before `twistd sbus-relay --socket systemd` can.
PLUGIN_CACHE = $(BIN)/python -c 'from twisted.plugin import IPlugin, getPlugins; list(getPlugins(IPlugin))'

# Bytecode for the tree, as pip writes it for what it installs (an editable install has none):
# where PYTHONDONTWRITEBYTECODE is set, every server, service and command the tests start
# compiled its modules again (about 0.1 s each here) and the freed compile memory skewed the server's
# RSS per connection (docs/performance.md). A module edited later is compiled as before.
COMPILE = $(BIN)/python -m compileall -q sbus

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# pip shows each package it collects: the first install of the test dependencies (Spark,
# Arrow: about 900 MB) takes minutes, and a silent terminal looks hung.
$(VENV)/.installed: setup.py pyproject.toml | $(BIN)/python
	@echo "make: installing sbus into $(VENV) (the first time: a minute or so)"
	$(BIN)/pip install -e .
	$(PLUGIN_CACHE)
	$(COMPILE)
	touch $@

$(VENV)/.test-installed: setup.py pyproject.toml | $(BIN)/python
	@echo "make: installing sbus and the test dependencies into $(VENV) (the first time: about 900 MB, a few minutes)"
	$(BIN)/pip install -e '.[test]'
	$(PLUGIN_CACHE)
	$(COMPILE)
	touch $@

# No pid file (--pidfile=): nothing left in the clone, and a second `make run` is refused only
# while the first still serves ("another server is listening on sbus.socket").
run: $(VENV)/.installed
	@echo "make: serving $(abspath $(SOCKET)); in another terminal: export SBUS_SOCKET=$(abspath $(SOCKET))"
	$(BIN)/twistd -n --pidfile= sbus --socket $(SOCKET)

# pytest-xdist: three worker processes, each taking whole test modules (a module's fixtures,
# a Spark session among them, stay in one process), the longest first (tests/conftest.py's
# LONG_MODULES). Most tests wait on real server processes,
# so three workers fit two cores. `make test PYTEST_WORKERS=` runs in one process.
# pytest prints an assertion's diff whole when CI or BUILD_NUMBER is set; without them it is cut at
# pytest.ini's truncation limits, so a CI log stays short enough to read (-vv shows all).
PYTEST_WORKERS ?= -n 3 --dist loadfile --no-loadscope-reorder
test: $(VENV)/.test-installed
	env -u CI -u BUILD_NUMBER $(BIN)/pytest $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The server's simulator (docs/reliability.md): SEEDS scenarios of 300 steps on each I/O path,
# from a random first seed (printed); e.g. `make sim SEEDS=100000 SIM_ARGS='--budget 600'`.
SEEDS ?= 1000
SIM_ARGS ?=
sim: $(VENV)/.installed
	$(BIN)/python -m sbus.simulator --seeds 0:$(SEEDS) --random-start $(SIM_ARGS)

bench: $(VENV)/.installed bench/out/loadgen bench/out/forwarder
	$(BIN)/python bench/run.py $(BENCH_ARGS)

bench/out/%: bench/%.c bench/loadgen_common.h
	@mkdir -p bench/out
	gcc -O2 -Wall -o $@ $<

clean:
	rm -rf $(VENV) build *.egg-info bench/out
