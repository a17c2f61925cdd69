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
checkpoint's tensor names are decided in ``rollout/vllm_setup.py``.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rollout.config import RolloutConfig
from rollout.contracts import BucketLoad, Completion, PromptRow, SampledTurn, TurnRequest
from rollout.routing_capture import RoutingStore
from rollout.vllm_setup import _short_tmp, checkpoint_weight_names, eos_token_ids, llm_kwargs, runner_environment


class RolloutEngine:
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
        self._check_no_open_turns("generate")
        if self._syncing:
            raise RuntimeError("engine is between weight versions (a weight sync did not finish): no sampling")
        if not prompts:
            return []
        outputs = self._llm.generate(self._prompt_inputs(prompts), params, use_tqdm=False)
        if self._routing_layers:
            self._take_routing()
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
                        routed_experts=self._sequence_routing(row, token_ids) if self._routing_layers else None,
                    )
                )
        return completions

    def _take_routing(self) -> None:
        self._routing.add(self._llm.collective_rpc("rollout_take_routing")[0])

    def routing_stats(self) -> dict[str, int]:
        """Routing capture since the last weight sync: ``filled_positions`` (positions served from the prefix
        cache whose experts came from the request that computed them) and ``unresolved`` (records with no such
        request; a completion among them fails with an error). Zeros when capture is off."""
        return {"filled_positions": self._routing.filled_positions, "unresolved": self._routing.unresolved}

    def _sequence_routing(self, row: PromptRow, token_ids: list[int]) -> Any:
        try:
            return self._routing.get(list(row.prompt_token_ids) + token_ids)
        except KeyError as e:
            raise RuntimeError(f"prompt uid={row.uid!r}: rollout.return_routed_experts=true but the engine recorded "
                               f"no complete routing for this completion ({e.args[0]})") from None

    def generate(
        self,
        prompts: list[PromptRow],
        n: int,
        *,
        temperature: float | None = None,
        max_tokens: int | None = None,
        seed: int | None = None,
        prompt_offset: int = 0,
    ) -> list[Completion]:
        """Sample ``n`` completions per prompt (a group), with the sampled tokens' post-temperature log-probs.

        ``SamplingParams(n=n, temperature, top_p=1, top_k=-1, logprobs=0, stop_token_ids=<every EOS id of the
        model>)``: unbiased sampling from
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
            prompt_offset: index of ``prompts[0]`` in a larger call this one is a piece of (``i`` above counts
                from it), so a call cut into pieces samples exactly what the whole call would.

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
                stop_token_ids=self.stop_token_ids,
                seed=None if seed is None else self._request_seed(int(seed), prompt_offset + i, n),
            )
            for i in range(len(prompts))
        ]
        return self._sample(prompts, params, n)

    def sample_turns(self, requests: list[TurnRequest], temperature: float | None = None) -> list[SampledTurn]:
        """Sample one assistant turn of each episode in ``requests``, continuing its exact token ids, as one batch
        that runs to its end (``advance_turns`` is the continuous-batching form the agent loop uses).

        ``SamplingParams(n=1, temperature, top_p=1, top_k=-1, logprobs=0, stop_token_ids=<every EOS id>,
        stop=request.stop, include_stop_str_in_output=True)``: the same post-temperature log-probs as
        ``generate``. The context goes in as token ids (never as text), so the ids trained on stay the ids sampled.
        Episodes that share a prefix (a group's prompt, an episode's earlier turns) reuse it from vLLM's prefix
        cache.

        Returns:
            One ``SampledTurn`` per request, in order, with this engine's current ``weight_version``.

        Raises:
            ValueError: temperature < 0 (0 samples greedy turns, for evaluation; their log-probs are those of
                the unscaled logits), a request with max_tokens < 1 or an empty context, or a context plus
                max_tokens past ``rollout.max_model_len``.
            RuntimeError: a weight sync is under way, turns of ``advance_turns`` are still open, or routing
                capture is on (an episode's routing per turn is not recorded).
        """
        self._check_no_open_turns("sample_turns")
        inputs, params = self._turn_inputs(requests, temperature)
        outputs = self._llm.generate(inputs, params, use_tqdm=False) if requests else []
        if self._routing_layers and requests:
            self._take_routing()
        return [self._turn(r, out.outputs[0]) for r, out in zip(requests, outputs, strict=True)]

    def advance_turns(self, requests: list[TurnRequest], temperature: float | None = None,
                      slice_s: float = 0.05) -> tuple[list[SampledTurn], float]:
        """Continuous batching of episodes' turns: add ``requests`` to the turns already open on this engine, run
        vLLM's scheduler steps (``LLMEngine.step``) until at least one open turn has ended or ``slice_s`` seconds
        have passed, and return the turns that ended. The caller keeps one call in flight per engine and adds
        each episode's next turn as soon as its tool has answered, so the engine samples while tools run and a
        new turn joins the running batch at the next call, not after the whole batch. Sampling parameters,
        validation and log-probs are ``sample_turns``'s.

        Args:
            requests: turns to open (possibly none: then only the open ones advance).
            temperature: None = ``rollout.temperature``; 0 = greedy.
            slice_s: seconds after which the call returns even though no turn ended (>= 0).

        Returns:
            ``(turns, busy_s)``: the turns that ended (in the order they ended) and the seconds spent in
            scheduler steps (the engine's busy time).

        Raises:
            ValueError, RuntimeError: as ``sample_turns`` (nothing is added when a request is refused); a
                request whose ``episode_id`` already has an open turn.
        """
        inputs, params = self._turn_inputs(requests, temperature)
        for r in requests:
            if r.episode_id in self._open_turns:
                raise ValueError(f"episode {r.episode_id}: a turn of it is already open on this engine")
        engine = self._llm.llm_engine
        for r, prompt, p in zip(requests, inputs, params):
            self._open_turns[r.episode_id] = (r, engine.add_request(r.episode_id, prompt, p))
        ended, busy, t0 = [], 0.0, time.perf_counter()
        while self._open_turns and not ended:
            t = time.perf_counter()
            ended += [out for out in engine.step() if out.finished]
            busy += time.perf_counter() - t
            if time.perf_counter() - t0 > slice_s:
                break
        done = [self._open_turns.pop(out.request_id) for out in ended]
        if self._routing_layers and done:  # each ended turn's routing, the running turns' kept for later
            self._routing.add(self._llm.collective_rpc("rollout_take_routing", args=([rid for _, rid in done],))[0])
        return [self._turn(r, out.outputs[0]) for (r, _), out in zip(done, ended)], busy

    def abort_turns(self) -> int:
        """Abort every open turn of ``advance_turns`` (the caller gave up on its episodes); returns how many."""
        ids = list(self._open_turns)
        if ids:
            self._llm.llm_engine.abort_request(ids)
            if self._routing_layers:  # their partial routings: dropped
                self._llm.collective_rpc("rollout_take_routing", args=([rid for _, rid in self._open_turns.values()],))
            self._open_turns.clear()
        return len(ids)

    def _check_no_open_turns(self, what: str) -> None:
        if self._open_turns:
            raise RuntimeError(f"{what}: {len(self._open_turns)} turns of advance_turns are still open on this "
                               f"engine (finish them or abort_turns first)")

    def _turn_inputs(self, requests: list[TurnRequest], temperature: float | None) -> tuple[list[Any], list[Any]]:
        """vLLM's token prompts and sampling parameters of ``requests`` (``sample_turns``), after its checks."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._syncing:
            raise RuntimeError("engine is between weight versions (a weight sync did not finish): no sampling")
        temperature = self.cfg.temperature if temperature is None else float(temperature)
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy turns, for evaluation)")
        limit = self.cfg.max_model_len
        for r in requests:
            if r.max_tokens < 1 or not r.context_ids or len(r.context_ids) + r.max_tokens > limit:
                raise ValueError(f"episode {r.episode_id}: {len(r.context_ids)} context tokens and max_tokens="
                                 f"{r.max_tokens} must be >= 1 each and fit rollout.max_model_len={limit}")
        params = [SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=-1, max_tokens=r.max_tokens,
                                 logprobs=0, stop_token_ids=self.stop_token_ids, stop=list(r.stop) or None,
                                 include_stop_str_in_output=True, seed=r.seed) for r in requests]
        return [TokensPrompt(prompt_token_ids=list(r.context_ids)) for r in requests], params

    def _turn(self, request: TurnRequest, sample: Any) -> SampledTurn:
        token_ids = list(sample.token_ids)
        if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
            raise RuntimeError(f"episode {request.episode_id}: vLLM returned no log-prob for some sampled tokens")
        return SampledTurn(
            episode_id=request.episode_id, token_ids=token_ids,
            logprobs=[float(step[tok].logprob) for tok, step in zip(token_ids, sample.logprobs, strict=True)],
            text=sample.text, finish_reason="length" if sample.finish_reason == "length" else "stop",
            stop_reason=sample.stop_reason, weight_version=self._version,
            routed_experts=self._turn_routing(request, token_ids) if self._routing_layers else None)

    def _turn_routing(self, request: TurnRequest, token_ids: list[int]) -> Any:
        """The engine routing of an episode up to this turn: int16 ``[C + T - 1, layers, k]`` for the context's
        ``C`` and the turn's ``T`` ids; the positions of earlier turns and replies come from the forwards that
        computed their KV (the prefix cache's donors, ``RoutingStore``), so each sampled token keeps its own
        turn's experts."""
        try:
            return self._routing.get(list(request.context_ids) + token_ids)
        except KeyError as e:
            raise RuntimeError(f"episode {request.episode_id}: rollout.return_routed_experts=true but the engine "
                               f"recorded no complete routing for this turn ({e.args[0]})") from None

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
        params = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens, logprobs=0,
                                stop_token_ids=self.stop_token_ids)
        return self._sample(prompts, [params] * len(prompts), 1)  # with routing capture: carries routes too

    def sequence_logprobs(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (temperature 1, nats) of ``token_ids[start:]``, ``len(token_ids) - start`` floats: the
        ``sequences_logprobs`` of one sequence (the same errors)."""
        return self.sequences_logprobs([(token_ids, start)])[0]

    def sequences_logprobs(self, requests: list[tuple[list[int], int]]) -> list[list[float]]:
        """Log-probs (temperature 1: ``log softmax(logits)``, nats) of ``ids[start:]`` for each ``(ids, start)`` of
        ``requests``, each token given all tokens before it, in one ``generate`` call (vLLM batches the prefills).

        Uses vLLM's prompt log-probs of each whole sequence (``prompt_logprobs=0``: the log-prob of the token that is
        there; one token is generated after it and dropped; prompt-logprob requests do not read the prefix cache).
        On-policy distillation's teacher scores the student's samples with it (``cluster/runtime/teacher.py``).

        Args:
            requests: per sequence, its token ids (prompt + response, fewer than ``max_model_len``) and the first
                position scored, in ``[1, len(ids))``.

        Returns:
            per sequence, ``len(ids) - start`` floats.

        Raises:
            ValueError: a ``start`` outside ``[1, len(ids))`` or a sequence of at least ``max_model_len`` tokens
                (names its index).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        seqs = [([int(t) for t in ids], int(start)) for ids, start in requests]
        for i, (ids, start) in enumerate(seqs):
            if not 1 <= start < len(ids):
                raise ValueError(f"sequence {i}: start={start} must be in [1, len(token_ids)={len(ids)})")
            if len(ids) >= self.cfg.max_model_len:
                raise ValueError(f"sequence {i}: len(token_ids)={len(ids)} must be below max_model_len="
                                 f"{self.cfg.max_model_len}")
        if not seqs:
            return []
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=-1, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self._llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in seqs], params, use_tqdm=False)
        if self._routing_layers:
            self._take_routing()  # its KV may serve later requests from the prefix cache: a donor
        return [[float(out.prompt_logprobs[t][ids[t]].logprob) for t in range(start, len(ids))]
                for (ids, start), out in zip(seqs, outs)]

    # ------------------------------------------------------------------ weight sync

    def start_weight_update(self) -> None:
        """Open a weight-sync session (vLLM's ``start_weight_update``): sampling is refused until
        ``finish_weight_update`` succeeds.

        Raises:
            RuntimeError: turns of ``advance_turns`` are still open (they would mix two weight versions).
        """
        self._check_no_open_turns("start_weight_update")
        self._syncing = True
        if self._routing_layers:
            self._llm.collective_rpc("rollout_take_routing")  # records of an interrupted call: old weights
        self._routing.clear()
        self._llm.start_weight_update()

    def transfer_world_size(self) -> int:
        """Processes of this engine that join a collective transfer group (its tensor-parallel workers)."""
        return int(self.cfg.tensor_parallel_size)

    def init_weight_transfer_group(self, info: Mapping[str, Any]) -> None:
        """Join (or, with ``{}``, leave) a collective transfer group: every worker of this engine takes rank
        ``info["rank_offset"] + its tensor-parallel rank`` (``rollout.weight_sync.ObjectRefInitInfo``). Blocks
        until the whole group has joined.

        Raises:
            RuntimeError: the rendezvous failed or timed out.
        """
        self._llm.init_weight_transfer_engine({"init_info": dict(info)})

    def update_weights(self, meta: Mapping[str, Any], buffers: list[Any] | None) -> BucketLoad:
        """Load one bucket of checkpoint-format tensors (layer-wise: a layer is processed once complete).

        Args:
            meta: ``{"names": [...], "dtype_names": [...], "shapes": [...]}`` and optionally ``"bucket"``: the
                bucket's index in this session, after which a repeat of that index is skipped; with ``buffers``
                None also ``"offsets"`` (each tensor's byte offset) and ``"flat_bytes"`` (see
                ``rollout.weight_sync.ObjectRefUpdateInfo``); names as in the model folder's checkpoint.
            buffers: one uint8 numpy array per tensor (Ray resolves the bucket's object ref into them, zero-copy),
                or None: the bytes come by rank 0's broadcast over the transfer group
                (``init_weight_transfer_group``).

        Returns:
            a ``BucketLoad``: the seconds taken; or, when the collective receive failed before any tensor of the
            bucket was loaded, the error's text (the session stays open, so the same bucket may come again
            through the object store).

        Raises:
            RuntimeError: no session is open.
            ValueError: names not in the model's checkpoint, or a buffer that does not match its metadata.
        """
        t0 = time.perf_counter()
        if not self._syncing:
            raise RuntimeError("update_weights called outside a weight-sync session (start_weight_update first)")
        unknown = set(meta["names"]) - self._known_names()
        if self._checkpoint_names is not None and unknown:
            self._close_session()
            fused = [n for n in unknown if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
            hint = (" (transformers' in-memory names sent in place of fused experts' checkpoint names: convert with "
                    "learner.weight_sync.to_checkpoint_format)") if fused else ""
            raise ValueError(f"weight bucket for {self.model_path!r} holds names not in its checkpoint: "
                             f"{sorted(unknown)[:5]}{hint}")
        collective = buffers is None
        if collective:
            info = {**meta, "buffers": [], "collective": True}
        else:
            if not self.cfg.in_process:  # msgpack to the engine core keeps bytes, not arrays
                buffers = [bytes(memoryview(b)) for b in buffers]
            info = {**meta, "buffers": list(buffers)}
        try:
            self._llm.update_weights({"update_info": info})
            aborted = [a for a in self._llm.collective_rpc("rollout_take_transfer_abort") if a] if collective else []
        except BaseException:
            self._close_session()
            raise
        if aborted:
            return BucketLoad(error=f"receive failed: {aborted[0]}")
        return BucketLoad(seconds=time.perf_counter() - t0)

    def finish_weight_update(self, version: int) -> int:
        """Close the session: finalize the layer-wise reload, check that every checkpoint tensor arrived,
        reset the prefix cache and take ``version``. Returns the number of tensors loaded.

        Raises:
            ValueError: checkpoint tensors missing from the session (the engine stays refused for sampling).
            RuntimeError: vLLM refused to reset the prefix cache.
        """
        self._llm.finish_weight_update()
        received = set(self._llm.collective_rpc("rollout_received_names")[0])
        missing = self._known_names() - received - ({"lm_head.weight"} if self._tied_embeddings else set())
        if self._checkpoint_names is not None and missing:
            raise ValueError(f"weight sync for {self.model_path!r} left {len(missing)} checkpoint tensors unloaded: "
                             f"{sorted(missing)[:5]}")
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset the prefix cache after a weight update")
        self._routing.clear()  # no later request can hit KV (or routings) of the old weights
        self._version = int(version)
        self._syncing = False
        return len(received)

    def load_state_dict(self, state: Mapping[str, torch.Tensor], version: int, bucket_tensors: int = 16) -> float:
        """Load checkpoint-format ``state`` through the same session calls, in buckets of ``bucket_tensors``
        tensors (for tests and tools; the learner streams its own buckets). Returns seconds taken."""
        t0 = time.perf_counter()
        names = list(state)
        self.start_weight_update()
        for i in range(0, len(names), bucket_tensors):
            chunk = [(n, state[n].detach().contiguous()) for n in names[i : i + bucket_tensors]]
            meta = {"names": [n for n, _ in chunk], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in chunk],
                    "shapes": [list(t.shape) for _, t in chunk]}
            self.update_weights(meta, [t.reshape(-1).view(torch.uint8).numpy() for _, t in chunk])
        self.finish_weight_update(version)
        return time.perf_counter() - t0

    def _close_session(self) -> None:
        """End a session that failed half-way (vLLM has no abort): the engine keeps refusing to sample until a
        whole sync succeeds."""
        try:
            self._llm.finish_weight_update()
        except Exception:  # noqa: BLE001 - the session may already be closed by vLLM after its own error
            pass

    def _known_names(self) -> set[str]:
        names = set(self._checkpoint_names or ())
        return (names | {"lm_head.weight"}) if self._tied_embeddings else names

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
