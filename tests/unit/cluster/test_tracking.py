"""Metrics logging: metrics.jsonl holds one line per step across a resume, and a resumed run continues its own
wandb run (same id; issue 15). Real wandb in offline mode, writing into tmp_path."""

from __future__ import annotations

import json

import pytest

from cluster.driver.tracking import WANDB_ID_FILE, MetricsLogger, wandb_run_id


def _offline_run_ids(run_dir):
    """The run id of every offline run folder wandb wrote (``offline-run-<time>-<id>``), in creation order."""
    return [p.name.rsplit("-", 1)[1] for p in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_resumed_run_continues_its_wandb_run(tmp_path):
    first = MetricsLogger(tmp_path, {"trainer": {"seed": 0}}, wandb_mode="offline", project="test")
    assert first._wandb is not None, "wandb did not start offline"
    run_id = first._wandb.id
    for step in (1, 2, 3):
        first.log({"step": step, "reward/mean": 0.1 * step})
    first.close()
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id

    resumed = MetricsLogger(tmp_path, {"trainer": {"seed": 0}}, wandb_mode="offline", project="test",
                            resume_from_step=2)
    try:
        assert resumed._wandb.id == run_id
        assert [r["step"] for r in resumed.history] == [1, 2]  # step 3 came after the checkpoint
        resumed.log({"step": 3, "reward/mean": 0.35})
    finally:
        resumed.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3] and lines[-1]["reward/mean"] == 0.35
    assert set(_offline_run_ids(tmp_path)) == {run_id}  # `wandb sync` uploads them into one run

    fresh = MetricsLogger(tmp_path, {}, wandb_mode="offline", project="test")  # not a resume: a new run
    try:
        assert fresh._wandb.id != run_id
        assert (tmp_path / WANDB_ID_FILE).read_text().strip() == fresh._wandb.id
    finally:
        fresh.close()


def test_run_id_file(tmp_path):
    new, continued = wandb_run_id(tmp_path, resuming=True)  # resumed, but no id stored (e.g. wandb was off)
    assert not continued and (tmp_path / WANDB_ID_FILE).read_text() == new + "\n"
    assert wandb_run_id(tmp_path, resuming=True) == (new, True)
    other, continued = wandb_run_id(tmp_path, resuming=False)
    assert other != new and not continued


@pytest.mark.parametrize("resume_from_step", [None, 1])
def test_disabled_wandb_writes_no_id(tmp_path, resume_from_step):
    logger = MetricsLogger(tmp_path, {}, wandb_mode="disabled", resume_from_step=resume_from_step)
    logger.log({"step": 1, "reward/mean": 0.5})
    logger.close()
    assert not (tmp_path / WANDB_ID_FILE).exists() and logger._wandb is None
