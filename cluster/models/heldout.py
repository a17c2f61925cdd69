"""Held-out accuracy of a model folder on a run config's task, with transformers alone (no Ray, vLLM or DeepSpeed).

``gspo-upcycle --eval N`` uses it to report, for the sigma it built, what the upcycled model and its dense parent
score on the first ``N`` held-out prompts of a training config's task (by default ``configs/smollm2_arith.yaml``,
the task the upcycled model trains on): the rows are made by the run's own data code (``cluster.data.tasks``, the
config's prompt template and chat template, encoded with the model's tokenizer) and scored by the row's own
verifier (``reward.verifiers``), so the figure is the one a run's step-0 evaluation would report under greedy
decoding, up to the engine's kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

DEFAULT_EVAL_CONFIG = Path("configs/smollm2_arith.yaml")


def heldout_rows(config: str | Path, model_path: str | Path, n: int) -> tuple[list[Any], int, Any]:
    """The first ``n`` held-out ``PromptRow`` of ``config``'s task, encoded for ``model_path``'s tokenizer, with
    the config's response length (``rollout.max_response_tokens``) and the tokenizer.

    Raises:
        ValueError: ``n`` < 1.
        cluster.config.ConfigError: the config does not load, or its task has no held-out row.
    """
    from cluster.config import ConfigError, load_config
    from cluster.data.tasks import load_rows, load_tokenizer

    if n < 1:
        raise ValueError(f"--eval={n} must be >= 1 (0 skips the evaluation)")
    cfg = load_config(config, [f"model.path={model_path}"])
    tokenizer = load_tokenizer(str(model_path))
    _, held_out = load_rows(cfg, tokenizer)
    if not held_out:
        raise ConfigError(f"{config}: data gives no held-out row")
    return held_out[:n], cfg.rollout.max_response_tokens, tokenizer


def heldout_accuracy(model: Any, tokenizer: Any, rows: list[Any], max_new_tokens: int,
                     batch_size: int = 16) -> float:
    """Mean verifier score of ``model``'s greedy responses to ``rows`` (float in [0, 1] for 0/1 verifiers).

    Args:
        model: a transformers causal LM in eval mode (float32 or bf16 weights).
        tokenizer: its tokenizer (its pad token, or EOS as the pad, left-pads each batch).
        rows: ``PromptRow`` values (``prompt_token_ids``, ``verifier``, ``answer``).
        max_new_tokens: response length limit, tokens.
        batch_size: prompts per ``generate`` call.

    Raises:
        ValueError: ``rows`` is empty.
    """
    import torch

    from reward.verifiers import as_row_dict, get_verifier

    if not rows:
        raise ValueError("no rows to evaluate")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total = 0.0
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.tensor([[pad] * (width - len(r.prompt_token_ids)) + list(r.prompt_token_ids) for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=pad)
        for row, seq in zip(batch, out[:, width:].tolist()):
            text = tokenizer.decode(seq, skip_special_tokens=True)
            score = get_verifier(row.verifier)(text, as_row_dict(row))
            total += float(score["score"] if isinstance(score, dict) else score)
    return total / len(rows)
