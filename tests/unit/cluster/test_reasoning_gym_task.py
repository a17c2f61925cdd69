"""reasoning-gym tasks (``data.task: reasoning_gym``, cluster/data/reasoning_gym_task.py): the config section's
checks at load, the rows (seeded, held-out questions disjoint from the training ones, over-long prompts skipped),
and the shipped SmolLM2 config."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cluster.config import ConfigError, load_config
from cluster.data.prompts import DataError
from cluster.data.reasoning_gym_task import (
    ANSWER_INSTRUCTION,
    EVAL_SEED_OFFSET,
    FINAL_INSTRUCTION,
    VERIFIER,
    known_datasets,
    reasoning_gym_rows,
)
from cluster.data.tasks import load_rows
from cluster.models.tiny_model import CHARACTERS, build_char_tokenizer
from reward.verifiers import get_verifier
from tests.helpers import REPO_ROOT

TASK = ["data.task=reasoning_gym"]
SMALL = {"basic_arithmetic": {"min_terms": 2, "max_terms": 2, "max_digits": 2, "operators": ["+", "-"],
                              "allow_parentheses": False, "allow_negation": False},
         "chain_sum": {"min_terms": 2, "max_terms": 3, "max_digits": 1}}


def tok(text: str) -> list[int]:
    return [ord(ch) for ch in text]


def rg_section(datasets=None, config=None, size=200, seed=3, answer_format="tag"):
    return SimpleNamespace(datasets=datasets or {"basic_arithmetic": 1.0, "chain_sum": 1.0},
                           config=SMALL if config is None else config, size=size, seed=seed,
                           answer_format=answer_format)


def test_the_section_loads_and_an_unknown_name_is_refused_with_the_known_ones():
    cfg = load_config(None, TASK + ["data.reasoning_gym.datasets={basic_arithmetic: 2, chain_sum: 1}",
                                    "data.reasoning_gym.config={chain_sum: {max_terms: 3}}"])
    assert cfg.data.reasoning_gym.datasets == {"basic_arithmetic": 2.0, "chain_sum": 1.0}
    assert cfg.data.reasoning_gym.config == {"chain_sum": {"max_terms": 3}}
    with pytest.raises(ConfigError) as err:
        load_config(None, TASK + ["data.reasoning_gym.datasets={basic_arithmetic: 1, basic_arithmetik: 1}"])
    msg = str(err.value)
    assert "data.reasoning_gym.datasets" in msg and "'basic_arithmetik'" in msg
    assert "known datasets: ab, acre," in msg and "basic_arithmetic, " in msg and "zebra_puzzles" in msg
    assert "composite" not in known_datasets() and {"basic_arithmetic", "chain_sum", "gcd"} <= set(known_datasets())


@pytest.mark.parametrize("overrides, needle", [
    (TASK, "data.task='reasoning_gym' needs data.reasoning_gym.datasets"),
    (["data.reasoning_gym.datasets={gcd: 1}"], "is set but data.task='arithmetic'"),
    (TASK + ["data.reasoning_gym.datasets={gcd: 0}"], "data.reasoning_gym.datasets.gcd=0.0 must be a finite weight"),
    (TASK + ["data.reasoning_gym.datasets={gcd: .nan}"], "data.reasoning_gym.datasets.gcd=nan"),
    (TASK + ["data.reasoning_gym.datasets={gcd: 1}", "data.reasoning_gym.config={gcd: {bogus: 1}}"],
     "data.reasoning_gym.config.gcd={'bogus': 1} is refused by reasoning-gym's GCDConfig"),
    (TASK + ["data.reasoning_gym.datasets={chain_sum: 1}", "data.reasoning_gym.config={chain_sum: {min_terms: 4, "
             "max_terms: 2}}"], "max_terms must be >= min_terms"),
    (TASK + ["data.reasoning_gym.datasets={gcd: 1}", "data.reasoning_gym.config={gcd: {seed: 5}}"],
     "['seed'] are set by data.reasoning_gym.size and .seed"),
    (TASK + ["data.reasoning_gym.datasets={gcd: 1}", "data.reasoning_gym.config={lcm: {}}"],
     "data.reasoning_gym.config.lcm: 'lcm' is not in data.reasoning_gym.datasets (gcd)"),
    (TASK + ["data.reasoning_gym.datasets={gcd: 1}", "data.reasoning_gym.answer_format=boxed"], "answer_format"),
    (TASK + ["data.reasoning_gym.datasets={gcd: 1}", "data.reasoning_gym.size=0"], "size"),
])
def test_bad_sections_name_the_key_and_the_value(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert needle in str(err.value)


def test_rows_are_seeded_and_held_out_questions_are_never_training_ones():
    train, held = reasoning_gym_rows(tok, rg_section(), num_eval=64, prompt_template=None, max_prompt_tokens=512)
    assert len(train) == 200 and len(held) == 64
    questions = [r.meta["rg_entry"]["question"] for r in train]
    held_q = [r.meta["rg_entry"]["question"] for r in held]
    assert not set(questions) & set(held_q) and len(set(held_q)) == 64
    assert len(set(questions)) < len(questions)  # the small space repeats questions: the check above is not vacuous
    assert {r.meta["rg_dataset"] for r in train} == {"basic_arithmetic", "chain_sum"}
    assert len({r.uid for r in train + held}) == len(train) + len(held)
    for r in train + held:
        entry = r.meta["rg_entry"]
        assert r.verifier == VERIFIER and r.answer == entry["answer"] and r.prompt_token_ids == tok(r.prompt)
        assert r.prompt == entry["question"].rstrip() + "\n" + ANSWER_INSTRUCTION
        assert entry["metadata"]["source_dataset"] == r.meta["rg_dataset"] and r.meta["answer_format"] == "tag"
        assert r.meta["rg_config"] == SMALL[r.meta["rg_dataset"]]
    assert all(r.meta["solution"] == f"<answer>{r.answer}</answer>" for r in train)
    assert not any("solution" in r.meta for r in held)
    again = reasoning_gym_rows(tok, rg_section(), num_eval=64, prompt_template=None, max_prompt_tokens=512)
    assert again == (train, held)
    other, _ = reasoning_gym_rows(tok, rg_section(seed=4), num_eval=8, prompt_template=None, max_prompt_tokens=512)
    assert [r.prompt for r in other] != [r.prompt for r in train]
    assert callable(get_verifier(VERIFIER))  # the rows' verifier resolves (module:function)
    assert EVAL_SEED_OFFSET > 10**9


def test_weights_mix_the_datasets():
    rg = rg_section(datasets={"basic_arithmetic": 3.0, "chain_sum": 1.0}, size=400)
    train, _ = reasoning_gym_rows(tok, rg, num_eval=4, prompt_template=None, max_prompt_tokens=512)
    share = sum(r.meta["rg_dataset"] == "basic_arithmetic" for r in train) / len(train)
    assert 0.68 < share < 0.82  # 3:1 drawn


def test_a_question_space_smaller_than_the_training_rows_leaves_no_held_out_row():
    one_digit_sums = {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}}  # 100 questions at most
    rg = rg_section(datasets={"chain_sum": 1.0}, config=one_digit_sums, size=3000)
    with pytest.raises(DataError, match="held-out questions drawn are training questions"):
        reasoning_gym_rows(tok, rg, num_eval=16, prompt_template=None, max_prompt_tokens=512)


def test_templates_raw_answers_and_over_long_prompts():
    rg = rg_section(answer_format="raw", size=50)
    train, held = reasoning_gym_rows(tok, rg, num_eval=10, prompt_template="Q: {question}\nA:", max_prompt_tokens=512)
    assert all(r.prompt == f"Q: {r.meta['rg_entry']['question']}\nA:" for r in train + held)
    assert all(r.meta["solution"] == r.answer and r.meta["answer_format"] == "raw" for r in train)
    final, _ = reasoning_gym_rows(tok, rg_section(answer_format="final", size=5), num_eval=2, prompt_template=None,
                                  max_prompt_tokens=512)
    assert all(r.prompt == r.meta["rg_entry"]["question"].rstrip() + "\n" + FINAL_INSTRUCTION for r in final)
    assert all(r.meta["solution"] == f"The answer is {r.answer}." for r in final)
    raw, _ = reasoning_gym_rows(tok, rg, num_eval=10, prompt_template=None, max_prompt_tokens=512)
    assert all(r.prompt == r.meta["rg_entry"]["question"] for r in raw)  # raw, no template: the question alone
    limit = 60  # "Calculate 12 + 3." fits; chain_sum's longer wording does not
    short, _ = reasoning_gym_rows(tok, rg, num_eval=10, prompt_template=None, max_prompt_tokens=limit)
    assert short and all(len(r.prompt_token_ids) <= limit for r in short) and len(short) < 50
    assert {r.meta["rg_dataset"] for r in short} == {"basic_arithmetic"}
    with pytest.raises(DataError, match=r"no usable row .*over data.max_prompt_tokens=5"):
        reasoning_gym_rows(tok, rg, num_eval=10, prompt_template=None, max_prompt_tokens=5)
    with pytest.raises(DataError, match=r"fills in only \{question\}"):
        reasoning_gym_rows(tok, rg, num_eval=10, prompt_template="{prompt}", max_prompt_tokens=512)


def test_the_tiny_models_tokenizer_reads_a_short_answer_mix_through_load_rows():
    """The embedded model's character tokenizer takes the short arithmetic datasets with raw answers: every
    character of every prompt and demonstration is in its vocabulary (docs/usage.md)."""
    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe.yaml", TASK + [
        "data.reasoning_gym.datasets={basic_arithmetic: 1, chain_sum: 1}",
        "data.reasoning_gym.config={basic_arithmetic: {max_terms: 2, max_digits: 2, allow_parentheses: false}, "
        "chain_sum: {max_terms: 2, max_digits: 2}}",
        "data.reasoning_gym.answer_format=raw", "data.reasoning_gym.size=300", "data.num_eval=32",
        "data.max_prompt_tokens=100", "rollout.max_response_tokens=8", "rollout.max_model_len=128",
        "trainer.length_buckets=4"])
    train, held = load_rows(cfg, build_char_tokenizer())
    assert len(train) == 300 and len(held) == 32
    text = "".join(r.prompt + r.meta["solution"] for r in train) + "".join(r.prompt for r in held)
    assert set(text) <= set(CHARACTERS)
    assert max(len(r.meta["solution"]) for r in train) <= 6  # within rollout.max_response_tokens, with the EOS


def test_the_shipped_smollm2_config_loads():
    cfg = load_config(REPO_ROOT / "configs" / "smollm2_reasoning_gym.yaml")
    assert cfg.data.task == "reasoning_gym" and 2 <= len(cfg.data.reasoning_gym.datasets) <= 3
    assert cfg.model.path == "models/smollm2-135m-instruct"
