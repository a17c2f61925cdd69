"""The rollout engine's sampling of whole completions: groups of completions with their behaviour log-probs
(``generate``), greedy completions for evaluation (``generate_greedy``) and the log-probs of given sequences
(``sequences_logprobs``, the distillation teacher's call). A part of ``rollout.engine.RolloutEngine``.
"""

from __future__ import annotations

from typing import Any

from rollout.contracts import Completion, PromptRow
from rollout.engine_base import EngineBase


class Sampling(EngineBase):
    """``RolloutEngine``'s calls that sample whole completions of prompts (and score given sequences)."""

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
