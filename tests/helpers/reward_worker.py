"""The protected runner and the reward worker: timeouts kill whole process groups, failures become
statuses (0 or NaN, never an exception), composite rewards, overlong shaping, truncation masking, and real
rows (GSM8K answers in right and wrong forms; small code tasks with correct, wrong, hanging and hostile
solutions)."""

from __future__ import annotations

from rollout.contracts import PromptRow


def row_of(answer: str, verifier: str = "exact", **meta) -> PromptRow:
    return PromptRow(uid=f"u-{answer}-{verifier}", prompt="p", prompt_token_ids=[1, 2], answer=answer,
                     verifier=verifier, meta=meta)
