"""A run's model tokenizer and its prompts: the one dispatch from ``data.task`` to the task's rows.

``arithmetic`` (``cluster.data.prompts``), ``code`` (``cluster.data.code_task``), ``reasoning_gym``
(``cluster.data.reasoning_gym_task``) and ``files`` / ``gsm8k`` (``cluster.data.files``); every task's prompts
are encoded by one ``cluster.data.prompting.PromptEncoder``.
"""

from __future__ import annotations

from cluster.config import Config, ConfigError
from cluster.data import prompts as data
from cluster.data.agent_calc import agent_calc_rows
from cluster.data.agent_guess import agent_guess_rows
from cluster.data.code_task import code_rows
from cluster.data.files import file_rows
from cluster.data.long_tail import long_tail_rows
from cluster.data.prompting import PromptEncoder, PromptError
from cluster.data.reasoning_gym_task import reasoning_gym_rows
from rollout.contracts import PromptRow


def load_tokenizer(model_path: str):
    """The model folder's tokenizer.

    Raises:
        ConfigError: the tokenizer has no EOS token.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    if tok.eos_token_id is None:
        raise ConfigError(f"model.path={model_path!r}: the tokenizer has no eos token")
    return tok


def load_rows(cfg: Config, tokenizer) -> tuple[list[PromptRow], list[PromptRow]]:
    """Training and held-out rows for ``cfg.data``; every task's prompts are encoded by one
    ``cluster.data.prompting.PromptEncoder`` (``data.apply_chat_template``, ``data.system_prompt``, the BOS rule).

    Raises:
        ConfigError: ``data.apply_chat_template=true`` with a tokenizer that has no chat template.
        data.DataError: a missing file or field, or a split with no usable row.
    """
    d = cfg.data
    try:
        # with env set the rows stay raw text: the agent loop renders an episode's first messages with the tools
        encoder = PromptEncoder(tokenizer, False if cfg.env.enabled else d.apply_chat_template, d.system_prompt)
    except PromptError as e:
        raise ConfigError(f"{e} (model.path={cfg.model.path!r})") from None
    if d.task == "arithmetic":
        train, held_out = data.arithmetic_rows(
            encoder.ids, max_operand=d.max_operand, num_train=d.num_train, num_eval=d.num_eval, seed=d.seed,
            demo_slip_rate=d.demo_slip_rate,
        )
        if d.long_tail_fraction:  # a share of answers ~long_tail_repeat times longer (cluster.data.long_tail)
            train, held_out = (long_tail_rows(rows, encoder.ids, fraction=d.long_tail_fraction, repeat=d.long_tail_repeat,
                                              seed=d.seed + k) for k, rows in ((2, train), (3, held_out)))
        return train, held_out
    if d.task == "agent_calc":
        return agent_calc_rows(encoder.ids, num_terms=d.num_terms, num_train=d.num_train, num_eval=d.num_eval,
                               seed=d.seed, demo_slip_rate=d.demo_slip_rate, prompt_template=d.prompt_template,
                               tool_format=cfg.env.tool_format)
    if d.task == "agent_guess":
        return agent_guess_rows(encoder.ids, high=d.guess_high, num_train=d.num_train, num_eval=d.num_eval,
                                seed=d.seed, demo_slip_rate=d.demo_slip_rate, guess_bonus=d.guess_bonus)
    if d.task == "code":
        return code_rows(encoder.ids, num_train=d.num_train, num_eval=d.num_eval, seed=d.seed,
                         demo_slip_rate=d.demo_slip_rate, max_prompt_tokens=d.max_prompt_tokens)
    if d.task == "reasoning_gym":
        return reasoning_gym_rows(encoder.ids, d.reasoning_gym, num_eval=d.num_eval, prompt_template=d.prompt_template,
                                  max_prompt_tokens=d.max_prompt_tokens)
    return file_rows(d, encoder.encode)
