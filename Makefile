# gpubridge: `make demo` runs the main job, `make test` runs every test.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

TOOLS := $(notdir $(wildcard tools/gb*))
BIN := $(CURDIR)/bin
PY := $(CURDIR)/.venv/bin/python
GO ?= go
export CGO_ENABLED := 1
# go-nvml's headers use deprecated declarations; the warnings are noise.
export CGO_CFLAGS ?= -O2 -g -Wno-deprecated-declarations

# What each test step records for the list of skipped tests that ends make
# test (ci/testreport): go test -json streams, pytest's JUnit XML, make's own
# skips (NAME<TAB>REASON lines).
TESTOUT := $(CURDIR)/out/test
REPORT := $(TESTOUT)/testreport
# How long test-long fuzzes each fuzz target.
FUZZTIME ?= 30s

.PHONY: help deps venv build lint golint pylint gotest pytest pytest-torch man man-check slurm-test vm-test bench-docs test-fresh test test-long bench-latency demo clean

help:
	@echo "make demo   run the main job (4 simulated ranks, 2 NVIDIA + 2 AMD, train a model with DDP over the gpubridge backend on CPU)"
	@echo "make test   run every test (lint, go tests with -race, torch interop, CLI scripts, man pages, Slurm, the soft-RoCE VM lane, benchmark docs);"
	@echo "            it ends with the list of skipped tests and fails, run as root, if a test that needs root was skipped"
	@echo "make test-long      fuzz every fuzz target for FUZZTIME each (default 30s; minutes in all, not run by make test)"
	@echo "make bench-latency  BenchmarkServeLatency: the feed's 4-byte all_reduce latency against its 30 us budget (needs ~8 CPUs)"
	@echo "make vm-test        the soft-RoCE lane alone (part of make test): two QEMU guests with rdma_rxe, the verbs transport for real"
	@echo "make build  build the tools into bin/"
	@echo "make man    regenerate man/*.1 from the CLI models"

deps:
	@ci/deps.sh

venv: deps
	@ci/venv.sh

# The command is echoed on stderr: stdout is data (make demo prints JSON).
build: deps
	@mkdir -p $(BIN)
	@echo "$(GO) build -trimpath -o $(BIN)/ $(addprefix ./tools/,$(TOOLS))" >&2
	@$(GO) build -trimpath -o $(BIN)/ $(addprefix ./tools/,$(TOOLS))

lint: golint pylint

golint: deps
	@out=$$(gofmt -l lib tools); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

# The Python package gpubridge (torchplugin/): ruff and mypy from the venv.
pylint: venv
	cd torchplugin && $(CURDIR)/.venv/bin/ruff check . && $(CURDIR)/.venv/bin/ruff format --check . && $(CURDIR)/.venv/bin/mypy gpubridge
	$(CURDIR)/.venv/bin/ruff check --config torchplugin/pyproject.toml examples ci bench tools lib
	$(CURDIR)/.venv/bin/ruff format --check --config torchplugin/pyproject.toml examples ci bench tools lib
	$(CURDIR)/.venv/bin/ruff check --config kit/pyproject.toml kit
	$(CURDIR)/.venv/bin/ruff format --check --config kit/pyproject.toml kit
	cd kit && $(CURDIR)/.venv/bin/mypy

$(REPORT): ci/testreport/main.go
	@mkdir -p $(TESTOUT)
	$(GO) build -o $@ ./ci/testreport

# The Go tests, with the race detector; GPUBRIDGE_PYTHON turns on the torch
# interop tests and GPUBRIDGE_BIN the tests of built binaries. The console
# shows what plain go test shows; $(TESTOUT) keeps the -json streams.
gotest: venv build $(REPORT)
	GPUBRIDGE_PYTHON=$(PY) GPUBRIDGE_BIN=$(BIN) $(GO) test -race -count=1 -timeout 20m -json ./... | $(REPORT) tee $(TESTOUT)/go-race.json
	@# The race detector allocates and slows everything: the tests that count
	@# allocations or time the feed, and the checks of every float32 against
	@# the half-precision references (~80 CPU-s) and of the AVX2 codec
	@# kernels against the Go ones (~3 min), run once more without it.
	GPUBRIDGE_EXHAUSTIVE=1 $(GO) test -count=1 -timeout 15m -json -run 'TestNoAllocs|TestLatencyInProcess|TestF32ToHalfAllFloat32|TestEncodeManyFloat32|TestBF16Encode' \
	  ./lib/transport ./lib/feed/feedserver ./lib/reduce ./lib/codec | $(REPORT) tee $(TESTOUT)/go-norace.json

# The plugin's tests on the project's torch (the GPU machine's version),
# including a pip install of the package into a fresh venv that runs the
# examples (GPUBRIDGE_INSTALL_TEST).
pytest: venv build
	@mkdir -p $(TESTOUT)
	cd torchplugin && GPUBRIDGE_BIN=$(BIN) GPUBRIDGE_INSTALL_TEST=1 $(PY) -m pytest -q --junitxml=$(TESTOUT)/pytest.xml tests
	cd kit && PYTHONPATH=$(CURDIR)/torchplugin GPUBRIDGE_BIN_DIR=$(BIN) $(PY) -m pytest -q --junitxml=$(TESTOUT)/pytest-kit.xml tests

