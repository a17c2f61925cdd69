"""A judge engine: the rollout engine's vLLM ``LLM`` answering judge prompts greedily, in one batched call.

``JudgeEngine`` is ``rollout.engine.RolloutEngine`` (the same environment, ``LLM(...)`` arguments and shutdown,
``rollout/vllm_setup.py``) with one more call, ``judge``; the driver runs each in its own Ray actor
(``cluster/runtime/judge.py``) for ``reward.judge`` (``reward/llm_judge.py`` builds the prompts and parses the
answers). Its weights are never synced: the judge is a fixed model.
"""

from __future__ import annotations

from typing import Any

from rollout.engine import RolloutEngine


class JudgeEngine(RolloutEngine):
    """A ``RolloutEngine`` (same arguments) that answers judge prompts: see ``judge``."""

    def judge(self, prompts: list[list[int]], max_tokens: int, top_logprobs: int = 0,
              seed: int | None = None) -> list[tuple[str, dict[int, float]]]:
        """Greedy answers to ``prompts`` in one ``generate`` call (vLLM batches them).

        ``SamplingParams(temperature=0, max_tokens, logprobs=top_logprobs, stop_token_ids=<every EOS id>,
        seed)``: the answer is the arg-max continuation; with ``top_logprobs > 0`` the first generated position's
        top log-probs come back (natural log, of the unscaled logits: greedy decoding has no temperature).

        Args:
            prompts: token ids of each judge prompt (non-empty, shorter than ``max_model_len - max_tokens``).
            max_tokens: answer token limit, >= 1.
            top_logprobs: how many top log-probs of the first position to return (0 = none; at most vLLM's
                ``max_logprobs``, 20).
            seed: the requests' sampler seed (greedy answers do not depend on it; kept for reproducible engines).

        Returns:
            one ``(answer text, {token id: log-prob})`` per prompt, in order (the dict empty when
            ``top_logprobs`` is 0 or nothing was generated).

        Raises:
            ValueError: max_tokens < 1, top_logprobs outside [0, 20], an empty prompt or one too long for
                ``max_model_len``.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        if not 0 <= top_logprobs <= 20:
            raise ValueError(f"top_logprobs={top_logprobs} must be in [0, 20]")
        limit = self.cfg.max_model_len
        for i, ids in enumerate(prompts):
            if not ids or len(ids) + max_tokens > limit:
                raise ValueError(f"judge prompt {i}: {len(ids)} tokens + max_tokens={max_tokens} must be >= 1 and "
                                 f"fit max_model_len={limit}")
        if not prompts:
            return []
        params = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=-1, max_tokens=int(max_tokens),
                                logprobs=int(top_logprobs) or None, stop_token_ids=self.stop_token_ids, seed=seed)
        outputs = self._llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompts],
                                     params, use_tqdm=False)
        return [self._answer(out.outputs[0], top_logprobs) for out in outputs]

    @staticmethod
    def _answer(sample: Any, top_logprobs: int) -> tuple[str, dict[int, float]]:
        first: dict[int, float] = {}
        if top_logprobs and sample.logprobs:
            first = {int(tok): float(lp.logprob) for tok, lp in sample.logprobs[0].items()}
        return sample.text, first
