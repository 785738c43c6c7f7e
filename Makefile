# Domus: `make demo` and `make test` work from a fresh Debian 12 machine with
# Python 3.11, as root.  Both are idempotent: system packages are installed
# only when missing, the virtualenv only rebuilt when packaging changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := python3-venv python3-dev build-essential libdb-dev redis-server
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: all demo test system venv lint bench clean

all: test

system:
	@missing=""; \
	for package in $(APT_PACKAGES); do \
	  dpkg -s $$package >/dev/null 2>&1 || missing="$$missing $$package"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make: installing system packages:$$missing"; \
	  if [ "$$(id -u)" != 0 ]; then \
	    echo "make: need root (or sudo) to apt-get install$$missing" >&2; exit 1; \
	  fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing; \
	fi

$(STAMP): setup.py pyproject.toml $(wildcard cext/*.c cext/*.h)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $@

venv: system
	@$(MAKE) --no-print-directory $(STAMP)

demo: venv
	$(BIN)/python clients/demo.py

test: venv
	$(BIN)/python -m pytest -q $(PYTEST_ARGS) tests

lint: venv
	$(BIN)/ruff check domus supervisor clients benchmarks tests

bench: venv
	$(BIN)/python -m benchmarks.put1

clean:
	rm -rf $(VENV) build *.egg-info