# The plugin's tests on the oldest and the newest torch that
# torchplugin/pyproject.toml allows, each in its own venv (ci/torch-venv.sh).
TORCH_VERSIONS := 2.8.0 2.15.0
pytest-torch: build
	@mkdir -p $(TESTOUT)
	@for v in $(TORCH_VERSIONS); do ci/torch-suite.sh $$v $(TESTOUT)/pytest-torch-$$v.xml; done

man: build
	@mkdir -p man
	@for t in $(TOOLS); do $(BIN)/$$t --man > man/$$t.1; done
	@echo "man pages written: $(addprefix man/,$(addsuffix .1,$(TOOLS)))"

man-check: build
	@stale=0; for t in $(TOOLS); do \
	  if ! $(BIN)/$$t --man | diff -u man/$$t.1 - >/dev/null; then echo "man/$$t.1 is stale: run make man"; stale=1; fi; \
	done; exit $$stale
	@echo "man pages are fresh"

# A real one-node Slurm with a gbprobe prolog, then the cluster kit (kit/) on
# a real Slurm of two node names (hetjob launch, validation steps, prolog);
# needs root (it installs slurm-wlm and munge and starts their daemons).
slurm-test: build
	@mkdir -p $(TESTOUT); rm -f $(TESTOUT)/slurm.skip
	@if [ "$$(id -u)" -ne 0 ]; then echo "slurm-test: skipped: needs root to install and start Slurm"; \
	  printf 'slurm-test\tneeds root: installs and starts Slurm for the gbprobe prolog and the kit hetjob tests (make test as root runs them)\n' > $(TESTOUT)/slurm.skip; \
	else GBPROBE=$(BIN)/gbprobe ci/slurm/prolog-test.sh && $(MAKE) --no-print-directory venv && ci/slurm/hetjob-test.sh $(BIN) $(PY); fi

# The soft-RoCE lane (ci/vm/run.sh, docs/VERBS.md): two QEMU guests (TCG)
# booted from this system's Debian kernel, joined by a virtual link with an
# rdma_rxe device on each end; inside them the verbs Go tests, gbprobe, the
# selftest, a bit-exact all_reduce and the feed path across them, the fault
# checks. Its Go tests come back as go test -json streams (vm-*.json) for
# the skip list. As root it installs its packages (ci/vm/deps.sh); as
# another user without them it is listed as skipped.
vm-test: $(REPORT)
	@mkdir -p $(TESTOUT); rm -f $(TESTOUT)/vm.skip
	@rc=0; ci/vm/deps.sh || rc=$$?; \
	if [ $$rc -eq 3 ]; then echo "vm-test: skipped: needs root to install its Debian packages"; \
	  printf 'vm-test\tneeds root: installs qemu-system-x86, linux-image-amd64, busybox-static, rdma-core, ibverbs-providers, ibverbs-utils, libibverbs-dev for the soft-RoCE VM lane (or install them; make test as root does)\n' > $(TESTOUT)/vm.skip; \
	elif [ $$rc -ne 0 ]; then exit $$rc; \
	else GO=$(GO) ci/vm/run.sh $(TESTOUT); fi

# Every table of docs/BENCHMARKS.md is regenerated from docs/bench/ and
# must match.
bench-docs: venv
	$(PY) bench/docs.py check

# What an earlier run left must not enter this run's list of skips.
test-fresh:
	@rm -f $(TESTOUT)/*.json $(TESTOUT)/*.xml $(TESTOUT)/*.skip

test: test-fresh lint gotest pytest pytest-torch man-check slurm-test vm-test bench-docs $(REPORT)
	@$(REPORT) skips $(TESTOUT)
	@echo "make test: all passed"

# Longer than CI's time: fuzz every fuzz target for FUZZTIME.
test-long: deps
	@set -e; for pkg in $$($(GO) list ./...); do \
	  dir=$$($(GO) list -f '{{.Dir}}' $$pkg); \
	  for f in $$(grep -ho '^func Fuzz[A-Za-z0-9_]*' $$dir/*_test.go 2>/dev/null | cut -c6-); do \
	    echo "== $$pkg $$f ($(FUZZTIME))" >&2; \
	    $(GO) test -run '^$$' -fuzz "^$$f\$$" -fuzztime $(FUZZTIME) $$pkg; \
	  done; \
	done
	@echo "make test-long: every fuzz target ran $(FUZZTIME) without a failure"

# The feed's latency budget (docs/BENCHMARKS.md, "Feed latency"). It fails
# when the budget is missed, which it is on machines with few CPUs.
bench-latency: venv build
	GPUBRIDGE_BIN=$(BIN) GPUBRIDGE_PYTHON=$(PY) $(GO) test -count=1 -run '^$$' -bench BenchmarkServeLatency -benchtime 1x ./tools/gbbridge/

demo: venv build
	@ci/demo.sh $(BIN)

clean:
	rm -rf $(BIN) torchplugin/build
