"""Resume checks (issue 15): a checkpoint's world size, seed, data (fingerprint of the training rows), model and
algorithm are compared with the resuming run's config before any actor starts. A mismatch that would not
continue the same run is refused with an error naming every key and both values; resources, logging and
schedule length are free to change, with a log line. Fake saved states; the trainer wiring is exercised for
real in tests/integration/test_faults_resume.py."""

from __future__ import annotations

import json
import logging
import re
import shutil
import typing
from collections.abc import Mapping

import pytest
from pydantic import BaseModel

from cluster.config import Config, ConfigError, load_config
from cluster.data.files import gsm8k_rows
from cluster.data.prompts import arithmetic_rows
from cluster.driver.checkpoint import (
    RESUME_FREE,
    RESUME_RL_ONLY,
    ResumeMismatch,
    _flatten,
    _matches,
    check_resume,
    data_fingerprint,
    mapping_fields,
    read_learner_state,
)
from tests.helpers import REPO_ROOT

TINY = REPO_ROOT / "configs" / "tiny_moe_zero2.yaml"


def _chars(text: str) -> list[int]:
    return [ord(c) for c in text]


def _rows(cfg: Config):
    d = cfg.data
    return arithmetic_rows(_chars, max_operand=d.max_operand, num_train=d.num_train, num_eval=d.num_eval,
                           seed=d.seed, demo_slip_rate=d.demo_slip_rate)[0]


def _saved(overrides=(), step=2):
    """The driver state ``Trainer.save`` writes for a run of tiny_moe_zero2.yaml with ``overrides``."""
    cfg = load_config(TINY, list(overrides))
    return {"step": step, "weight_version": step, "warm_start_done": True, "stream_position": 64, "sft_rng": [],
            "config": cfg.model_dump(mode="json"), "data_fingerprint": data_fingerprint(_rows(cfg))}


def _check(saved, overrides=(), learner_state=None):
    cfg = load_config(TINY, ["trainer.resume=true", *overrides])
    return check_resume(saved, cfg, data_fingerprint(_rows(cfg)), learner_state)


def test_same_config_resumes_and_the_resume_flag_itself_is_free():
    notes = _check(_saved(), learner_state={"world_size": 2, "zero_stage": 2, "optimizer_steps": 8})
    assert notes == ["trainer.resume: False -> True (free to change on resume)"]


def test_another_world_size_is_refused_from_the_learners_own_state():
    """learner_state.json is what the ranks wrote: it is read even when the saved config would agree."""
    saved = _saved(["learner.world_size=1"])
    with pytest.raises(ResumeMismatch) as err:
        _check(saved, ["learner.world_size=1"], learner_state={"world_size": 2, "zero_stage": 2})
    msg = str(err.value)
    assert "learner.world_size: checkpoint 2 (learner_state.json), config 1" in msg
    with pytest.raises(ResumeMismatch, match="learner.world_size: checkpoint 2, config 1"):
        _check(_saved(), ["learner.world_size=1"])  # no learner state: the saved config's value
    with pytest.raises(ResumeMismatch, match="learner.zero_stage: checkpoint 2 .*config 3"):
        _check(_saved(), ["learner.zero_stage=3"], learner_state={"world_size": 2, "zero_stage": 2})


def test_another_seed_is_refused():
    with pytest.raises(ResumeMismatch) as err:
        _check(_saved(), ["trainer.seed=1"])
    assert "trainer.seed: checkpoint 0, config 1" in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_other_training_data_is_refused_naming_the_data_keys():
    with pytest.raises(ResumeMismatch) as err:
        _check(_saved(), ["data.num_train=8000"])
    msg = str(err.value)
    assert "data: checkpoint 9000 training rows" in msg and "config 8000 rows" in msg
    assert "data.num_train=8000 (checkpoint 9000)" in msg
    with pytest.raises(ResumeMismatch, match="data.seed=1 .checkpoint 1234."):
        _check(_saved(), ["data.seed=1"])


