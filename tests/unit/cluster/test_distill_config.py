"""``distill`` in the run config: the losses it refuses, dynamic sampling without a reward, the teacher's context,
the tokenizer check at load (``cluster.models.tokenizer_match``: the builtin character tokenizer, a folder's
files, a loaded tokenizer), the relative teacher folder made absolute and the teacher's CPUs reserved."""

from __future__ import annotations

import json

import pytest

from cluster.config import ConfigError, absolute_paths, load_config
from cluster.models.tokenizer_match import builtin_identity, folder_identity, loaded_identity, mismatch
from cluster.runtime.services import resource_demand

ON = ["distill.model_path=builtin:tiny_moe", "learner.algorithm=gspo_token"]


def _char_folder(tmp_path, name="teacher"):
    """A model folder holding the builtin character tokenizer's files (as an exported run's learner/hf)."""
    from cluster.models.tiny_model import build_char_tokenizer

    folder = tmp_path / name
    build_char_tokenizer().save_pretrained(folder)
    return folder


def test_defaults_and_the_teacher_context():
    cfg = load_config("configs/tiny_moe.yaml", ON)
    d = cfg.distill
    assert d.enabled and d.kl_coef == 1.0 and d.reward_weight == 0.0
    assert d.max_model_len == cfg.rollout.max_model_len + 1  # a whole sample, then one generated token
    assert not load_config(None).distill.enabled
    with pytest.raises(ConfigError, match=r"distill.max_model_len=32 must be at least rollout.max_model_len \+ 1 = 33"):
        load_config("configs/tiny_moe.yaml", [*ON, "distill.max_model_len=32"])


@pytest.mark.parametrize("algorithm, hint", [("gspo", "use learner.algorithm=gspo_token"), ("ppo", "GAE")])
def test_sequence_level_and_critic_losses_are_refused_naming_the_choice(algorithm, hint):
    with pytest.raises(ConfigError, match=rf"refused with learner.algorithm='{algorithm}'.*{hint}"):
        load_config("configs/tiny_moe.yaml", ["distill.model_path=builtin:tiny_moe", f"learner.algorithm={algorithm}"])


@pytest.mark.parametrize("algorithm", ["gspo_token", "grpo", "dr_grpo", "cispo"])
def test_token_level_losses_are_accepted(algorithm):
    assert load_config("configs/tiny_moe.yaml", ["distill.model_path=builtin:tiny_moe",
                                                 f"learner.algorithm={algorithm}"]).distill.enabled


def test_dynamic_sampling_needs_a_reward_in_the_advantage():
    with pytest.raises(ConfigError, match="trainer.dynamic_sampling=true is refused with distill.reward_weight=0"):
        load_config("configs/tiny_moe.yaml", [*ON, "trainer.dynamic_sampling=true"])
    assert load_config("configs/tiny_moe.yaml", [*ON, "trainer.dynamic_sampling=true", "distill.reward_weight=0.5"])


@pytest.mark.parametrize("key, value", [("kl_coef", "0"), ("reward_weight", "-1"), ("node_resources", "{CPU: 1}")])
def test_bad_values_are_refused_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        load_config("configs/tiny_moe.yaml", [*ON, f"distill.{key}={value}"])


def test_a_folder_with_the_students_tokenizer_is_accepted(tmp_path):
    folder = _char_folder(tmp_path)
    cfg = load_config("configs/tiny_moe.yaml", ["distill.model_path=" + str(folder), "learner.algorithm=gspo_token"])
    assert cfg.distill.model_path == str(folder)
    assert folder_identity(folder) == builtin_identity()


def _edit(folder, tokenizer=None, config=None):
    if tokenizer is not None:
        data = json.loads((folder / "tokenizer.json").read_text())
        tokenizer(data)
        (folder / "tokenizer.json").write_text(json.dumps(data))
    if config is not None:
        data = json.loads((folder / "tokenizer_config.json").read_text())
        config(data)
        (folder / "tokenizer_config.json").write_text(json.dumps(data))


def _swap_digits(data):
    vocab = data["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]


def _add_token(data):
    data["model"]["vocab"]["<think>"] = len(data["model"]["vocab"])


def _eos_is_pad(data):
    data["eos_token"] = "<pad>"


@pytest.mark.parametrize("tokenizer, config, why", [
    (_swap_digits, None, r"token '1' is id \d+ in the student's, \d+ in the teacher's"),
    (_add_token, None, r"the vocabularies differ in size \(100 tokens in the student's, 101"),
    (None, _eos_is_pad, r"the eos token is id 2 in the student's, 0 in the teacher's"),
])
def test_another_tokenizer_is_refused_at_load_naming_both_paths(tmp_path, tokenizer, config, why):
    folder = _char_folder(tmp_path)
    _edit(folder, tokenizer, config)
    with pytest.raises(ConfigError, match=rf"distill.model_path='{folder}' has another tokenizer than "
                                          rf"model.path='builtin:tiny_moe': {why}"):
        load_config("configs/tiny_moe.yaml", ["distill.model_path=" + str(folder), "learner.algorithm=gspo_token"])


def test_what_cannot_be_read_at_load_is_left_to_the_start(tmp_path):
    # a hub id that is not cached and a folder without tokenizer.json: compared when the run has them
    assert load_config(None, ["distill.model_path=nobody-here/no-such-model", "learner.algorithm=grpo"]).distill.enabled
    (tmp_path / "bare").mkdir()
    assert folder_identity(tmp_path / "bare") is None


def test_loaded_tokenizer_identity_equals_the_files_and_unigram_vocabularies_read(tmp_path):
    from cluster.models.tiny_model import build_char_tokenizer

    assert mismatch(loaded_identity(build_char_tokenizer()), builtin_identity()) is None
    from tokenizers import Tokenizer
    from tokenizers.models import Unigram

    (tmp_path / "uni").mkdir()
    uni = Tokenizer(Unigram([("<unk>", 0.0), ("a", -1.0)], unk_id=0))  # a vocabulary as a list: ids by position
    uni.add_special_tokens(["<eos>"])  # an added token: id 2
    uni.save(str(tmp_path / "uni" / "tokenizer.json"))
    (tmp_path / "uni" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))
    got = folder_identity(tmp_path / "uni")
    assert got.vocab == {"<unk>": 0, "a": 1, "<eos>": 2} and got.special["eos"] == 2 and got.special["bos"] is None


