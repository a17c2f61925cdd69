"""A run killed with SIGKILL while multi-turn episodes are under way, then resumed, loses no task and trains none
twice (issue 38, item 5).

The real driver (``python -m cluster.train``, what ``make train`` runs) on ``configs/tiny_agent_calc.yaml`` with
slow-tool episodes (``tests.helpers.episode_trace:TracedSlowTool``: 3-4 turns of about 0.2 s each, every
episode's start and close traced to a file) runs in a process group of its own, with a private Ray temp dir.
Once a checkpoint exists (``save_every=2``), a step was trained after it and training episodes are open (the
config's overlapped mode, ``max_staleness=1``: the next step's rollout is collected beside the learner), the
whole group is SIGKILLed; Ray's processes that name the temp dir are ended as ``ray stop`` would (none may be
left). The run is then resumed to the same ``total_steps``. Without partial rollouts episodes are never saved in
a checkpoint (it holds only a rollout already collected): the rollout under way at the kill is played again from
the prompt stream's restored position. The second test kills a run with partial rollouts, whose checkpoint saves
the backlog of episodes.

From what the runs left on disk: ``metrics.jsonl`` and ``trained_prompts.jsonl`` hold each step once; step
``k`` trained exactly the prompts an uninterrupted run trains (the stream's prompts ``[(k-1)P, kP)``, the
stream rebuilt here from the same rows and seed), so no prompt twice and none the stream handed out skipped;
the episodes open at the kill were played again and trained once; the steps trained after the checkpoint and
before the kill trained the same prompts again; the learner took one optimizer step per minibatch of each
step (``learner_state.json``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.driver import checkpoint, trained_prompts
from cluster.runtime.local_head import head_processes
from tests.helpers import REPO_ROOT
from tests.helpers.driver_process import driver_env, end_group, private_ray_tmp, run_to_end, start_driver, tail
from tests.helpers.episode_trace import TRACE_ENV, open_episodes, started

CONFIG = REPO_ROOT / "configs" / "tiny_agent_calc.yaml"
STEPS, P, G, WARM = 5, 4, 2, 100
OVERRIDES = [
    f"trainer.total_steps={STEPS}", f"trainer.prompts_per_step={P}", f"trainer.group_size={G}",
    "trainer.save_every=2", "trainer.eval_every=0", "trainer.plots=false", "wandb.mode=disabled",
    # a short warm start on the demonstrations: turns end on the call's closing tag, so episodes run 3-4 turns
    f"warm_start.steps={WARM}", "warm_start.batch_size=16",
    "data.num_train=64", "data.num_eval=4", "learner.micro_batch_size=2",
    "env.cls=tests.helpers.episode_trace:TracedSlowTool", "env.tools=[]", "env.max_turns=4",
    "rollout.max_model_len=256",
]
RUN_TIMEOUT_S = 420


def _env(ray_tmp: Path, trace: Path) -> dict[str, str]:
    """The driver's environment (``driver_env``), every episode's start and close traced to ``trace``."""
    return driver_env(ray_tmp, **{TRACE_ENV: str(trace)})


def _start(out: Path, extra: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The driver in a new session: its process group holds Ray's head processes and workers too."""
    return start_driver(CONFIG, [*OVERRIDES, f"trainer.output_dir={out}", "trainer.run_name=agent_resume", *extra],
                        env, log)


def _run_to_end(out: Path, extra: list[str], env: dict[str, str], log: Path,
                ray_tmp: Path) -> tuple[int | None, list[str]]:
    """The driver run to its end (None: past ``RUN_TIMEOUT_S``), then whatever of it still runs ended: (exit code,
    what had to be ended)."""
    return run_to_end(CONFIG, [*OVERRIDES, f"trainer.output_dir={out}", "trainer.run_name=agent_resume", *extra],
                      env, log, ray_tmp, RUN_TIMEOUT_S)


def _train_open(trace: Path) -> dict[str, int]:
    """Training episodes open (started, not closed) by row uid; held-out episodes are ``eval/`` rows."""
    return {uid: n for uid, n in open_episodes(trace).items() if not uid.startswith("eval/")}


