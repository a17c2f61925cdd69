"""The LLM judge tests' shared pieces: a judge config for the embedded tiny model (digits as its yes/no tokens:
its tokenizer has one token per character) and a batch of right and wrong arithmetic answers."""

from __future__ import annotations

from reward.config import JudgeCombine, JudgeConfig
from reward.contracts import RewardRequest
from rollout.contracts import PromptRow

POSITIVE, NEGATIVE = ["5", "6", "7", "8", "9"], ["0", "1", "2", "3", "4"]
TEMPLATE = "{prompt}{answer} vs {response} {meta[hint]}:"


def tiny_judge_config(model_path: str, **overrides) -> JudgeConfig:
    """A token-probability judge on the tiny model (small KV cache and context), combined with weight 0.5."""
    kwargs = dict(model_path=str(model_path), template=TEMPLATE, positive_tokens=POSITIVE, negative_tokens=NEGATIVE,
                  max_model_len=128, kv_cache_gb=0.05, timeout_s=120, combine=JudgeCombine(weight=0.5))
    return JudgeConfig(**{**kwargs, **overrides})


def judge_requests() -> list[RewardRequest]:
    """Eight requests: four sums, each answered right (even index) and one off (odd index)."""
    out = []
    for a, b in [(3, 4), (12, 30), (7, 8), (25, 25)]:
        row = PromptRow(uid=f"t/{a}+{b}", prompt=f"{a}+{b}=", prompt_token_ids=[1], answer=str(a + b),
                        meta={"hint": "h"})
        for response in (str(a + b), str(a + b + 1)):
            out.append(RewardRequest(response=response, row=row))
    return out