def test_relative_teacher_folder_becomes_absolute_and_its_engines_are_reserved(tmp_path):
    _char_folder(tmp_path / "models", "teacher")
    cfg = absolute_paths(load_config(None, ["distill.model_path=models/teacher", "learner.algorithm=grpo"],),
                         cwd=tmp_path)
    assert cfg.distill.model_path == str(tmp_path.resolve() / "models" / "teacher")
    base = load_config(None)
    on = load_config(None, ["distill.model_path=builtin:tiny_moe", "learner.algorithm=grpo",
                            "distill.num_engines=2", "distill.num_cpus_per_engine=0.5"])
    assert resource_demand(on) == pytest.approx(resource_demand(base) + 1.0)


def test_the_shipped_distill_config_takes_make_trains_model_as_its_teacher():
    """configs/tiny_distill.yaml is configs/tiny_moe.yaml with GSPO-token and the teacher `make train` writes (its
    last checkpoint's Hugging Face folder); it loads before that folder exists (the check waits for the start)."""
    from tests.helpers import REPO_ROOT

    default, distill = load_config(REPO_ROOT / "configs" / "tiny_moe.yaml"), load_config(
        REPO_ROOT / "configs" / "tiny_distill.yaml")
    t = default.trainer
    assert distill.distill.model_path == f"{t.output_dir}/{t.run_name}/checkpoints/step_{t.total_steps:08d}/learner/hf"
    assert distill.learner.algorithm == "gspo_token" and distill.distill.reward_weight == 0.0
    same = ("model", "data", "rollout", "reward", "warm_start", "sync", "health")
    assert {k: distill.model_dump()[k] for k in same} == {k: default.model_dump()[k] for k in same}


def test_resume_takes_a_teacher_after_the_warm_start_and_keeps_it_after_rl_steps():
    """``distill.*`` acts from the first RL step on (a warm start's checkpoint, as gspo-compare's shared one,
    resumes into distillation); after RL steps the teacher and its signal are refused, its engines' resources
    are free."""
    from cluster.data.prompts import arithmetic_rows
    from cluster.driver.checkpoint import ResumeMismatch, check_resume, data_fingerprint

    def rows(cfg):
        d = cfg.data
        return arithmetic_rows(lambda s: [ord(ch) for ch in s], max_operand=d.max_operand, num_train=d.num_train,
                               num_eval=d.num_eval, seed=d.seed, demo_slip_rate=d.demo_slip_rate)[0]

    def saved(overrides, step):
        cfg = load_config("configs/tiny_moe.yaml", overrides)
        return {"step": step, "config": cfg.model_dump(mode="json"), "data_fingerprint": data_fingerprint(rows(cfg))}

    def check(state, overrides):
        cfg = load_config("configs/tiny_moe.yaml", ["trainer.resume=true", *overrides])
        return check_resume(state, cfg, data_fingerprint(rows(cfg)))

    notes = check(saved([], 0), ON)
    assert "distill.model_path: None -> 'builtin:tiny_moe' (the checkpoint is from before the first RL step)" in notes
    with pytest.raises(ResumeMismatch, match="distill.model_path: checkpoint None, config 'builtin:tiny_moe'"):
        check(saved([], 3), ON)
    with pytest.raises(ResumeMismatch, match="distill.kl_coef: checkpoint 1.0, config 2.0"):
        check(saved(ON, 3), [*ON, "distill.kl_coef=2"])
    notes = check(saved(ON, 3), [*ON, "distill.num_engines=2", "distill.timeout_s=60"])
    assert "distill.num_engines: 1 -> 2 (free to change on resume)" in notes


def test_the_teachers_engines_run_with_its_own_keys():
    from cluster.runtime.model_fleet import served_rollout_config

    d = load_config("configs/tiny_moe.yaml", [*ON, "distill.num_cpus_per_engine=0.5", "distill.kv_cache_gb=0.1",
                                              "distill.node_resources={teacher_node: 1}"]).distill
    rc = served_rollout_config(d, max_tokens=1)
    assert (rc.num_cpus_per_engine, rc.kv_cache_gb, rc.node_resources, rc.max_model_len, rc.max_response_tokens) == (
        0.5, 0.1, {"teacher_node": 1.0}, 33, 1)
    assert rc.enforce_eager and rc.in_process and rc.num_gpus_per_engine == 0 and rc.dtype == "float32"

