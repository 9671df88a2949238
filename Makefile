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

.PHONY: help deps venv build lint golint pylint gotest pytest man man-check slurm-test test demo clean

help:
	@echo "make demo   run the main job (4 simulated ranks, 2 NVIDIA + 2 AMD, train a model with DDP over the gpubridge backend on CPU)"
	@echo "make test   run every test (lint, go tests with -race, torch interop, CLI scripts, man pages, Slurm)"
	@echo "make build  build the tools into bin/"
	@echo "make man    regenerate man/*.1 from the CLI models"

deps:
	@ci/deps.sh

venv: deps
	@ci/venv.sh

build: deps
	@mkdir -p $(BIN)
	$(GO) build -trimpath -o $(BIN)/ $(addprefix ./tools/,$(TOOLS))

lint: golint pylint

golint: deps
	@out=$$(gofmt -l lib tools); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) tool staticcheck ./...

# The Python package gpubridge (torchplugin/): ruff and mypy from the venv.
pylint: venv
	cd torchplugin && $(CURDIR)/.venv/bin/ruff check . && $(CURDIR)/.venv/bin/ruff format --check . && $(CURDIR)/.venv/bin/mypy gpubridge
	$(CURDIR)/.venv/bin/ruff check --config torchplugin/pyproject.toml examples ci
	$(CURDIR)/.venv/bin/ruff format --check --config torchplugin/pyproject.toml examples ci

# The Go tests, with the race detector; GPUBRIDGE_PYTHON turns on the torch
# interop tests and GPUBRIDGE_BIN the tests of built binaries.
gotest: venv build
	GPUBRIDGE_PYTHON=$(PY) GPUBRIDGE_BIN=$(BIN) $(GO) test -race -count=1 -timeout 20m ./...
	@# The race detector allocates and slows everything: the tests that count
	@# allocations or time the feed run once more without it.
	$(GO) test -count=1 -timeout 10m -run 'TestNoAllocs|TestLatencyInProcess|TestServeLatency' ./lib/transport ./lib/feed ./tools/gbbridge

# The Python tests: the feed client against real gbbridge serve processes.
pytest: venv build
	cd torchplugin && GPUBRIDGE_BIN=$(BIN) $(PY) -m pytest -q tests

man: build
	@mkdir -p man
	@for t in $(TOOLS); do $(BIN)/$$t --man > man/$$t.1; done
	@echo "man pages written: $(addprefix man/,$(addsuffix .1,$(TOOLS)))"

man-check: build
	@stale=0; for t in $(TOOLS); do \
	  if ! $(BIN)/$$t --man | diff -u man/$$t.1 - >/dev/null; then echo "man/$$t.1 is stale: run make man"; stale=1; fi; \
	done; exit $$stale
	@echo "man pages are fresh"

# A real one-node Slurm with a gbprobe prolog; needs root (it installs
# slurm-wlm and munge and starts their daemons).
slurm-test: build
	@if [ "$$(id -u)" -ne 0 ]; then echo "slurm-test: skipped: needs root to install and start Slurm"; \
	else GBPROBE=$(BIN)/gbprobe ci/slurm/prolog-test.sh; fi

test: lint gotest pytest man-check slurm-test
	@echo "make test: all passed"

demo: venv build
	@ci/demo.sh $(BIN)

clean:
	rm -rf $(BIN)
