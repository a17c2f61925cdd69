"""The token check (``agent/token_mismatch``, docs/agents.md "The token check"): what the engines conditioned on
and sampled, against what the learner ranks trained, two records made apart.

- The engines: per episode turn, ``(episode_id, branch, context_len, sampled_len, digest)`` of the prompt vLLM ran
  and the ids it sampled (``rollout.token_records``), drained once per step (``RolloutEngine.take_token_records``)
  into this object's pool.
- The learner ranks: per trained turn (a run of the response mask in a micro-batch as it was trained),
  ``(context_len, sampled_len, digest)`` of the ids before it and its ids (``learner.token_digests``,
  ``LearnerGroup.trained_turns``).

Per step, ``compare`` takes the batch's episodes (by id and the branch that trains, from their verdicts) and counts
``agent/token_mismatch`` = trained turns whose key none of those episodes' engine records has, plus engine turns of
those episodes that were not trained (multisets: a key counts as often as it occurs). Samples that legitimately do
not train are left out by id, not by loosening the comparison: episodes not in the batch (evaluation, groups dropped
by dynamic sampling, partial rollouts still under way, restarted attempts) are simply not compared; their records
wait in the pool (partial rollouts train later) and are forgotten after ``keep_drains`` drains; the branches of a
forked agent episode other than the one that trains are dropped with the episode. The pool travels in checkpoints,
so a rollout collected before a resume is checked after it.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any, Iterable

import ray

log = logging.getLogger("cluster.train")

Key = tuple[int, int, str]  # (context_len, sampled_len, digest)


class TokenCheck:
    """The engines' turn records waiting for their episode's batch, and the comparison (module docstring).

    Args:
        keep_drains: drains an episode's records wait for it to train before they are forgotten (> the steps an
            episode may stay under way, ``trainer.max_staleness`` + 1 with partial rollouts).
    """

    def __init__(self, keep_drains: int = 16):
        self.keep_drains = int(keep_drains)
        self.pool: dict[str, dict[int, list[Key]]] = {}  # episode id -> branch -> its turns' keys
        self.seen: dict[str, int] = {}  # episode id -> the drain that last brought a record of it
        self.drains = 0
        self.lost = 0  # records engines dropped for room, or held by an engine that could not be drained

    def add(self, records: Iterable[tuple[str, int, int, int, str]]) -> None:
        """Put engine records ``(episode_id, branch, context_len, sampled_len, digest)`` into the pool."""
        for episode_id, branch, n_context, n_sampled, digest in records:
            self.pool.setdefault(episode_id, {}).setdefault(int(branch), []).append(
                (int(n_context), int(n_sampled), str(digest)))
            self.seen[episode_id] = self.drains

    def drain(self, engines: list[Any], timeout_s: float = 60.0) -> None:
        """Take every engine's records (``take_token_records``) into the pool; an engine that fails to answer is
        logged and counted in ``lost`` (its records are gone with it)."""
        self.drains += 1
        refs = [engine.take_token_records.remote() for engine in engines]
        for i, ref in enumerate(refs):
            try:
                records, lost = ray.get(ref, timeout=timeout_s)
            except Exception as e:  # noqa: BLE001 - a dead engine: the step goes on, the check says so
                log.warning("token check: engine %d gave no records (%s: %s)", i, type(e).__name__, e)
                self.lost += 1
                continue
            self.lost += int(lost)
            self.add(records)
        stale = [k for k, at in self.seen.items() if self.drains - at > self.keep_drains]
        for k in stale:
            self.pool.pop(k, None)
            self.seen.pop(k, None)

    def compare(self, trained: list[Key], episodes: list[tuple[str, int]], checked: bool = True) -> dict[str, float]:
        """Compare a step's trained turns with the engine records of its episodes; those episodes leave the pool.

        Args:
            trained: every rank's ``(context_len, sampled_len, digest)`` per trained turn (``LearnerGroup.
                trained_turns``).
            episodes: ``(episode_id, branch)`` of each row of the step's batch (the branch that trains).
            checked: False when the learner trained nothing to compare (the health guard refused the step): the
                episodes leave the pool and only ``agent/token_checked`` 0 is returned.

        Returns:
            ``agent/token_mismatch`` (``agent/token_unsampled`` + ``agent/token_untrained``: trained turns no
            engine produced for these episodes, engine turns of these episodes not trained), ``agent/token_turns``
            (turns trained), ``agent/token_records_lost`` (records lost since the last compare: a nonzero value
            explains a mismatch) and ``agent/token_checked`` (1.0).
        """
        produced: Counter = Counter()
        for episode_id, branch in episodes:
            produced.update(self.pool.get(episode_id, {}).get(int(branch), []))
        for episode_id, _ in episodes:
            self.pool.pop(episode_id, None)
            self.seen.pop(episode_id, None)
        if not checked:
            return {"agent/token_checked": 0.0}
        got = Counter(trained)
        unsampled, untrained = sum((got - produced).values()), sum((produced - got).values())
        lost, self.lost = self.lost, 0
        if unsampled or untrained:
            log.warning("token check: %d trained turns the engines never sampled, %d sampled turns not trained (of "
                        "%d trained; %d records lost)", unsampled, untrained, len(trained), lost)
        return {"agent/token_mismatch": float(unsampled + untrained), "agent/token_unsampled": float(unsampled),
                "agent/token_untrained": float(untrained), "agent/token_turns": float(len(trained)),
                "agent/token_records_lost": float(lost), "agent/token_checked": 1.0}

    def state(self) -> dict[str, Any]:
        """The pool as plain values, for a checkpoint (``from_state`` reads it back)."""
        return {"pool": self.pool, "seen": self.seen, "drains": self.drains, "keep_drains": self.keep_drains}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> "TokenCheck":
        """A check with ``state``'s pool (``state``), or an empty one for None."""
        check = cls()
        if state:
            check.keep_drains, check.drains = int(state["keep_drains"]), int(state["drains"])
            check.pool, check.seen = dict(state["pool"]), dict(state["seen"])
        return check
