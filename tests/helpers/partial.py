"""Stand-ins for the partial-rollout unit tests: prompt rows, a scripted fleet that answers rounds, a reward pool
that marks everything correct, and a ``PartialCollector`` on the tiny config over them (no Ray, no vLLM)."""

from __future__ import annotations

from cluster.config import load_config
from cluster.data.prompts import PromptStream
from cluster.driver.partial_rollout import PartialCollector
from reward.contracts import RewardResult
from rollout.contracts import Completion, PromptRow
from tests.helpers import REPO_ROOT

TINY = REPO_ROOT / "configs" / "tiny_moe.yaml"


def row(uid: str = "r0", ids: tuple[int, ...] = (5, 6)) -> PromptRow:
    return PromptRow(uid=uid, prompt="p", prompt_token_ids=list(ids), answer="a")


class ScriptedFleet:
    """Stand-in for the engines in a unit test: prompt ``uid#k`` of group ``long/..`` answers 12 tokens in all,
    others 3; each call returns at most ``max_tokens`` of what is left (finish 'length' when cut)."""

    def __init__(self):
        self.version = 0
        self.calls: list[int] = []

    def generate_stream(self, rows, n, *, seed, max_tokens, pieces_per_engine):
        self.calls.append(len(rows))
        out = []
        for r in rows:
            want = (12 if r.uid.startswith("long") else 3) - (len(r.prompt_token_ids) - 1)
            k = min(want, max_tokens)
            out.append(Completion(r.uid, 0, r.prompt_token_ids, [1] * k, [-1.0] * k, "1" * k,
                                  "length" if k < want else "stop", self.version))
        yield 0, out

    def take_settled(self) -> dict[str, float]:
        """No sync is left pending here (``EngineFleet.take_settled``)."""
        return {}


class AllCorrect:
    def score(self, reqs):
        return [RewardResult(score=1.0, correct=True) for _ in reqs]

    def metrics(self):
        return {}


def collector(*extra: str, fleet=None) -> tuple[PartialCollector, "ScriptedFleet"]:
    cfg = load_config(TINY, ["trainer.partial_rollouts=true", "trainer.prompts_per_step=4", "trainer.group_size=2",
                             "rollout.max_response_tokens=12", "rollout.max_model_len=40",
                             "trainer.partial_segment_tokens=4", "learner.world_size=1", "learner.num_minibatches=1",
                             "learner.micro_batch_size=8", *extra])
    rows = [row(("long" if i % 4 == 0 else "short") + f"/{i}", (9,)) for i in range(64)]
    fleet = fleet or ScriptedFleet()
    return PartialCollector(cfg, PromptStream(rows, seed=0), fleet, AllCorrect(), lambda: fleet.version), fleet
