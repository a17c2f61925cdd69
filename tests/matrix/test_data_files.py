"""Rows from your own files (``data.task: files``): each file type, globs, ``save_to_disk`` folders, chat
prompts, templates, the errors and skips, the seeded held-out split; the prompt encoder (chat template, system
prompt, BOS never doubled) on tokenizers built here; the engine's EOS ids."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cluster.models.tiny_model import char_vocab
from tests.helpers import REPO_ROOT
from tests.helpers.data_files import chars, write_jsonl
from tests.helpers.rollout import engine_options


def test_engine_stops_on_every_declared_eos_and_keeps_it(ray_cluster, tiny_moe, tmp_path):
    """A model whose generation config declares every token an EOS: each response is one token, stopped,
    and that token stays in the response (and so in the loss mask)."""
    import shutil

    from rollout.config import RolloutConfig
    from rollout.contracts import PromptRow
    from rollout.engine import RolloutEngine

    folder = tmp_path / "model"
    shutil.copytree(tiny_moe, folder)
    gen = json.loads((folder / "generation_config.json").read_text())
    gen["eos_token_id"] = list(range(len(char_vocab())))
    (folder / "generation_config.json").write_text(json.dumps(gen))
    rc = RolloutConfig(max_model_len=64, max_response_tokens=8)
    engine = ray_cluster.remote(RolloutEngine).options(**engine_options(rc)).remote(
        str(folder), rc, cache_dir=str(tmp_path / "cache"))
    try:
        stop = ray_cluster.get(engine.__ray_call__.remote(lambda e: e.stop_token_ids))
        assert stop == list(range(len(char_vocab())))
        out = ray_cluster.get(engine.generate.remote([PromptRow("p", "1+2=", chars("1+2="), "3")], 4, seed=1))
        assert all(len(c.response_token_ids) == 1 and c.finish_reason == "stop" for c in out)
        greedy = ray_cluster.get(engine.generate_greedy.remote([PromptRow("p", "1+2=", chars("1+2="), "3")]))
        assert len(greedy[0].response_token_ids) == 1 and greedy[0].finish_reason == "stop"
    finally:
        ray_cluster.get(engine.shutdown.remote())
        ray_cluster.kill(engine)


def test_short_run_on_own_jsonl(tmp_path):
    """``cluster.train`` on a JSONL with its own field names (2 RL steps, started from another directory)."""
    rows = [{"problem": f"{a}+{b}=", "result": a + b, "worked": str(a + b)} for a in range(10) for b in range(10)]
    write_jsonl(tmp_path / "sums.jsonl", rows)
    overrides = ["data.task=files", "data.train_path=sums.jsonl", "data.prompt_key=problem",
                 "data.answer_key=result", "data.solution_key=worked", "data.verifier=exact", "data.eval_fraction=0.1",
                 "data.num_eval=8", "trainer.total_steps=2", "trainer.eval_every=0", "trainer.run_name=own_jsonl",
                 f"trainer.output_dir={tmp_path / 'out'}", "trainer.plots=false", "wandb.mode=disabled",
                 "warm_start.steps=2"]
    proc = subprocess.run([sys.executable, "-m", "cluster.train", str(REPO_ROOT / "configs/tiny_moe_zero2.yaml"), *overrides],
                          cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT), "GSPO_PROGRESS": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out/own_jsonl/metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [1, 2]
    held = [json.loads(line) for line in (tmp_path / "out/own_jsonl/eval_prompts.jsonl").read_text().splitlines()]
    assert len(held) == 8 and {h["verifier"] for h in held} == {"exact"} and held[0]["uid"].startswith("eval/")
