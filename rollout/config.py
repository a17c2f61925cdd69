"""Config section ``rollout``: the vLLM rollout engines."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of the rollout config sections: unknown keys are refused and values are validated on assignment
    (tests/unit/cluster/test_config.py checks that every section of the composed schema is strict)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, strict=False)


class RolloutConfig(Section):
    """How completions are sampled and how many engines sample them."""

    num_engines: int = Field(1, ge=1, description="vLLM engines (one Ray actor each); free to change on resume")
    num_cpus_per_engine: float = Field(1.0, gt=0, description="Ray CPUs reserved per engine actor")
    node_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources (name: amount) that each engine's placement bundle asks for beside its "
        "CPUs, so that it lands only on nodes started with them (`ray start --resources '{\"NAME\": N}'`, "
        "gspo-cluster up --node-resources NAME=N); e.g. {rollout_node: 1} dedicates nodes to this role. "
        "{} = any node",
    )


    num_gpus_per_engine: float = Field(0.0, ge=0, description="Ray GPUs per engine (0 on CPU machines)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM tensor parallelism inside one engine (GPU)")
    threads_per_engine: int = Field(1, ge=1, description="torch/OpenMP threads of one engine on CPU")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of training rollouts")
    top_p: float = Field(1.0, gt=0, le=1, description="must stay 1.0 for training rollouts (unbiased log-probs)")
    top_k: int = Field(-1, description="must stay -1 for training rollouts")
    max_response_tokens: int = Field(16, ge=1, description="response length limit L_max, tokens")
    max_model_len: int = Field(128, ge=8, description="prompt + response token limit of the engine")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="engine dtype (float32 on CPU)")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM GPU memory share (GPU only)")
    kv_cache_gb: float = Field(
        0.5, gt=0, description="KV cache size per engine, GiB: CPU only (on a GPU vLLM sizes the cache from "
        "gpu_memory_utilization; setting this key with num_gpus_per_engine > 0 is refused)")
    enforce_eager: bool = Field(True, description="skip torch.compile/CUDA graphs (fast start)")
    in_process: bool = Field(True, description="run vLLM's engine core inside the actor process (CPU: faster start)")
    seed: int = Field(0, description="base sampling seed; engine i uses seed + i")
    return_routed_experts: bool = Field(
        False,
        description="MoE only: each completion carries the experts every MoE layer of the engine ran per input "
        "position (Completion.routed_experts; rollout/routing_capture.py), for learner.routing_replay='rollout' "
        "(set it there). Prefix caching stays on: positions served from the cache get the experts of the earlier "
        "request (same weight version) that computed that KV",
    )
    pieces_per_engine: int = Field(
        1, ge=1, description="training rollouts: each engine's prompts go out in this many calls, and each call's "
        "completions are scored as soon as it returns (scoring overlaps the generation of the rest; the samples "
        "do not depend on it)")

    @model_validator(mode="after")
    def _check_gpu_keys(self) -> "RolloutConfig":
        if self.num_gpus_per_engine > 0 and "kv_cache_gb" in self.model_fields_set:
            raise ValueError(
                f"rollout.kv_cache_gb={self.kv_cache_gb} with rollout.num_gpus_per_engine={self.num_gpus_per_engine}: "
                "the byte size of the KV cache is a CPU setting (passed to vLLM it makes vLLM ignore "
                "rollout.gpu_memory_utilization); on a GPU size the cache with rollout.gpu_memory_utilization and "
                "remove rollout.kv_cache_gb"
            )
        if self.num_gpus_per_engine > 0 and self.return_routed_experts and not self.enforce_eager:
            raise ValueError(
                "rollout.return_routed_experts=true with rollout.enforce_eager=false on GPU engines: a CUDA-graph "
                "replay never calls the routers' Python capture hook, so the replayed decode steps would have no "
                "routing (rollout/routing_capture.py); set rollout.enforce_eager=true"
            )
        return self
