"""The LLM judge's engines as Ray actors, and the reward pool with the judge beside the verifiers
(``reward.judge``; the prompts, parsing and combination are ``reward/llm_judge.py``).

``JudgeFleet`` is a ``cluster.runtime.model_fleet.ModelFleet`` of ``reward.judge.num_engines``
``rollout.judge_engine.JudgeEngine`` actors, one placement group each (``reward.judge.num_cpus_per_engine`` CPUs
plus ``reward.judge.node_resources``), and answers a list of samples with one batched ``judge`` call per engine
(contiguous shares), each bounded by ``reward.judge.timeout_s``. An engine that times out or dies gives its share
NaN judgements (status ``timeout`` / ``error``) and is replaced; one that raises gives them status ``error``.
Either way the judge failed, not the model: those samples are marked ``judge_failed`` (``reward.infra``) and
scored by ``reward.on_infra_failure`` (invalid by default).
Nothing here raises for a bad sample or a failing judge.

``JudgedRewards`` wraps ``reward.pool.RewardPool`` with the pool's surface (``score``, ``metrics``, ``resize``,
``num_workers``): with ``combine.mode=weighted`` the judge's calls go out before the verifiers run and are
collected after them (both work at once); with ``gate`` the judge is asked only about the samples the primary
verifier passed.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from cluster.runtime.model_fleet import CallFailure, ModelFleet, PendingCalls
from reward.config import JudgeConfig
from reward.contracts import RewardRequest, RewardResult
from reward.infra import DETAIL_KEY, Cause
from reward.llm_judge import Judgement, combine, judgement, prompt_ids, render, single_token_ids

log = logging.getLogger(__name__)


class JudgeFleet(ModelFleet):
    """The judge's engines (see the module docstring).

    Args:
        jc: the ``reward.judge`` section (``enabled``).
        model_path: the judge model's folder (``cluster.models.resolve.ensure_model`` of ``jc.model_path``).
        cache_dir: where each engine's vLLM caches go (``<cache_dir>/judge<i>``).
        placement_timeout_s: ``cluster.placement_timeout_s``.
        run_deadlines: the run's ``deadlines`` section (``ModelFleet``); None: the defaults.

    Raises:
        ValueError: a positive or negative token that is not one token of the judge's tokenizer.
    """

    def __init__(self, jc: JudgeConfig, model_path: str, cache_dir: Path, placement_timeout_s: float = 120.0,
                 run_deadlines: Any = None):
        from transformers import AutoTokenizer

        from rollout.judge_engine import JudgeEngine

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        token_probs = jc.score == "token_probs"
        self.positive = single_token_ids(self.tokenizer, jc.positive_tokens, "reward.judge.positive_tokens") \
            if token_probs else []
        self.negative = single_token_ids(self.tokenizer, jc.negative_tokens, "reward.judge.negative_tokens") \
            if token_probs else []
        self.max_tokens = 1 if token_probs else jc.max_tokens
        super().__init__(jc, model_path, cache_dir, placement_timeout_s, engine_cls=JudgeEngine, role="judge",
                         max_tokens=jc.max_tokens, seed=jc.seed, run_deadlines=run_deadlines)

    @property
    def jc(self) -> JudgeConfig:
        """The ``reward.judge`` section (the fleet's ``settings``)."""
        return self.settings  # type: ignore[return-value]

    def prompts(self, requests: list[RewardRequest]) -> list[list[int] | Judgement]:
        """Each request's judge prompt ids, or an ``error`` ``Judgement`` where it cannot be built (a missing
        meta field, a prompt too long for ``reward.judge.max_model_len``)."""
        jc, out = self.jc, []
        for req in requests:
            try:
                ids = prompt_ids(self.tokenizer, render(jc.template, req.row, req.response),
                                 system_prompt=jc.system_prompt, chat=jc.apply_chat_template)
                if len(ids) + self.max_tokens > jc.max_model_len:
                    raise ValueError(f"judge prompt of {len(ids)} tokens + {self.max_tokens} answer tokens exceeds "
                                     f"reward.judge.max_model_len={jc.max_model_len}")
                out.append(ids)
            except Exception as err:  # noqa: BLE001 - a prompt that cannot be built is that sample's NaN
                out.append(Judgement(math.nan, "error", detail={"error": "JudgePrompt", "message": str(err)[:300]}))
        return out

    def submit(self, requests: list[RewardRequest]) -> "PendingJudgements":
        """Send ``requests`` to the engines (contiguous shares, one ``judge`` call each); collect with
        ``PendingJudgements.wait``."""
        built = self.prompts(requests)
        todo = [i for i, p in enumerate(built) if not isinstance(p, Judgement)]
        calls = self.dispatch("judge", [built[i] for i in todo], self.max_tokens,
                              self.jc.top_logprobs if self.positive else 0, self.jc.seed)
        return PendingJudgements(self, built, todo, calls)

    def judge(self, requests: list[RewardRequest]) -> list[Judgement]:
        """One ``Judgement`` per request, in order (``submit`` then ``wait``)."""
        return self.submit(requests).wait()


class PendingJudgements:
    """Judge calls under way (``JudgeFleet.submit``): ``wait`` gathers them within ``reward.judge.timeout_s`` of
    their start."""

    def __init__(self, fleet: JudgeFleet, built: list[list[int] | Judgement], todo: list[int], calls: PendingCalls):
        self.fleet, self.built, self.todo, self.calls = fleet, built, todo, calls

    def wait(self) -> list[Judgement]:
        """One ``Judgement`` per request: parsed answers; NaN with status ``timeout`` for the shares of engines
        past the deadline and ``error`` for engines that raised or died (those that timed out or died are
        replaced: ``cluster.runtime.model_fleet.PendingCalls.wait``)."""
        fleet, out = self.fleet, list(self.built)
        for i, answer in zip(self.todo, self.calls.wait()):
            if isinstance(answer, CallFailure):  # the judge's engine failed: the service's failure, not the model's
                out[i] = Judgement(math.nan, answer.status, detail={"error": answer.error, "message": answer.message,
                                                                    DETAIL_KEY: Cause.JUDGE_FAILED.value})
            else:
                text, top = answer
                out[i] = judgement(text, top, fleet.jc, fleet.positive, fleet.negative)
        return out  # type: ignore[return-value]


class JudgedRewards:
    """``reward.pool.RewardPool`` with the judge's score joined to each verdict (``reward.llm_judge.combine``).

    ``verifiers`` is the pool itself (evaluation scores with it alone: held-out accuracy is the verifier's).
    ``metrics`` adds the samples the judge made invalid to the pool's ``reward/invalid``, and
    ``reward/judge_mean`` (mean valid judge score), ``reward/judge_failed`` (judgements that were NaN),
    ``reward/judge_timeouts``, ``reward/judge_unparsed``, ``reward/judge_asked`` and ``reward/judge_time_s`` (wall
    seconds waiting for the judge after the verifiers) to the pool's.
    """

    def __init__(self, pool: Any, judge: JudgeFleet, on_infra_failure: str = "invalid"):
        self.verifiers = pool
        self.judge = judge
        self.on_infra_failure = on_infra_failure  # reward.on_infra_failure: a failed engine's samples
        self._counters: dict[str, float] = {}
        self._scores: list[float] = []

    @property
    def num_workers(self) -> int:
        """The pool's reward workers."""
        return self.verifiers.num_workers

    def resize(self, n: int) -> None:
        """Resize the verifier pool (``RewardPool.resize``); the judge engines stay."""
        self.verifiers.resize(n)

    def worker_pids(self) -> list[int]:
        """The pool's worker pids."""
        return self.verifiers.worker_pids()

    def score(self, requests: list[RewardRequest]) -> list[RewardResult]:
        """The verifiers' results with the judge's score combined (``reward.judge.combine``), in request order.
        Failed judgements make NaN rewards (counted and logged), never an exception."""
        combo = self.judge.jc.combine
        if combo.mode == "weighted":
            pending = self.judge.submit(requests)
            results = self.verifiers.score(requests)
        else:
            results = self.verifiers.score(requests)
            asked = [i for i, r in enumerate(results) if r.correct]
            pending = self.judge.submit([requests[i] for i in asked])
        t = time.monotonic()
        got = pending.wait()
        self._count("reward/judge_time_s", time.monotonic() - t)
        judged = got if combo.mode == "weighted" else [Judgement(math.nan, "skipped") for _ in requests]
        if combo.mode == "gate":
            for i, j in zip(asked, got):
                judged[i] = j
        self._count("reward/judge_asked", float(len(got)))
        failed = [j for j in got if not math.isfinite(j.score)]
        for key, status in (("reward/judge_timeouts", "timeout"), ("reward/judge_unparsed", "unparsed")):
            self._count(key, float(sum(j.status == status for j in failed)))
        self._count("reward/judge_failed", float(len(failed)))
        self._scores += [j.score for j in got if math.isfinite(j.score)]
        if failed:
            first = failed[0]
            log.warning("LLM judge: %d of %d judgements failed (NaN rewards; e.g. status %s, %s)", len(failed),
                        len(got), first.status, first.detail or repr(first.answer))
        combined = [combine(r, j, combo.mode, combo.weight, self.on_infra_failure) for r, j in zip(results, judged)]
        self._count("reward/invalid", float(sum(not c.valid for c in combined) - sum(not r.valid for r in results)))
        return combined

    def _count(self, key: str, value: float) -> None:
        self._counters[key] = self._counters.get(key, 0.0) + value

    def metrics(self) -> dict[str, float]:
        """The pool's counters and the judge's since the last call (then reset); ``reward/invalid`` counts every
        NaN reward, the verifiers' and the judge's."""
        out = dict(self.verifiers.metrics())
        for key, value in self._counters.items():
            out[key] = out.get(key, 0.0) + value
        if self._scores:
            out["reward/judge_mean"] = sum(self._scores) / len(self._scores)
        self._counters, self._scores = {}, []
        return out

    def shutdown(self) -> None:
        """Stop the verifier workers and the judge engines."""
        self.verifiers.shutdown()
        self.judge.shutdown()


def start_judged(cfg: Any, pool: Any, run_dir: Path) -> JudgedRewards:
    """``pool`` (the run's ``RewardPool``) with the judge of ``cfg.reward.judge`` beside it: the judge model
    resolved (``model.path`` forms, a builtin built into ``<run_dir>/judge_model``) and its engines started.
    A judge that cannot start stops the run (its error propagates), after ``pool`` was shut down."""
    from cluster.models.resolve import ensure_model

    jc = cfg.reward.judge
    try:
        path = ensure_model(jc.model_path, run_dir / "judge_model", seed=jc.build_seed)
        fleet = JudgeFleet(jc, str(path), run_dir / "cache", cfg.cluster.placement_timeout_s, run_deadlines=cfg.deadlines)
    except BaseException:
        pool.shutdown()
        raise
    log.info("LLM judge: %d engine(s) of %s, score %s, combine %s (weight %g)", jc.num_engines, jc.model_path,
             jc.score, jc.combine.mode, jc.combine.weight)
    return JudgedRewards(pool, fleet, cfg.reward.on_infra_failure)
