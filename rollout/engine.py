"""The rollout engine: one vLLM ``LLM`` that samples groups of completions and takes weight updates in place.

``RolloutEngine`` is a plain class; the driver runs each instance in its own Ray actor
(``ray.remote(RolloutEngine).options(num_cpus=...)``). On the CPU it runs float32 (see
``../shared/docs/cpu-stack.md`` for why, and for the vLLM 0.32 traps handled here):

* log-probs are requested in vLLM's ``processed_logprobs`` mode, i.e. ``log softmax(logits / temperature)``
  of the sampled token, the distribution the learner recomputes;
* weight updates go through vLLM's own weight-transfer protocol with the ``"ray_object"`` backend of
  ``rollout.weight_sync`` (buckets from the Ray object store, or broadcast over a transfer group joined with
  ``init_weight_transfer_group``; layer-wise reload, the CPU repairs there), and are followed by
  ``reset_prefix_cache()`` (or KV computed with the old weights is reused);
* in the multi-process mode numpy arrays do not survive vLLM's msgpack hop to the engine core, so each
  tensor's bytes are copied into ``bytes`` there; in-process the object store's memory is used as it is.

The ``LLM(...)`` arguments, the model-runner environment, the IPC-safe temporary folder, the EOS ids and the
checkpoint's tensor names are decided in ``rollout/vllm_setup.py``. The calls come in parts, by what they do:
``rollout/engine_sampling.py`` (groups of completions, greedy completions, sequences' log-probs),
``rollout/engine_turns.py`` (episodes' turns, continuous batching), ``rollout/engine_weights.py`` (weight
updates in place), on the state ``rollout/engine_base.py`` declares; this module builds the engine and keeps
its bookkeeping.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch

from rollout.config import RolloutConfig
from rollout.contracts import TurnRequest
from rollout.engine_sampling import Sampling
from rollout.engine_turns import TurnSampling
from rollout.engine_weights import WeightUpdates
from rollout.routing_capture import RoutingStore
from rollout.token_records import TokenRecords
from rollout.vllm_setup import _short_tmp, checkpoint_weight_names, eos_token_ids, llm_kwargs, runner_environment


class RolloutEngine(Sampling, TurnSampling, WeightUpdates):
    """One vLLM engine on one model folder: samples groups of completions with behaviour log-probs.

    Args:
        model_path: Hugging Face model folder (for example from ``cluster.models.resolve.ensure_model``).
        cfg: the ``rollout`` config section (dtype, max_model_len, kv_cache_gb, enforce_eager, in_process,
            threads_per_engine, temperature, max_response_tokens, seed).
        engine_index: index of this engine among the run's engines; its sampling seed is ``cfg.seed + engine_index``.
        cache_dir: folder for vLLM / torch-inductor caches and temp files (``VLLM_CACHE_ROOT``,
            ``TORCHINDUCTOR_CACHE_DIR``, ``TMPDIR``); None leaves the environment's defaults.

    Environment variables are set for the whole process before vLLM is imported, so run one engine per
    process (one Ray actor each). In-process mode makes ``torch.set_num_threads`` a no-op for the process.

    Raises:
        FileNotFoundError: ``model_path`` is not a folder.
    """

    def __init__(self, model_path: str, cfg: RolloutConfig, *, engine_index: int = 0, cache_dir: str | None = None):
        if not Path(model_path).is_dir():
            raise FileNotFoundError(f"model_path={model_path!r} is not a folder")
        self.cfg = cfg
        self.model_path = str(model_path)
        self.engine_index = int(engine_index)
        self._version = 0
        self._seed = int(cfg.seed) + self.engine_index
        self._set_environment(cache_dir)

        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from rollout import weight_sync

        self._checkpoint_names = checkpoint_weight_names(self.model_path)
        self._llm = LLM(
            model=self.model_path,
            tokenizer=self.model_path,
            **llm_kwargs(cfg, self._seed),
            worker_extension_cls="rollout.weight_sync.RolloutWorkerExtension",
            weight_transfer_config=WeightTransferConfig(backend=weight_sync.BACKEND),
        )
        self._llm.init_weight_transfer_engine({"init_info": {}})
        self._routing_layers: list[int] = []
        block_size = int(self._llm.llm_engine.vllm_config.cache_config.block_size)
        self._routing = RoutingStore(block_size)  # this weight version's routings (prefix-cache hits filled in)
        if cfg.return_routed_experts:
            self._routing_layers = self._llm.collective_rpc("rollout_enable_routing_capture")[0]
        hf_config = self._llm.llm_engine.model_config.hf_config
        self._tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Sampling stops on every EOS id the model declares (vLLM itself stops on the tokenizer's and adds the
        # generation config's; named here so that the rule does not hang on that). The EOS token stays in
        # ``response_token_ids`` (vLLM drops it from the text only), so it is trained on like any response token.
        self.stop_token_ids = eos_token_ids(self._llm.llm_engine.model_config.try_get_generation_config(),
                                            getattr(hf_config, "eos_token_id", None),
                                            self._llm.get_tokenizer().eos_token_id)
        self._syncing = False  # between start_weight_update and a successful finish: no sampling
        self._open_turns: dict[str, tuple[TurnRequest, str]] = {}  # advance_turns' turns: (request, vLLM id)
        self._load_open = False  # a weight-sync session under way (in-flight: turns wait for it, no step)
        self._in_flight = "off"  # set_in_flight: weight updates while turns are open (sync.in_flight)
        self._routing_heads: dict[str, tuple[Any, Any]] = {}  # R3: open turns' routings before an in-flight load
        self._turn_marks: dict[str, list[tuple[int, int]]] = {}  # open turn -> where each version's tokens start
        self._token_records = TokenRecords()  # each turn's context and sampled ids, digested (the token check)

    def _set_environment(self, cache_dir: str | None) -> None:
        cfg = self.cfg
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.in_process else "1"
        threads = str(cfg.threads_per_engine)
        os.environ["OMP_NUM_THREADS"] = threads
        if cfg.num_gpus_per_engine == 0:
            # "auto" pins every engine's worker to the same cores; let the OS place engines sharing a machine.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.update(runner_environment(cfg))
        if cache_dir is not None:
            root = Path(cache_dir)
            for sub in ("vllm", "inductor"):  # the temp folder: _short_tmp
                (root / sub).mkdir(parents=True, exist_ok=True)
            os.environ["VLLM_CACHE_ROOT"] = str(root / "vllm")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
            os.environ["TMPDIR"] = str(_short_tmp(root / "tmp"))
        if cfg.in_process:
            # The CPU worker replaces torch.set_num_threads with a no-op once it starts: set it now.
            torch.set_num_threads(cfg.threads_per_engine)

    # ------------------------------------------------------------------ bookkeeping

    def batched_token_budget(self) -> tuple[int, bool]:
        """The scheduler's per-step token budget (``max_num_batched_tokens``) and whether it chunks prefills."""
        sched = self._llm.llm_engine.vllm_config.scheduler_config
        return int(sched.max_num_batched_tokens), bool(sched.enable_chunked_prefill)

    def kv_cache_tokens(self) -> int:
        """Tokens the engine's KV cache holds: vLLM's cache blocks x block size (``cache_config`` after the
        engine sized its cache)."""
        cache = self._llm.llm_engine.vllm_config.cache_config
        return int(cache.num_gpu_blocks or 0) * int(cache.block_size)

    def device_report(self) -> dict[str, Any]:
        """Where the engine runs: ``{"weights": [device types of the model's parameters], "runner": the model
        runner's class as ``module.Name``}`` (vLLM's V1 runners live in ``vllm.v1.worker.gpu_model_runner`` /
        ``cpu_model_runner``, the V2 ones in ``vllm.v1.worker.gpu`` / ``cpu``)."""
        return self._llm.collective_rpc("rollout_device")[0]

    def weight_version(self) -> int:
        """Version of the weights loaded now (0 = the model folder's weights)."""
        return self._version

    def pid(self) -> int:
        """Process id of the process that owns the engine."""
        return os.getpid()

    def shutdown(self) -> None:
        """Stop the engine (its subprocesses in multi-process mode) and free its memory. Idempotent."""
        llm = getattr(self, "_llm", None)
        if llm is None:
            return
        self._llm = None
        core = getattr(llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        del llm
        gc.collect()
