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

.PHONY: venv install demo test bench lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip

$(STAMP): $(PY) pyproject.toml
	@if [ -n "$(TORCH)" ]; then $(PIP) install --quiet $(TORCH); fi
	$(PIP) install --quiet -e ".[runtime,kernels,test]"
	@touch $(STAMP)

venv install: $(STAMP)

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
