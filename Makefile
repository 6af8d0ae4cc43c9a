# specops — `make demo`, `make test`, `make bench`.
# torch is installed first and pinned, so pip never resolves a (multi-GB CUDA) torch by itself.
# GPU users: make demo TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"
# or install torch into .venv yourself and pass TORCH=  (empty) to keep it.
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
STAMP  := $(VENV)/.specops-installed

# Images (`make image`): the chart's default image is $(IMAGE):$(VERSION) (the controller target).
IMAGE   ?= ghcr.io/specops/specops
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
IMAGE_TARGETS ?= controller runtime
BUILDER ?=
BUILD_ARGS ?=

# llama.cpp peer for `specops bench decode` (the peers extra): llama-cpp-python builds from
# source (~8 min on 2 cores). GGML_NATIVE=ON is llama.cpp's own default for a source build
# (tuned to this CPU, as torch's kernels are); the multimodal library is not needed.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=ON -DLLAVA_BUILD=OFF
# llama.cpp's own llama-server / llama-bench / llama-cli (the sidecar's llama.cpp pools, the CPU
# peer): built with cmake from the llama-cpp-python sdist's vendor/llama.cpp, cached in
# ~/.cache/specops/llama.cpp/<version>/bin (a second build is free); specops/bench/llamacpp_build.py.
LLAMA_JOBS ?= 2

.PHONY: venv install peers demo test bench bench-real gpu-check chaos lint clean image image-names

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	@if [ -n "$(TORCH)" ]; then $(PIP) install --quiet $(TORCH); fi
	$(PIP) install --quiet -e ".[runtime,kernels,test]"
	@touch $(STAMP)

venv install: $(STAMP)

peers: $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install --quiet -e ".[peers]"
	$(PY) -m specops.bench.llamacpp_build --jobs $(LLAMA_JOBS)

demo: $(STAMP)
	$(VENV)/bin/specops demo

lint: $(STAMP)
	$(VENV)/bin/lint-imports

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/specops bench decode --suite code --repeats 3 --json out/bench_decode.json --plot out/bench_decode.png
	$(VENV)/bin/specops bench kernels
	$(VENV)/bin/specops simulate --pods 200 --classes 5 --json out/simulate.json --plot out/simulate.png

# The real model (SmolLM2-135M-Instruct, pulled from the package index): its EAGLE drafter
# (~40 min) and Medusa heads (~20 min) trained once and cached, every method's greedy output
# checked against transformers' on all 174 prompts of the chat-model mixed suite (sampled kinds
# decoded greedily), then the timed comparison with llama.cpp's own llama-server (`make peers` first).
REAL_MODEL ?= smollm2-135m-instruct
bench-real: $(STAMP)
	$(VENV)/bin/specops models pull $(REAL_MODEL)
	@$(PY) -c "import sys; from specops.models.eagle_io import default_dir, is_drafter_dir; sys.exit(0 if is_drafter_dir(default_dir('$(REAL_MODEL)')) else 1)" \
	  || $(VENV)/bin/specops train eagle --model $(REAL_MODEL)
	@$(PY) -c "import sys; from specops.models.medusa_heads import default_dir, is_heads_dir; sys.exit(0 if is_heads_dir(default_dir('$(REAL_MODEL)')) else 1)" \
	  || $(VENV)/bin/specops train heads --model $(REAL_MODEL) --chat
	$(VENV)/bin/specops bench decode --model $(REAL_MODEL) --suite mixed --greedy --repeats 1 --max-new-tokens 48 \
	  --methods hf-greedy,ar,ngram,medusa,auto,eagle,eagle-tree --json out/bench_real_exactness.json
	$(VENV)/bin/specops bench decode --model $(REAL_MODEL) --suite mixed --max-new-tokens 64 --limit 8 --repeats 3 \
	  --methods ar,ngram,medusa,auto,eagle,llama.cpp,llama.cpp-spec,llama.cpp-q4 --json out/bench_real.json

# Failure scenarios against real local processes (redis-server needed); `specops chaos --quick` runs in `make test`.
chaos: $(STAMP)
	@mkdir -p out
	$(VENV)/bin/specops chaos --json out/chaos.json

# Image name per target: the controller is the chart's image, the runtime carries "-runtime".
image-names:
	@for t in $(IMAGE_TARGETS); do \
	  if [ "$$t" = controller ]; then echo "$$t $(IMAGE):$(VERSION)"; else echo "$$t $(IMAGE):$(VERSION)-$$t"; fi; done

# Builds every target with docker (daemon answering), podman or buildah, or BUILDER=...
# Without a registry: make image BUILD_ARGS="--build-arg BASE=<a local Debian image with python3>"
image:
	@builder="$(BUILDER)"; \
	if [ -z "$$builder" ]; then \
	  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then builder=docker; \
	  elif command -v podman >/dev/null; then builder=podman; \
	  elif command -v buildah >/dev/null; then builder=buildah; \
	  else \
	    echo "make image: no image builder: install docker (with a running daemon), podman or buildah, or set BUILDER=" >&2; \
	    if command -v docker >/dev/null; then echo "make image: (docker is installed, but 'docker info' fails: is the daemon running?)" >&2; fi; \
	    exit 1; \
	  fi; \
	fi; \
	$(MAKE) -s image-names | while read -r target name; do \
	  echo "make image: $$builder build --target $$target -t $$name"; \
	  $$builder build --target "$$target" -t "$$name" $(BUILD_ARGS) . || exit 1; \
	done

# GPU_PYTHON=python3: run with a python that already has a CUDA torch, transformers and triton
# (a GPU machine with no package index), from the source tree, without making .venv.
GPU_PYTHON ?=
# GPU_CHECK_ARGS="--prompts F": the code suite as a file, for a python without the stdlib tests.
GPU_CHECK_JSON ?= out/gpu_check.json
GPU_CHECK_ARGS ?=
gpu-check: $(if $(GPU_PYTHON),,$(STAMP))
	$(or $(GPU_PYTHON),$(PY)) -m specops.bench.gpu_check --json $(GPU_CHECK_JSON) $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
