"""Same config and seed, same digits (``trainer.deterministic``, docs/faults.md#determinism), in every shipped
mode: on-policy steps, the overlapped default (``configs/tiny_moe.yaml`` as shipped), partial rollouts with and
without ``partial_rollout_overlap``, tool episodes (``configs/tiny_agent_calc.yaml``) with and without partial
rollouts, and two ZeRO-2 learner ranks. Each mode runs its own short job three times with the real driver
(``python -m cluster.train``, what ``make train`` runs) in a process group of its own, with real Ray, vLLM and
DeepSpeed on the CPU:

1. from scratch to the end, at 1 learner thread;
2. from scratch again at 2 learner threads, its whole process group SIGKILLed once step ``KILL_AFTER`` is
   logged (the step after the checkpoint of step ``SAVE_EVERY``): the steps it logged are the first run's, bit for
   bit;
3. resumed (``trainer.resume=true``; the learner's thread settings must match the checkpoint's) from that
   checkpoint to the end: ``metrics.jsonl`` then holds the first run's lines, bit for bit.

Every metric of ``metrics.jsonl`` is compared but the time measures (``tests.helpers.driver.VOLATILE_METRICS``).
The second run trains at another learner thread count (elastic threads off in both): what the elastic threads
do by timing, done on purpose, so the test fails whenever a learner's digits follow its thread count. Without
MKL's strict reproducibility mode (``trainer.deterministic=false``) they do: MKL's float32 GEMM takes other
kernels at 2 threads for 5-11 rows, an MoE expert's share of a micro-batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cluster.driver import checkpoint
from tests.helpers import REPO_ROOT
from tests.helpers.driver import logged_metrics, metric_differences
from tests.helpers.driver_process import driver_env, end_group, private_ray_tmp, run_to_end, start_driver, tail

MOE, AGENT = REPO_ROOT / "configs" / "tiny_moe.yaml", REPO_ROOT / "configs" / "tiny_agent_calc.yaml"
STEPS, SAVE_EVERY, KILL_AFTER = 5, 2, 3
RUN_TIMEOUT_S = 420
COMMON = [f"trainer.total_steps={STEPS}", f"trainer.save_every={SAVE_EVERY}", "trainer.keep_checkpoints=3",
          "trainer.eval_every=0", "trainer.plots=false", "wandb.mode=disabled", "data.num_train=64"]
BASE = {
    # warm starts long enough that groups get mixed rewards: the learner's weights change every step
    MOE: ["warm_start.steps=200", "warm_start.batch_size=64", "trainer.prompts_per_step=8", "trainer.group_size=4",
          "data.num_eval=8", "rollout.max_response_tokens=4", "learner.micro_batch_size=8"],
    # ... and episodes call the tool and read its reply
    AGENT: ["warm_start.steps=200", "warm_start.batch_size=32", "trainer.prompts_per_step=4", "trainer.group_size=2",
            "data.num_eval=4", "learner.micro_batch_size=2"],
}
PARTIAL = ["trainer.partial_rollouts=true", "trainer.max_staleness=2"]
MODES = {
    "on_policy": (MOE, ["trainer.max_staleness=0"]),
    "overlapped": (MOE, []),  # the shipped default: max_staleness=1, the next rollout collected beside the learner
    "partial": (MOE, PARTIAL),
    "partial_overlap": (MOE, [*PARTIAL, "trainer.partial_rollout_overlap=true"]),
    "agent": (AGENT, []),
    # not exact yet (docs/faults.md#determinism): a collection ends once P groups have ended, which episodes' tool
    # answers decide by timing, and an episode under way at a checkpoint starts again after a resume
    "agent_partial": pytest.param(AGENT, ["trainer.partial_rollouts=true", "trainer.max_staleness=1"],
                                  marks=pytest.mark.xfail(reason="partial tool episodes: timing-driven boundaries, "
                                                          "episodes under way restart at a resume")),
    # two ZeRO-2 ranks as configs/tiny_moe_zero2.yaml (a minibatch's 8 sequences: 4 per rank)
    "two_ranks": (MOE, ["learner.world_size=2", "learner.zero_stage=2", "learner.micro_batch_size=4"]),
}
THREADS = {1: ["learner.max_threads_per_rank=null"],
           2: ["learner.threads_per_rank=2", "learner.max_threads_per_rank=2"]}


def _overrides(config: Path, out: Path, name: str, extra: list[str]) -> list[str]:
    return [*COMMON, *BASE[config], f"trainer.output_dir={out}", f"trainer.run_name={name}", *extra]


def _kill_after(proc: subprocess.Popen, run: Path, step: int, log: Path) -> list[dict]:
    """SIGKILL the driver's process group as soon as ``run/metrics.jsonl`` holds step ``step``'s line. Returns the
    lines logged by then (``logged_metrics``' keys; a line cut short by the kill left out)."""
    path, deadline = run / "metrics.jsonl", time.time() + RUN_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before step {step} was logged:\n{tail(log)}")
        text = path.read_text() if path.is_file() else ""
        if any(json.loads(line)["step"] == step for line in text.splitlines() if line.endswith("}")):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            whole = "".join(line + "\n" for line in path.read_text().splitlines() if line.endswith("}"))
            copy = run.parent / "killed"  # the resumed run rewrites the run's own
            copy.mkdir(exist_ok=True)
            (copy / "metrics.jsonl").write_text(whole)
            return logged_metrics(copy)
        time.sleep(0.05)
    pytest.fail(f"step {step} not logged within {RUN_TIMEOUT_S}s:\n{tail(log)}")


def _differ(a: list[dict], b: list[dict]) -> str:
    return "\n".join(metric_differences(a, b)[:20])


@pytest.mark.parametrize(("config", "extra"), [MODES[m] for m in sorted(MODES)], ids=sorted(MODES))
def test_two_runs_and_a_resume_after_sigkill_log_the_same_digits(tmp_path, config, extra):
    with private_ray_tmp() as ray_tmp:
        env = driver_env(ray_tmp)
        log1 = tmp_path / "first.log"
        rc, escaped = run_to_end(config, _overrides(config, tmp_path, "first", [*extra, *THREADS[1]]), env, log1,
                                 ray_tmp, RUN_TIMEOUT_S)
        assert rc == 0 and not escaped, f"the first run failed (rc {rc}, left {escaped}):\n{tail(log1)}"
        first = logged_metrics(tmp_path / "first")
        assert [m["step"] for m in first] == list(range(STEPS + 1)) and "loss/policy" in first[-1]
        # the learner's weights change (some groups have mixed rewards), also in the steps a resume plays again
        assert any(m.get("actor/grad_norm", 0) > 0 for m in first[SAVE_EVERY + 1:]), "no step changed the weights"
        if config == AGENT:
            assert any(m["agent/tool_calls_mean"] > 0 for m in first[1:]), "no episode called the tool"

        run, log2 = tmp_path / "second", tmp_path / "killed.log"
        proc = start_driver(config, _overrides(config, tmp_path, "second", [*extra, *THREADS[2]]), env, log2)
        try:
            killed = _kill_after(proc, run, KILL_AFTER, log2)
        finally:
            escaped = end_group(proc, ray_tmp)
        assert not escaped, f"processes of the killed run outlived its process group: {escaped}"
        assert len(killed) > KILL_AFTER
        assert not metric_differences(first[:len(killed)], killed), _differ(first, killed)
        ckpt = checkpoint.latest_checkpoint(run)
        assert ckpt is not None and int(checkpoint.read_state(ckpt)["step"]) == SAVE_EVERY < KILL_AFTER

        log3 = tmp_path / "resumed.log"
        rc, escaped = run_to_end(config, _overrides(config, tmp_path, "second",
                                                    [*extra, *THREADS[2], "trainer.resume=true"]),
                                 env, log3, ray_tmp, RUN_TIMEOUT_S)
        assert rc == 0 and not escaped, f"the resumed run failed (rc {rc}, left {escaped}):\n{tail(log3)}"
        assert f"resumed from {ckpt} (step {SAVE_EVERY})" in log3.read_text()
        resumed = logged_metrics(run)
        assert not metric_differences(first, resumed), _differ(first, resumed)
