"""Verifiers as plain functions: exact, math (on real GSM8K rows), format, user verifiers, code extraction,
and the DAPO overlong penalty against hand-computed values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

REPO = REPO_ROOT


SHARED = Path(os.environ.get("GSPO_SHARED_DIR", REPO.parent / "shared"))


GSM8K_TEST = SHARED / "data" / "gsm8k" / "test.jsonl"


needs_gsm8k = pytest.mark.skipif(not GSM8K_TEST.exists(), reason=f"needs GSM8K at {GSM8K_TEST} (GSPO_SHARED_DIR)")


def gsm8k_rows(n: int) -> list[dict]:
    """The first ``n`` GSM8K test rows as PromptRow dicts (reference = text after ####)."""
    rows = []
    with open(GSM8K_TEST, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i >= n:
                break
            raw = json.loads(line)
            ref = raw["answer"].rsplit("####", 1)[1].strip()
            rows.append({"uid": f"gsm8k-test-{i}", "prompt": raw["question"], "prompt_token_ids": [],
                         "answer": ref, "verifier": "math", "meta": {"solution": raw["answer"]}})
    return rows


def right_and_wrong_forms(ref: str) -> tuple[list[str], list[str]]:
    """Responses that state ``ref`` in several right forms, and several wrong ones."""
    v = int(ref.replace(",", ""))
    right = [f"#### {v}", f"Adding up, we get {v}.\n#### {v}", f"So the total is \\boxed{{{v}}}.",
             f"The answer is {v}.", f"The answer is ${v}", f"#### {v}.0", f"#### \\frac{{{2 * v}}}{{2}}"]
    wrong = [f"#### {v + 1}", f"The answer is {v - 3}.", "I don't know.", f"\\boxed{{{v * 10 + 7}}}", ""]
    return right, wrong


def _user_verifier(response: str, row: dict) -> dict:
    return {"score": 0.5, "note": "user"}