def _kill_mid_rollout(proc: subprocess.Popen, run: Path, trace: Path, log: Path) -> None:
    """Wait for a complete checkpoint, a step trained after it (its line in trained_prompts.jsonl, lost by the
    kill) and training episodes under way, then SIGKILL the driver's process group."""
    deadline = time.time() + RUN_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before it could be killed mid-rollout:\n{tail(log)}")
        ckpt = checkpoint.latest_checkpoint(run)
        if ckpt is not None and any(r["step"] > int(ckpt.name.split("_")[1]) for r in trained_prompts.read(run)) \
                and _train_open(trace):
            os.killpg(proc.pid, signal.SIGKILL)
            return
        time.sleep(0.01)
    pytest.fail(f"no checkpoint with episodes under way within {RUN_TIMEOUT_S}s:\n{tail(log)}")


def _stream_steps(run: Path) -> list[list[str]]:
    """The prompts of steps 1..STEPS of an uninterrupted run: the training stream rebuilt from the run's own
    config (its rows and seed), ``P`` per step."""
    from cluster.config import load_config
    from cluster.data.prompts import PromptStream
    from cluster.data.tasks import load_rows, load_tokenizer

    cfg = load_config(run / "config.yaml")
    rows, _ = load_rows(cfg, load_tokenizer(str(run / "model" / "tiny_moe")))  # the model the run built
    stream = PromptStream(rows, seed=cfg.trainer.seed)
    return [[r.uid for r in stream.take(P)] for _ in range(STEPS)]


@pytest.fixture
def ray_tmp():
    """A private temp dir for Ray and the run's other temporary files, removed after the test with any process
    of it."""
    with private_ray_tmp() as path:
        yield path