def test_data_fingerprint_follows_the_rows_not_the_files(tmp_path):
    """GSM8K: a copy of the file elsewhere has the same fingerprint (its path is free to change on resume);
    one edited answer, or another prompt limit that drops a row, changes it."""
    lines = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)]
    lines[3]["question"] = "A much longer question than the others, " * 3
    a = tmp_path / "a.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in lines))
    b = tmp_path / "moved" / "b.jsonl"
    b.parent.mkdir()
    shutil.copy(a, b)

    def fp(path, max_prompt_tokens=200):
        return data_fingerprint(gsm8k_rows(str(path), _chars, split="train", max_prompt_tokens=max_prompt_tokens,
                                           limit=None)[0])

    assert fp(a) == fp(b) and fp(a)["rows"] == 6
    assert fp(a, max_prompt_tokens=100)["rows"] == 5
    lines[4]["answer"] = "4 + 4 = 9\n#### 9"
    b.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert fp(b) != fp(a) and fp(b)["rows"] == 6  # same uids (line numbers), other content

    paths = [f"data.train_path={a}", f"data.test_path={a}", "data.task=gsm8k", "data.max_prompt_tokens=28"]
    cfg = load_config(TINY, paths)
    saved = {"step": 3, "config": cfg.model_dump(mode="json"), "data_fingerprint": fp(a)}
    moved = load_config(TINY, [*paths, f"data.train_path={b.parent / 'c.jsonl'}"])
    shutil.copy(a, b.parent / "c.jsonl")
    notes = check_resume(saved, moved, fp(b.parent / "c.jsonl"))
    assert any(n.startswith("data.train_path:") and "free to change" in n for n in notes)
    with pytest.raises(ResumeMismatch, match="the files changed"):
        check_resume(saved, cfg, fp(b))


def test_algorithm_is_refused_after_rl_steps_and_free_on_a_warm_start_checkpoint(caplog):
    dapo = ["learner.algorithm=grpo", "learner.clip_low=0.2", "learner.clip_high=0.28",
            "learner.loss_agg=token_mean", "trainer.dynamic_sampling=true"]
    with pytest.raises(ResumeMismatch) as err:
        _check(_saved(step=2), dapo)
    msg = str(err.value)
    for needle in ("learner.algorithm: checkpoint 'gspo', config 'grpo'",
                   "learner.clip_low: checkpoint 0.0003, config 0.2",  # the settings each loss uses
                   "learner.loss_agg: checkpoint 'seq_mean_token_mean', config 'token_mean'",
                   "trainer.dynamic_sampling: checkpoint False, config True", "step-2 checkpoint"):
        assert needle in msg
    with caplog.at_level(logging.INFO, logger="cluster.driver.checkpoint"):
        notes = _check(_saved(step=0), dapo)  # cluster/compare/runs.py: every algorithm resumes one warm start
    assert "learner.algorithm: 'gspo' -> 'grpo' (the checkpoint is from before the first RL step)" in notes
    assert "learner.algorithm: 'gspo' -> 'grpo'" in caplog.text
    with pytest.raises(ResumeMismatch, match="rollout.temperature: checkpoint 1.0, config 0.7"):
        _check(_saved(step=5), ["rollout.temperature=0.7"])
    with pytest.raises(ResumeMismatch, match="reward.overlong_buffer_len: checkpoint 0, config 2"):
        _check(_saved(step=5), ["reward.overlong_buffer_len=2"])


