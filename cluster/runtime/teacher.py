"""On-policy distillation's teacher as Ray actors (``distill``; the signal is ``learner/distill.py``, its wiring
``cluster/driver/distill.py``).

``TeacherFleet`` is a ``cluster.runtime.model_fleet.ModelFleet`` of ``distill.num_engines``
``rollout.engine.RolloutEngine`` actors on the teacher model, never synced: one batched ``sequences_logprobs`` call
per engine (contiguous shares of the step's samples) gives the teacher's log-prob of every response token the
student sampled, given the same prompt and the tokens before it. A share whose engine raised, died or passed
``distill.timeout_s`` comes back as a ``CallFailure`` (the driver makes those samples invalid) and the engine is
replaced, as the LLM judge's.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from cluster.config_sections import DistillConfig
from cluster.runtime.model_fleet import CallFailure, ModelFleet
from rollout.contracts import Completion

log = logging.getLogger(__name__)


class TeacherFleet(ModelFleet):
    """The teacher's engines (see the module docstring).

    Args:
        dc: the ``distill`` section (``enabled``, ``max_model_len`` resolved by the config).
        model_path: the teacher's folder (``cluster.models.resolve.ensure_model`` of ``dc.model_path``).
        cache_dir: where each engine's vLLM caches go (``<cache_dir>/teacher<i>``).
        placement_timeout_s: ``cluster.placement_timeout_s``.
        wait: wait until the engines have loaded (False: ``wait_ready`` later; ``ModelFleet``).
        run_deadlines: the run's ``deadlines`` section (``ModelFleet``); None: the defaults.
    """

    def __init__(self, dc: DistillConfig, model_path: str, cache_dir: Path, placement_timeout_s: float = 120.0,
                 wait: bool = True, run_deadlines: Any = None):
        from rollout.engine import RolloutEngine

        super().__init__(dc, model_path, cache_dir, placement_timeout_s, engine_cls=RolloutEngine, role="teacher",
                         max_tokens=1, wait=wait, run_deadlines=run_deadlines)

    def logprobs(self, completions: list[Completion]) -> list[list[float] | CallFailure]:
        """Per completion, in order, the teacher's log-prob (nats, temperature 1) of each response token (``[]``
        for an empty response), or the ``CallFailure`` of its engine's share: the samples with response tokens go
        to the engines as ``(prompt + response, len(prompt))``, one batched call per engine."""
        todo = [i for i, c in enumerate(completions) if c.response_token_ids]
        calls = self.dispatch("sequences_logprobs", [
            (list(completions[i].prompt_token_ids) + list(completions[i].response_token_ids),
             len(completions[i].prompt_token_ids)) for i in todo])
        out: list[Any] = [[] for _ in completions]
        for i, got in zip(todo, calls.wait()):
            out[i] = got
        return out


def start_teacher(cfg: Any, student_tokenizer: Any, run_dir: Path, wait: bool = True) -> TeacherFleet:
    """The teacher of ``cfg.distill``: its model resolved (``model.path`` forms, a builtin built into
    ``<run_dir>/teacher_model``), its tokenizer compared with the student's loaded one (the config compared them
    at load where it could read both; a hub id is known here), and its engines started (loaded unless ``wait`` is
    False: then ``TeacherFleet.wait_ready``).

    Raises:
        ValueError: another tokenizer than the student's (names both paths and the first difference).
        FileNotFoundError: no such teacher folder (names ``distill.model_path``); or what starting an engine raises.
    """
    from transformers import AutoTokenizer

    from cluster.models.resolve import ensure_model
    from cluster.models.tokenizer_match import check_same_tokenizer, loaded_identity

    dc = cfg.distill
    try:
        path = ensure_model(dc.model_path, run_dir / "teacher_model", seed=dc.build_seed)
    except FileNotFoundError as err:  # its message names model.path: say which model it was
        raise FileNotFoundError(f"distill.model_path={dc.model_path!r} (the teacher): {err} "
                                "(configs/tiny_distill.yaml's teacher is written by `make train`)") from None
    check_same_tokenizer(loaded_identity(student_tokenizer), loaded_identity(AutoTokenizer.from_pretrained(str(path))),
                         cfg.model.path, dc.model_path)
    fleet = TeacherFleet(dc, str(path), run_dir / "cache", cfg.cluster.placement_timeout_s, wait=wait,
                         run_deadlines=cfg.deadlines)
    log.info("distillation teacher: %d engine(s) of %s, kl_coef %g, reward_weight %g", dc.num_engines,
             dc.model_path, dc.kl_coef, dc.reward_weight)
    return fleet