def test_sigkill_mid_episodes_then_resume_trains_every_prompt_once(tmp_path, ray_tmp):
    run, trace = tmp_path / "agent_resume", tmp_path / "episodes.trace"
    env = _env(ray_tmp, trace)

    # 1. the run, killed with its whole process group while a rollout's episodes are open
    log1 = tmp_path / "killed.log"
    proc = _start(tmp_path, [], env, log1)
    try:
        _kill_mid_rollout(proc, run, trace, log1)
    finally:
        escaped = end_group(proc, ray_tmp)
    assert head_processes(ray_tmp, proc.pid) == []
    assert escaped == [], f"processes of the killed run outlived its process group: {escaped}"
    at_kill = _train_open(trace)  # nothing writes the trace any more: these were under way at the kill
    assert at_kill, "the kill found no training episode under way"
    ckpt = checkpoint.latest_checkpoint(run)
    ckpt_step = int(checkpoint.read_state(ckpt)["step"])
    assert 1 <= ckpt_step < STEPS
    before = {r["step"]: r for r in trained_prompts.read(run)}  # steps trained before the kill
    assert all(uid not in r["uids"] for r in before.values() for uid in at_kill), \
        "an episode open at the kill belongs to a step already trained"
    assert max(before) > ckpt_step  # a step trained after the checkpoint: lost by the kill, trained again

    # 2. resumed to the same total_steps
    log2 = tmp_path / "resumed.log"
    rc, escaped = _run_to_end(tmp_path, ["trainer.resume=true"], env, log2, ray_tmp)
    assert rc == 0, f"the resumed run failed (rc {rc}):\n{tail(log2)}"
    assert escaped == [], f"processes of the resumed run outlived it: {escaped}"
    assert f"resumed from {ckpt} (step {ckpt_step})" in log2.read_text()

    # 3. what the runs left on disk
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # step 0: the held-out evaluation
    records = trained_prompts.read(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert not any(r["skipped"] for r in records)
    expected = _stream_steps(run)
    assert [r["uids"] for r in records] == expected  # exactly the uninterrupted run's prompts, step by step
    assert [(r["stream_start"], r["stream_end"]) for r in records] == [(k * P, (k + 1) * P) for k in range(STEPS)]
    trained = [uid for r in records for uid in r["uids"]]
    assert len(trained) == len(set(trained)) == STEPS * P  # none twice, none of the handed-out prompts skipped
    # episodes: none of a prompt the run did not train; the G of each prompt open at the kill started again after
    # it (2G in all) and were trained; every episode the resumed run started was closed
    starts = {uid: n for uid, n in started(trace).items() if not uid.startswith("eval/")}
    assert set(starts) == set(trained) and all(n in (G, 2 * G) for n in starts.values()), starts
    assert set(at_kill) <= set(trained) and all(starts[uid] == 2 * G for uid in at_kill), (at_kill, starts)
    assert _train_open(trace) == at_kill
    for step, r in before.items():  # steps trained after the checkpoint, then lost, trained the same prompts again
        assert r["uids"] == expected[step - 1], f"step {step}: {r['uids']} before the kill"

    final = checkpoint.latest_checkpoint(run)
    state = checkpoint.read_state(final)
    assert state["step"] == STEPS and state["stream_position"] == STEPS * P
    cfg = state["config"]["learner"]
    learner_state = checkpoint.read_learner_state(final)
    assert learner_state["optimizer_steps"] == WARM + STEPS * cfg["num_minibatches"] * cfg["ppo_epochs"]


def test_sigkill_with_partial_episodes_in_the_backlog_then_resume_trains_every_prompt_once(tmp_path, ray_tmp):
    """The same kill with ``trainer.partial_rollouts`` (episodes span syncs; up to 2 P groups under way): the
    checkpoint saves the backlog (ended episodes whole, the others to start again). After the resume every
    prompt the stream handed out is trained once or still in the final backlog, none twice."""
    import pickle

    from cluster.driver.resume import PARTIAL_FILE

    run, trace = tmp_path / "agent_resume", tmp_path / "episodes.trace"
    env = _env(ray_tmp, trace)
    partial = ["trainer.partial_rollouts=true", "trainer.max_staleness=1"]
    log1 = tmp_path / "killed.log"
    proc = _start(tmp_path, partial, env, log1)
    try:
        _kill_mid_rollout(proc, run, trace, log1)
    finally:
        escaped = end_group(proc, ray_tmp)
    assert escaped == [], f"processes of the killed run outlived its process group: {escaped}"
    at_kill = _train_open(trace)
    ckpt = checkpoint.latest_checkpoint(run)
    assert (ckpt / PARTIAL_FILE).is_file()  # the backlog was saved with the checkpoint

    log2 = tmp_path / "resumed.log"
    rc, escaped = _run_to_end(tmp_path, ["trainer.resume=true", *partial], env, log2, ray_tmp)
    assert rc == 0, f"the resumed run failed (rc {rc}):\n{tail(log2)}"
    assert escaped == []

    records = trained_prompts.read(run)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1)) and not any(r["skipped"] for r in records)
    trained = [uid for r in records for uid in r["uids"]]
    assert len(trained) == len(set(trained)) == STEPS * P  # none twice
    final = checkpoint.latest_checkpoint(run)
    position = int(checkpoint.read_state(final)["stream_position"])
    backlog = pickle.loads((final / PARTIAL_FILE).read_bytes())
    in_flight = [g.row.uid for g in backlog.groups]
    from cluster.config import load_config
    from cluster.data.prompts import PromptStream
    from cluster.data.tasks import load_rows, load_tokenizer

    cfg = load_config(run / "config.yaml")
    rows, _ = load_rows(cfg, load_tokenizer(str(run / "model" / "tiny_moe")))
    handed_out = [r.uid for r in PromptStream(rows, seed=cfg.trainer.seed).take(position)]
    assert sorted(trained + in_flight) == sorted(handed_out)  # none lost: trained, or still under way
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(m.get("agent/token_mismatch", 0.0) == 0.0 for m in metrics)
    assert _train_open(trace) == at_kill  # every episode the resumed run started was closed (or is in the backlog)
