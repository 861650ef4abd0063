# The two set-up commands are `make run` and `make test`; both create .venv and
# install what they need on a fresh machine, and reinstall only when pyproject changes.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO := proto/hybridserve/v1/engine.proto

.PHONY: run test test-fast bench proto system-deps deps venv clean

# pip installs without byte-compiling: compiling all ~14,000 modules took 50 of its 93 s on a fresh 2-core
# machine, and most are never imported (transformers' 2,900 files, openai's 2,000, sympy's 1,500). Python
# compiles what is imported, once, into __pycache__; a PYTHONDONTWRITEBYTECODE inherited from the caller
# would have every process compile its imports again (torch's and transformers': ~9 s each time), so the
# recipes' processes do not inherit it.
unexport PYTHONDONTWRITEBYTECODE
# The install itself is uv's where it can be had (~15 s here against pip's ~50), else pip's, with pip's
# configuration either way (tools/install_venv.py; HYBRIDSERVE_INSTALL_WITH=pip for pip alone).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) tools/install_venv.py
	@touch $(STAMP)

venv: $(STAMP)

# OpenCL on the CPU (Debian's PoCL; the pip wheel's PoCL cannot build for this CPU)
# and a Prometheus server for the observability tests. Installed only when root;
# elsewhere run: sudo apt-get install -y pocl-opencl-icd prometheus
system-deps:
	@missing=""; for p in pocl-opencl-icd prometheus; do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing$$missing"; apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "warning: missing$$missing; run: sudo apt-get install -y$$missing" >&2; fi; \
	fi

# the venv and the Debian packages side by side: pip keeps one core busy and apt-get mostly waits on
# the disk and the network, so on a fresh machine neither waits for the other
deps:
	@$(MAKE) --no-print-directory -j2 $(STAMP) system-deps

run: deps
	$(VENV)/bin/hybridserve up

# two pytest processes side by side, then the timing-sensitive tests alone (tests/lanes.py)
test: deps
	$(PY) tests/lanes.py --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -ra -m "not slow"

# engine benchmarks (each a few minutes), then the end-to-end suite (~15-20 min); see bench/README.md
bench: $(STAMP) system-deps
	@$(PY) -c "import llama_cpp" 2>/dev/null || { echo "building llama.cpp (llama-cpp-python) for the comparison: ~20-25 min on 2 cores, once"; \
	  $(PY) -m pip install -q -e '.[test,llamacpp]' || echo "warning: llama.cpp did not build; engine_opencl.py runs without it"; }
	$(PY) -m bench.micro.engine_torch
	$(PY) -m bench.micro.engine_opencl
	$(PY) -m bench.micro.handoff
	$(PY) -m bench.micro.quant_gemv
	$(PY) -m bench.micro.logprobs_cost
	$(PY) -m bench suite
	$(PY) -m bench router
	@$(MAKE) --no-print-directory bench-serve

# the serving benchmarks against llama.cpp's server (bench/README.md): builds llama-server once
# (~5-25 min on 2 cores; skipped when built), then the serve and prefix benchmarks. Without a
# llama-server build serve.py still runs, says so, and measures our modes only.
# SERVE_REPEATS=1 for a quicker, noisier pass; LLAMA_SERVER=PATH to use another binary.
SERVE_REPEATS ?= 3
.PHONY: bench-serve llama-server
llama-server: $(STAMP)
	$(PY) -m bench llama-server

bench-serve: $(STAMP) system-deps
	@$(PY) -m bench llama-server >/dev/null || echo "WARNING: llama-server did not build: the serving benchmark runs WITHOUT it"
	$(PY) -m bench serve --start-stack --repeats $(SERVE_REPEATS) --llama-server $(or $(LLAMA_SERVER),auto)
	$(PY) -m bench prefix --repeats $(SERVE_REPEATS)

# the compose stack for real (tests/deploy/test_compose_live.py): builds the images, brings them up, kills an
# engine and sees it heal. Needs root for Docker; tens of minutes on a cold cache, so not part of `make test`
.PHONY: test-compose
test-compose: $(STAMP)
	HYBRIDSERVE_TEST_COMPOSE=1 $(PY) -m pytest -q -ra -s tests/deploy/test_compose_live.py

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iservices/rpc=proto --python_out=. --grpc_python_out=. --pyi_out=. $(PROTO)

clean:
	rm -rf $(VENV) .pytest_cache
