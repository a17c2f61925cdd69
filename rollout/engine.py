"""The rollout engine: one vLLM ``LLM`` that samples groups of completions and takes weight updates in place.

``RolloutEngine`` is a plain class; the driver runs each instance in its own Ray actor
(``ray.remote(RolloutEngine).options(num_cpus=...)``). On the CPU it runs float32 (see
``../shared/docs/cpu-stack.md`` for why, and for the vLLM 0.32 traps handled here):

* log-probs are requested in vLLM's ``processed_logprobs`` mode, i.e. ``log softmax(logits / temperature)``
  of the sampled token, the distribution the learner recomputes;
* weight updates go through the worker's ``reload_weights`` (``model.load_weights`` fails in 0.32), after
  dropping every MoE layer's cached kernel so the CPU expert repacking runs again (vLLM 0.32 skips it on
  reload and every later forward is silently wrong), and are followed by ``reset_prefix_cache()`` (or KV
  computed with the old weights is reused);
* in the multi-process mode tensors cannot cross ``collective_rpc``, so each bucket travels as a safetensors
  byte blob; in-process the tensors are passed as they are.
"""

from __future__ import annotations

import gc
import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from rollout.contracts import Completion, PromptRow
from rollout.config import RolloutConfig

_FUSED_GATE_UP = re.compile(r"^(?P<prefix>.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(?P<prefix>.*\.experts)\.down_proj$")


class RolloutWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``); they run in the worker process and are
    called through ``LLM.collective_rpc(name, args=...)``."""

    def rollout_stage_weights(self, payload: bytes | dict[str, torch.Tensor]) -> int:
        """Keep one bucket of checkpoint-format weights until ``rollout_commit_weights``.

        Args:
            payload: a safetensors byte blob (multi-process mode) or a dict name -> tensor (in-process).

        Returns:
            the number of tensors staged so far.
        """
        if isinstance(payload, (bytes, bytearray, memoryview)):
            from safetensors.torch import load as load_safetensors

            payload = load_safetensors(bytes(payload))
        staged = getattr(self, "_rollout_staged", None)
        if staged is None:
            staged = self._rollout_staged = []
        staged.extend(payload.items())
        return len(staged)

    def rollout_commit_weights(self) -> int:
        """Load all staged tensors in place, then clear them. Returns the number of tensors loaded.

        Drops each MoE layer's cached kernel first (``quant_method.moe_kernel = None``) so that
        ``process_weights_after_loading`` repacks the new expert weights, as it does at the first load.
        """
        staged = getattr(self, "_rollout_staged", None) or []
        self._rollout_staged = []
        if not staged:
            return 0
        model = self.model_runner.get_model()
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and getattr(method, "moe_kernel", None) is not None:
                method.moe_kernel = None
        self.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        return len(staged)

    def rollout_discard_staged(self) -> int:
        """Drop staged tensors without loading them (after a failed update). Returns how many were dropped."""
        staged = getattr(self, "_rollout_staged", None) or []
        self._rollout_staged = []
        return len(staged)


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


def to_checkpoint_format(weights: Mapping[str, torch.Tensor], names: set[str] | None) -> dict[str, torch.Tensor]:
    """Rename a transformers state dict into the checkpoint's tensor names.

    transformers 5 keeps each MoE layer's experts fused: ``...experts.gate_up_proj`` ``[E, 2I, H]`` (gate rows
    first, then up) and ``...experts.down_proj`` ``[E, H, I]``, while the saved checkpoint (and vLLM's loader)
    use one ``...experts.{e}.{gate,up,down}_proj.weight`` per expert. Fused tensors are split into views
    when the checkpoint uses per-expert names; every other tensor passes through unchanged.

    Args:
        weights: name -> tensor (any dtype, CPU).
        names: the checkpoint's tensor names, or None to split fused experts unconditionally.
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if names is not None and name in names:
            out[name] = tensor
            continue
        gate_up, down = _FUSED_GATE_UP.match(name), _FUSED_DOWN.match(name)
        if gate_up and tensor.dim() == 3:
            half = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{gate_up['prefix']}.{e}.gate_proj.weight"] = tensor[e, :half]
                out[f"{gate_up['prefix']}.{e}.up_proj.weight"] = tensor[e, half:]
        elif down and tensor.dim() == 3:
            for e in range(tensor.shape[0]):
                out[f"{down['prefix']}.{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def _resolve_bucket(bucket: Any) -> Mapping[str, torch.Tensor]:
    if isinstance(bucket, Mapping):
        return bucket
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        ray = None
    if ray is not None and isinstance(bucket, ray.ObjectRef):
        value = ray.get(bucket)
        if isinstance(value, Mapping):
            return value
        raise TypeError(f"weight bucket ObjectRef holds {type(value).__name__}, expected dict[str, torch.Tensor]")
    raise TypeError(f"weight bucket is {type(bucket).__name__}, expected dict[str, torch.Tensor] or a Ray ObjectRef")


class RolloutEngine:
    """One vLLM engine on one model folder: samples groups of completions with behaviour log-probs.

    Args:
        model_path: Hugging Face model folder (for example from ``cluster.tiny_model.ensure_model``).
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

        self._checkpoint_names = checkpoint_weight_names(self.model_path)
        self._llm = LLM(
            model=self.model_path,
            tokenizer=self.model_path,
            dtype=cfg.dtype,
            max_model_len=cfg.max_model_len,
            kv_cache_memory_bytes=int(cfg.kv_cache_gb * (1 << 30)),
            enforce_eager=cfg.enforce_eager,
            seed=self._seed,
            logprobs_mode="processed_logprobs",
            tensor_parallel_size=cfg.tensor_parallel_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            worker_extension_cls=f"{__name__}.RolloutWorkerExtension",
            disable_log_stats=True,
        )
        hf_config = self._llm.llm_engine.model_config.hf_config
        self._tied_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))

    def _set_environment(self, cache_dir: str | None) -> None:
        cfg = self.cfg
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if cfg.in_process else "1"
        threads = str(cfg.threads_per_engine)
        os.environ["OMP_NUM_THREADS"] = threads
        # "auto" pins every engine's worker to the same cores; let the OS place engines that share a machine.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if cache_dir is not None:
            root = Path(cache_dir)
            for sub in ("vllm", "inductor", "tmp"):
                (root / sub).mkdir(parents=True, exist_ok=True)
            os.environ["VLLM_CACHE_ROOT"] = str(root / "vllm")
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(root / "inductor")
            os.environ["TMPDIR"] = str(root / "tmp")
        if cfg.in_process:
            # The CPU worker replaces torch.set_num_threads with a no-op once it starts: set it now.
            torch.set_num_threads(cfg.threads_per_engine)

    # ------------------------------------------------------------------ sampling

    def _prompt_inputs(self, prompts: list[PromptRow]) -> list[Any]:
        from vllm.inputs import TokensPrompt

        inputs = []
        for row in prompts:
            ids = list(row.prompt_token_ids)
            if not ids:
                raise ValueError(f"prompt uid={row.uid!r}: prompt_token_ids is empty")
            if len(ids) >= self.cfg.max_model_len:
                raise ValueError(
                    f"prompt uid={row.uid!r}: {len(ids)} prompt tokens, at or above rollout.max_model_len="
                    f"{self.cfg.max_model_len}"
                )
            inputs.append(TokensPrompt(prompt_token_ids=ids))
        return inputs

    def _sample(self, prompts: list[PromptRow], params: list[Any], n: int) -> list[Completion]:
        if not prompts:
            return []
        outputs = self._llm.generate(self._prompt_inputs(prompts), params, use_tqdm=False)
        completions: list[Completion] = []
        for row, out in zip(prompts, outputs, strict=True):
            samples = sorted(out.outputs, key=lambda o: o.index)
            if len(samples) != n:
                raise RuntimeError(f"prompt uid={row.uid!r}: vLLM returned {len(samples)} completions, expected {n}")
            for k, sample in enumerate(samples):
                token_ids = list(sample.token_ids)
                if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
                    raise RuntimeError(f"prompt uid={row.uid!r}: vLLM returned no log-prob for some sampled tokens")
                logprobs = [float(step[tok].logprob) for tok, step in zip(token_ids, sample.logprobs, strict=True)]
                completions.append(
                    Completion(
                        prompt_uid=row.uid,
                        sample_index=k,
                        prompt_token_ids=list(row.prompt_token_ids),
                        response_token_ids=token_ids,
                        response_logprobs=logprobs,
                        response_text=sample.text,
                        finish_reason="length" if sample.finish_reason == "length" else "stop",
                        weight_version=self._version,
                    )
                )
        return completions

    def generate(
        self,
        prompts: list[PromptRow],
        n: int,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt (a group), with the sampled tokens' post-temperature log-probs.

        ``SamplingParams(n=n, temperature, top_p=1, top_k=-1, logprobs=0)``: unbiased sampling from
        ``softmax(logits / temperature)``; each log-prob is ``log softmax(logits / temperature)[token]``
        (natural log). Prompts go in as token ids (``PromptRow.prompt_token_ids``).

        Args:
            prompts: the rows to complete.
            n: group size (completions per prompt), >= 1.
            temperature: default ``cfg.temperature``; must be > 0 (use ``generate_greedy`` for 0).
            max_tokens: response token limit, default ``cfg.max_response_tokens``.
            seed: None uses the engine's sampler seed (``cfg.seed + engine_index``); an int makes the call
                reproducible: prompt ``i`` gets the per-request seed ``(seed * 1_000_003 + i) * 2**20`` (vLLM
                seeds the ``n`` samples of a request with ``seed + k``, so the streams never overlap for n < 2**20).

        Returns:
            ``len(prompts) * n`` completions in prompt order: completions ``i*n .. i*n+n-1`` answer prompt
            ``i``, with ``sample_index`` 0..n-1 and this engine's current ``weight_version``.

        Raises:
            ValueError: n < 1, temperature <= 0, max_tokens < 1, an empty prompt, or a prompt of at least
                ``max_model_len`` tokens.
        """
        from vllm import SamplingParams

        temperature = self.cfg.temperature if temperature is None else float(temperature)
        max_tokens = self.cfg.max_response_tokens if max_tokens is None else int(max_tokens)
        if n < 1:
            raise ValueError(f"n={n} must be >= 1")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be > 0 for sampling (use generate_greedy)")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        params = [
            SamplingParams(
                n=n,
                temperature=temperature,
                top_p=1.0,
                top_k=-1,
                max_tokens=max_tokens,
                logprobs=0,
                seed=None if seed is None else self._request_seed(int(seed), i, n),
            )
            for i in range(len(prompts))
        ]
        return self._sample(prompts, params, n)

    @staticmethod
    def _request_seed(seed: int, prompt_index: int, n: int) -> int:
        if n >= 1 << 20:
            raise ValueError(f"n={n} must be below 2**20 when a seed is given")
        return ((seed * 1_000_003 + prompt_index) << 20) % (1 << 62)

    def generate_greedy(self, prompts: list[PromptRow], max_tokens: int | None = None) -> list[Completion]:
        """One greedy (temperature 0) completion per prompt, for evaluation; same layout as ``generate`` with
        n=1. The log-probs are those of the unscaled logits.

        Raises:
            ValueError: max_tokens < 1, an empty prompt, or a prompt of at least ``max_model_len`` tokens.
        """
        from vllm import SamplingParams

        max_tokens = self.cfg.max_response_tokens if max_tokens is None else int(max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        params = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens, logprobs=0)
        return self._sample(prompts, [params] * len(prompts), 1)

    def sequence_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (temperature 1, nats) of ``token_ids[start:]``, each given all tokens before it.

        Uses vLLM's prompt log-probs of the whole sequence (a prefill; prompt-logprob requests do not read the
        prefix cache).

        Returns:
            ``len(token_ids) - start`` floats.

        Raises:
            ValueError: ``start`` outside ``[1, len(token_ids))`` or a sequence of at least ``max_model_len`` tokens.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = [int(t) for t in token_ids]
        if not 1 <= start < len(ids):
            raise ValueError(f"start={start} must be in [1, len(token_ids)={len(ids)})")
        if len(ids) >= self.cfg.max_model_len:
            raise ValueError(f"len(token_ids)={len(ids)} must be below rollout.max_model_len={self.cfg.max_model_len}")
        params = SamplingParams(
            temperature=1.0, top_p=1.0, top_k=-1, max_tokens=1, prompt_logprobs=0, detokenize=False
        )
        (out,) = self._llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        steps = out.prompt_logprobs
        return [float(steps[t][ids[t]].logprob) for t in range(start, len(ids))]

    # ------------------------------------------------------------------ weight sync

    def update_weights(self, buckets: Iterable[Any], version: int) -> float:
        """Load new weights in place, reset the prefix cache and set the weight version.

        Args:
            buckets: items that are ``dict[str, torch.Tensor]`` (Hugging Face parameter names, full tensors;
                transformers' fused expert tensors are accepted and split) or Ray ObjectRefs to such dicts.
                Together they must hold every tensor of the checkpoint.
            version: the new weight version (reported in every later ``Completion``).

        Returns:
            seconds taken (wall clock), fetching the buckets included.

        Raises:
            ValueError: names that are not in the model's checkpoint, or checkpoint tensors missing from the
                buckets (nothing is loaded then).
            TypeError: a bucket that is neither a dict nor an ObjectRef to one.
        """
        t0 = time.perf_counter()
        resolved = [to_checkpoint_format(_resolve_bucket(b), self._checkpoint_names) for b in buckets]
        self._check_names(resolved)
        try:
            for bucket in resolved:
                if self._tied_embeddings:
                    bucket = {k: v for k, v in bucket.items() if k != "lm_head.weight"}
                self._llm.collective_rpc("rollout_stage_weights", args=(self._encode(bucket),))
            self._llm.collective_rpc("rollout_commit_weights")
        except BaseException:
            self._llm.collective_rpc("rollout_discard_staged")
            raise
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self._version = int(version)
        return time.perf_counter() - t0

    def _check_names(self, buckets: list[dict[str, torch.Tensor]]) -> None:
        given: set[str] = set()
        for bucket in buckets:
            dup = given.intersection(bucket)
            if dup:
                raise ValueError(f"weight buckets repeat tensors: {sorted(dup)[:5]}")
            given.update(bucket)
        expected = self._checkpoint_names
        if expected is None:
            return
        optional = {"lm_head.weight"} if self._tied_embeddings else set()
        unknown = given - expected - optional
        missing = expected - given
        if unknown or missing:
            raise ValueError(
                f"weight update for {self.model_path!r} does not match its checkpoint: "
                f"{len(unknown)} unknown names {sorted(unknown)[:5]}, {len(missing)} missing {sorted(missing)[:5]}"
            )

    def _encode(self, bucket: dict[str, torch.Tensor]) -> bytes | dict[str, torch.Tensor]:
        if self.cfg.in_process:
            return bucket
        from safetensors.torch import save as save_safetensors

        # clone: split expert views share storage, which safetensors refuses
        blob = {k: v.detach().cpu().clone(memory_format=torch.contiguous_format) for k, v in bucket.items()}
        return save_safetensors(blob)

    # ------------------------------------------------------------------ bookkeeping

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
