# Domus: `make demo` and `make test` work from a fresh Debian 12 machine with
# Python 3.11, as root.  Both are idempotent: system packages are installed
# only when missing, the virtualenv only rebuilt when packaging changes.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
APT_PACKAGES := python3-venv python3-dev build-essential libdb-dev redis-server clang iproute2 mariadb-server slurm-wlm munge
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Test processes run side by side (pytest-xdist): one per core by default.
# Integration tests start their own deployments on free ports, so any two
# can run at once.  JOBS=0 runs everything in this one process.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
XDIST := $(if $(filter 0,$(JOBS)),-p no:xdist,-n $(JOBS))

C_TESTS ?= tests/unit/test_rbtree.py tests/unit/test_recordtree.py tests/unit/test_hotpath.py \
  tests/unit/test_udp.py tests/unit/test_replycache.py \
  tests/unit/test_codec.py fuzz/test_fuzz.py
ASAN_DIR := build/asan
FUZZ_DIR := build/fuzz

.PHONY: all demo test test-fast system venv lint bench check-c fuzz clean wheelhouse

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

$(STAMP): setup.py pyproject.toml $(wildcard cext/*.c cext/*.h cext/programs/*.c)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	DOMUS_REQUIRE_C=1 $(BIN)/pip install -q -e '.[test]'
	@# the benchmarks' C programs, domus-bench and domus-udp-echo: setup.py
	@# builds them into build/bin (again if a source changed); the venv links them
	DOMUS_REQUIRE_C=1 $(BIN)/python setup.py -q build_ext --inplace
	@for program in domus-bench domus-udp-echo; do \
	  ln -sf ../../build/bin/$$program $(BIN)/$$program; \
	done
	touch $@

venv: system
	@$(MAKE) --no-print-directory $(STAMP)

# A directory of wheels that installs Domus with Berkeley DB on a machine
# with no network, no compiler and no system packages, as any user:
#   pip install --no-index --find-links wheelhouse 'domus[bdb]'
# Domus's own sdist and wheel (built from the sdist), every dependency, the
# berkeleydb wheel with libdb bundled (auditwheel repair, which also tags
# each wheel with the oldest glibc it runs on), and setuptools and wheel,
# so that the sdist builds offline too.
WHEELHOUSE := wheelhouse
WHEEL_SOURCES := setup.py pyproject.toml MANIFEST.in README.md $(wildcard cext/*.c cext/*.h) \
  $(shell find domus supervisor tests fuzz clients benchmarks docs -name '*.py' -o -name '*.md' \
    -o -name '*.pbs' -o -name '*.sbatch' 2>/dev/null)
WORK := build/wheelhouse

wheelhouse: venv
	@$(MAKE) --no-print-directory $(WHEELHOUSE)/.built

$(WHEELHOUSE)/.built: $(STAMP) $(WHEEL_SOURCES)
	@rm -rf $(WHEELHOUSE) $(WORK) && mkdir -p $(WHEELHOUSE) $(WORK)
	@echo "make: building the sdist and the wheel of Domus"
	@DOMUS_REQUIRE_C=1 $(BIN)/python -m build --no-isolation --outdir $(WORK)/dist . \
	  >$(WORK)/build.log 2>&1 || { tail -40 $(WORK)/build.log; exit 1; }
	@echo "make: collecting wheels of every dependency (berkeleydb built against libdb)"
	@$(BIN)/pip wheel -q --wheel-dir $(WORK)/raw "$$(ls $(WORK)/dist/domus-*.whl)[bdb]" \
	  'setuptools>=68' wheel
	@for wheel in $(WORK)/raw/*.whl; do \
	  case $$wheel in \
	    *-linux_*.whl) PATH="$(CURDIR)/$(BIN):$$PATH" $(BIN)/auditwheel repair \
	                     -w $(WHEELHOUSE) $$wheel >$(WORK)/repair.log 2>&1 \
	                   || { cat $(WORK)/repair.log; exit 1; } ;; \
	    *) cp $$wheel $(WHEELHOUSE)/ ;; \
	  esac; \
	done
	@cp $(WORK)/dist/domus-*.tar.gz $(WHEELHOUSE)/
	@touch $@
	@echo "make: $(WHEELHOUSE)/ holds $$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels; it installs on" \
	  "x86_64 Linux with glibc >= $$(ls $(WHEELHOUSE) | sed -n 's/.*manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1.\2/p' | sort -V | tail -1)"

demo: venv
	$(BIN)/python clients/demo.py

# The C tests under the sanitizers (one process, their output kept until
# they end) while the whole suite runs side by side (the suite's tests wait
# on their deployments much of the time: run alone, it left the two cores
# idle about half the time); then the few tests that measure CPU load
# (marked serial) alone; the last line says how long it all took (from
# make's start: the set-up too) and each part.
MAKE_START := $(shell date +%s)
# (the serial phase collects only the files that have serial tests: the
# whole suite's collection costs more than the tests it would deselect)
SERIAL_FILES = $(or $(shell grep -rl --include='test_*.py' 'mark.serial' tests),tests)
test: venv wheelhouse
	@begin=$$(date +%s); mkdir -p build; \
	( $(MAKE) --no-print-directory check-c JOBS=0 > build/check-c.log 2>&1; \
	  echo $$? > build/check-c.status; date +%s > build/check-c.end ) & checks=$$!; \
	$(BIN)/python -m pytest -q $(XDIST) -m "not serial" $(PYTEST_ARGS) tests; status=$$?; \
	wait $$checks; \
	echo "--- C tests under sanitizers:"; cat build/check-c.log; \
	code=$$(cat build/check-c.status); [ "$$code" = 0 ] || status=$$code; \
	$(BIN)/python -m pytest -q -p no:xdist -m serial $(PYTEST_ARGS) $(SERIAL_FILES) \
	  || { code=$$?; [ $$code = 5 ] || status=$$code; }; \
	end=$$(date +%s); total=$$((end - $(MAKE_START))); \
	printf 'make test: %s in %dm%02ds (set-up %ds, C tests under sanitizers %ds beside the suite, suite %ds; %s)\n' \
	  "$$( [ $$status = 0 ] && echo passed || echo FAILED)" $$((total / 60)) $$((total % 60)) \
	  $$((begin - $(MAKE_START))) $$(( $$(cat build/check-c.end) - begin)) $$((end - begin)) \
	  "$(if $(filter 0,$(JOBS)),one process,$(JOBS) test processes)"; \
	exit $$status

# The suite as `make test` runs it, without the C tests under the sanitizers
# first: `make test-fast PYTEST_ARGS="-k balance"` runs a subset at once.
test-fast: venv wheelhouse
	@$(BIN)/python -m pytest -q $(XDIST) -m "not serial" $(PYTEST_ARGS) tests; status=$$?; \
	$(BIN)/python -m pytest -q -p no:xdist -m serial $(PYTEST_ARGS) $(SERIAL_FILES) \
	  || { code=$$?; [ $$code = 5 ] || status=$$code; }; \
	exit $$status

# The C extensions built with AddressSanitizer + UBSan in a copy of the tree
# (so the normal in-place build is untouched), then their tests run on it,
# with LeakSanitizer on: a leaked object that is not a GC container (bytes,
# int, str...) fails the run at exit.  Leaked containers stay linked in
# CPython's GC lists, where LeakSanitizer counts them as reachable: the
# tests catch those themselves (sys.getallocatedblocks before/after, in the
# normal build).  The fuzz targets' regression inputs, boundary sweep and
# smoke (fuzz/test_fuzz.py) run here too, each object its own allocation
# (PYTHONMALLOC=malloc), so a read past an input is an ASan report.  pytest
# captures only sys.stdout/stderr here: a sanitizer writes its report to
# file descriptor 2 and ends the process, and the report must be seen.
# Property tests run a fifth of their examples here (DOMUS_EXAMPLES_SCALE,
# tests/unit/scale.py): they ran them all in the normal suite, and here
# each is some 10x slower; the fuzz sweeps and smokes run whole.
check-c: venv
	@tests="$$(for t in $(C_TESTS); do [ -f $$t ] && echo $$t; done)"; \
	if [ -z "$$tests" ] || ! ls cext/*.c >/dev/null 2>&1; then \
	  echo "check-c: no C extension or C tests yet"; exit 0; fi; \
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR) && \
	cp -r domus cext tests fuzz setup.py pyproject.toml $(ASAN_DIR)/ && \
	rm -f $(ASAN_DIR)/domus/*.so && \
	cd $(ASAN_DIR) && DOMUS_SANITIZE=1 $(CURDIR)/$(BIN)/python setup.py -q build_ext --inplace \
	  >build.log 2>&1 || { cat build.log; exit 1; }; \
	PYTHONPATH=$(CURDIR)/$(ASAN_DIR) PYTHONMALLOC=malloc DOMUS_EXAMPLES_SCALE=0.2 \
	  ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  $(CURDIR)/$(BIN)/python -m pytest -q -p no:cacheprovider --capture=sys $(XDIST) $$tests

# Every fuzz target for SECONDS seconds (60 by default; TARGETS=... for
# some), coverage-guided by libFuzzer (atheris), on the C extensions built
# by clang with ASan, UBSan and libFuzzer's coverage instrumentation in a
# copy of the tree; prints executions and coverage per target.  Corpora and
# crashing inputs are kept under build/fuzz (see fuzz/run.py).
SECONDS ?= 60
TARGETS ?=
fuzz: venv
	@$(BIN)/python -c "import atheris" 2>/dev/null || $(BIN)/pip install -q 'atheris>=2.3'
	@rm -rf $(FUZZ_DIR)/tree && mkdir -p $(FUZZ_DIR)/tree && \
	cp -r domus cext fuzz setup.py pyproject.toml $(FUZZ_DIR)/tree/ && \
	rm -f $(FUZZ_DIR)/tree/domus/*.so && \
	cd $(FUZZ_DIR)/tree && CC=clang LDSHARED="clang -shared" DOMUS_SANITIZE=fuzz \
	  $(CURDIR)/$(BIN)/python setup.py -q build_ext --inplace >build.log 2>&1 \
	  || { cat build.log; exit 1; }
	@rm -rf $(FUZZ_DIR)/tmp && mkdir -p $(FUZZ_DIR)/tmp && \
	cd $(FUZZ_DIR)/tree && DOMUS_FUZZ_WORK=$(CURDIR)/$(FUZZ_DIR) TMPDIR=$(CURDIR)/$(FUZZ_DIR)/tmp \
	  DOMUS_FUZZ_COMMAND="make fuzz SECONDS=$(SECONDS)$(if $(TARGETS), TARGETS=\"$(TARGETS)\")" \
	  DOMUS_FUZZ_COMMIT="$$(git -C $(CURDIR) rev-parse --short HEAD)$$(git -C $(CURDIR) diff --quiet HEAD || echo -dirty)" \
	  PYTHONPATH=$(CURDIR)/$(FUZZ_DIR)/tree PYTHONMALLOC=malloc \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:allocator_may_return_null=1 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  LD_PRELOAD="$$($(CURDIR)/$(BIN)/python -c 'import atheris; print(atheris.path())')/asan_with_fuzzer.so" \
	  $(CURDIR)/$(BIN)/python -m fuzz.run --seconds $(SECONDS) $(TARGETS)

lint: venv
	$(BIN)/ruff check domus supervisor clients benchmarks tests fuzz

bench: venv
	$(BIN)/python -m benchmarks.put1

clean:
	rm -rf $(VENV) build *.egg-info $(WHEELHOUSE)
