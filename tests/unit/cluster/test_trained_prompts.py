"""trained_prompts.jsonl: one line per RL step with the prompt uids it trained, kept one line per step across a
resume (lines after the checkpoint's step dropped), a line cut short by a kill skipped; and the trainer writes
one line per step with its collection's stream positions (issue 38, item 5)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from cluster.driver import trained_prompts
from cluster.driver.trained_prompts import FILE, TrainedPromptLog


def test_lines_per_step_across_a_resume(tmp_path):
    first = TrainedPromptLog(tmp_path)
    first.log(1, ["a", "b"], 0, 2, skipped=False)
    first.log(2, ["c", "d"], 2, 4, skipped=True)
    first.log(3, ["e", "f"], 4, 6, skipped=False)  # after the step-2 checkpoint: trained again on resume
    with open(tmp_path / FILE, "a") as f:
        f.write('{"step": 4, "uids": ["g"')  # a write cut short by SIGKILL
    assert [r["step"] for r in trained_prompts.read(tmp_path)] == [1, 2, 3]
    assert trained_prompts.read(tmp_path)[1] == {"step": 2, "uids": ["c", "d"], "stream_start": 2, "stream_end": 4,
                                                 "skipped": True}

    resumed = TrainedPromptLog(tmp_path, resume_from_step=2)
    assert [r["step"] for r in trained_prompts.read(tmp_path)] == [1, 2]
    resumed.log(3, ["e", "f"], 4, 6, skipped=False)
    lines = [json.loads(line) for line in (tmp_path / FILE).read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[-1]["uids"] == ["e", "f"]

    TrainedPromptLog(tmp_path)  # not a resume: a new run in the same folder starts the file anew
    assert trained_prompts.read(tmp_path) == [] and not (tmp_path / FILE).exists()
    assert trained_prompts.read(tmp_path / "missing") == []


def test_the_trainer_writes_a_line_per_step(tmp_path, monkeypatch):
    """``Trainer.rl_step`` with stand-ins for its services: the line holds the step, the trained uids and the
    stream positions of the step's collection."""
    from cluster.config import load_config
    from cluster.driver import trainer as trainer_mod
    from cluster.driver.collect import Collected
    from tests.helpers import REPO_ROOT

    cfg = load_config(REPO_ROOT / "configs" / "tiny_moe.yaml",
                      [f"trainer.output_dir={tmp_path}", "trainer.max_staleness=0", "wandb.mode=disabled"])
    t = trainer_mod.Trainer(cfg)
    t.prompt_log = TrainedPromptLog(t.run_dir)
    rows = [SimpleNamespace(uid=f"u{i}") for i in range(3)]
    G = cfg.trainer.group_size
    collected = Collected(step=0, prompts=rows, results=[SimpleNamespace(score=0.0)] * (3 * G),
                          start_position=5, end_position=8)
    t.collector = SimpleNamespace(collect=lambda step: collected)
    t.fleet = SimpleNamespace(restarts=0, take_settled=dict, __len__=lambda: 1)
    t.stream = SimpleNamespace(epoch=0)
    t.rewards = SimpleNamespace(num_workers=1)
    result = SimpleNamespace(skipped=True, metrics={}, by_response_length={})
    monkeypatch.setattr(trainer_mod, "apply_control", lambda *a: None)
    monkeypatch.setattr(t, "train", lambda c, rewards: (result, 0.0))
    monkeypatch.setattr(t, "after_train", lambda r, m: 0.0)
    for name in ("rollout_metrics", "length_metrics"):
        monkeypatch.setattr(trainer_mod.step_metrics, name, lambda *a: {})
    monkeypatch.setattr(trainer_mod.partial_rollout, "step_metrics", lambda *a: {})
    monkeypatch.setattr(t, "run_metrics", lambda *a: {})
    t.rl_step()
    assert trained_prompts.read(t.run_dir) == [
        {"step": 1, "uids": ["u0", "u1", "u2"], "stream_start": 5, "stream_end": 8, "skipped": True}]
    assert t.trained_uids == [["u0", "u1", "u2"]]