def test_engine_and_reward_worker_counts_are_free_with_a_log_line(caplog):
    free = ["rollout.num_engines=3", "reward.num_workers=4", "trainer.total_steps=200", "wandb.mode=disabled",
            "health.max_grad_norm=50", "warm_start.steps=0"]
    with caplog.at_level(logging.INFO, logger="cluster.driver.checkpoint"):
        notes = _check(_saved(step=7), free)
    assert "rollout.num_engines: 1 -> 3 (free to change on resume)" in notes
    assert "reward.num_workers: 1 -> 4 (free to change on resume)" in notes
    assert "resume: rollout.num_engines: 1 -> 3" in caplog.text and "resume: reward.num_workers: 1 -> 4" in caplog.text
    assert len([n for n in notes if "free to change" in n]) == len(free) + 1  # + trainer.resume


def test_every_refused_key_is_named_in_one_error():
    with pytest.raises(ResumeMismatch) as err:
        _check(_saved(), ["trainer.seed=3", "learner.lr=2e-4", "model.build_seed=1", "learner.micro_batch_size=16"],
               learner_state={"world_size": 2, "zero_stage": 2})
    msg = str(err.value)
    for needle in ("trainer.seed: checkpoint 0, config 3", "learner.lr: checkpoint 0.0001, config 0.0002",
                   "model.build_seed: checkpoint 0, config 1", "learner.micro_batch_size: checkpoint 32, config 16"):
        assert needle in msg


def test_older_checkpoints_compare_what_they_hold(caplog):
    """A state without a data fingerprint compares the data.* keys; one with an unset reward.max_response_tokens
    (before the config set it from the rollout's) matches the rollout's; keys one side lacks are logged."""
    saved = _saved()
    del saved["data_fingerprint"]
    saved["config"]["reward"]["max_response_tokens"] = None
    saved["config"]["trainer"]["retired_key"] = 1
    notes = _check(saved)
    assert "checkpoint has no data fingerprint: data compared by its data.* keys only" in notes
    assert "trainer.retired_key: only in the checkpoint, not compared" in notes
    with pytest.raises(ResumeMismatch, match="data.num_train: checkpoint 9000, config 8000"):
        _check(saved, ["data.num_train=8000"])


def test_optimizer_offload_is_refused_on_resume_also_from_checkpoints_older_than_the_key():
    """A checkpoint holds the state of the optimizer it was trained with (torch's AdamW or DeepSpeed's CPU Adam,
    which cannot load the other's state): learner.offload_optimizer may not change on resume; a checkpoint from
    before the key existed was written without offload."""
    with pytest.raises(ResumeMismatch, match="learner.offload_optimizer: checkpoint 'none', config 'cpu'"):
        _check(_saved(), ["learner.offload_optimizer=cpu"])
    older = _saved()
    del older["config"]["learner"]["offload_optimizer"]
    with pytest.raises(ResumeMismatch, match="learner.offload_optimizer: checkpoint 'none', config 'cpu'"):
        _check(older, ["learner.offload_optimizer=cpu"])
    assert _check(older) == ["trainer.resume: False -> True (free to change on resume)"]
    assert "learner.offload_optimizer" not in str(_check(_saved(["learner.offload_optimizer=cpu"]),
                                                         ["learner.offload_optimizer=cpu"]))


def test_where_verifiers_run_is_free_to_change_on_resume():
    """reward.isolated_verifiers and reward.inline_verifiers decide which process runs a call, not its score."""
    for saved in ("reward.isolated_verifiers=[]", "reward.inline_verifiers=[]"):
        assert not [m for m in _check(_saved([saved])) if "inline_verifiers" in m and "free" not in m]


def test_loss_options_are_compared_whole_and_placement_resources_are_free(caplog):
    """``learner.loss_options`` is one value: an option set on one side only is a change (refused after RL steps,
    free on a warm-start checkpoint), not a key one side lacks; the services' node_resources are placement."""
    sapo_default = "{'tau_pos': 1.0, 'tau_neg': 1.05}"
    with pytest.raises(ResumeMismatch, match=re.escape(f"learner.loss_options: checkpoint {sapo_default}, config "
                                                       "{'tau_pos': 1.0, 'tau_neg': 2.0}")):
        _check(_saved(["learner.algorithm=sapo"], step=3),
               ["learner.algorithm=sapo", "learner.loss_options.tau_neg=2.0"])
    with pytest.raises(ResumeMismatch, match="learner.loss_options: checkpoint .'tau_pos': 0.5, 'tau_neg': 1.05., "
                                             "config .'tau_pos': 0.7"):
        _check(_saved(["learner.algorithm=sapo", "learner.loss_options.tau_pos=0.5"], step=3),
               ["learner.algorithm=sapo", "learner.loss_options.tau_pos=0.7"])
    notes = _check(_saved(["learner.algorithm=sapo"], step=0), ["learner.algorithm=sapo",
                                                                 "learner.loss_options.tau_neg=2.0"])
    assert (f"learner.loss_options: {sapo_default} -> {{'tau_pos': 1.0, 'tau_neg': 2.0}} (the checkpoint is from "
            "before the first RL step)") in notes
    notes = _check(_saved(step=3), ["rollout.node_resources.gspo_node_1=1"])
    assert "rollout.node_resources: {} -> {'gspo_node_1': 1.0} (free to change on resume)" in notes
    assert not [n for n in notes if "only in the" in n]


def test_a_loss_setting_written_out_at_its_default_is_no_change():
    """A built-in loss's settings are compared as the loss uses them: ``tau_neg=1.05`` (SAPO's default) or GSPO's
    clip range and aggregation written out equal the same settings left null, after RL steps too."""
    _check(_saved(["learner.algorithm=sapo"], step=3), ["learner.algorithm=sapo", "learner.loss_options.tau_neg=1.05"])
    gspo = ["learner.clip_low=0.0003", "learner.clip_high=0.0004", "learner.loss_agg=seq_mean_token_mean"]
    assert _check(_saved(step=3), gspo) == ["trainer.resume: False -> True (free to change on resume)"]
    assert _check(_saved(gspo, step=3)) == ["trainer.resume: False -> True (free to change on resume)"]
    with pytest.raises(ResumeMismatch, match="learner.clip_high: checkpoint 0.0004, config 0.0005"):
        _check(_saved(step=3), ["learner.clip_high=0.0005"])


def test_mapping_fields_reads_dict_and_mapping_annotations():
    """``dict[...]``, ``typing.Dict``, ``Mapping[...]`` and their optional forms are mapping fields, found inside
    nested sections too; a plain value or a list is not."""

    class Inner(BaseModel):
        weights: Mapping[str, float] = {}
        names: list[str] = []

    class Outer(BaseModel):
        a: dict[str, int] = {}
        b: typing.Dict[str, int] | None = None  # noqa: UP006 (the old spelling is what is tested)
        c: typing.Optional[Mapping[str, int]] = None  # noqa: UP045
        d: int = 0
        inner: Inner = Inner()

    assert mapping_fields(Outer) == {"a", "b", "c", "inner.weights"}


def test_every_key_is_classified_once():
    """No key is listed both free and RL-only (free keys win over an RL-only section prefix: reward.num_workers
    is free, the rest of reward. is RL-only), and every pattern names a key (or section) of the schema."""
    keys = _flatten(Config().model_dump(mode="json"))
    assert not set(RESUME_FREE) & set(RESUME_RL_ONLY)
    assert {k for k in keys if k.startswith("reward.") and _matches(k, RESUME_FREE)} == {
        p for p in RESUME_FREE if p.startswith("reward.")}
    for pattern in RESUME_FREE + RESUME_RL_ONLY:
        assert any(_matches(k, (pattern,)) for k in keys), pattern


def test_learner_state_is_read_from_the_checkpoint(tmp_path):
    assert read_learner_state(tmp_path) is None
    (tmp_path / "learner").mkdir()
    (tmp_path / "learner" / "learner_state.json").write_text('{"world_size": 4, "zero_stage": 3}')
    assert read_learner_state(tmp_path) == {"world_size": 4, "zero_stage": 3}
