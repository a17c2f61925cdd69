"""Weight sync learner -> engine, for real: a DeepSpeed learner rank streams its weights through the Ray object
store into an in-process vLLM engine (vLLM's weight-transfer protocol, our ``ray_object`` backend, layer-wise
reload), after real optimizer steps; the engine's log-probs must equal the learner's (fp32, 1e-5) after every
sync, for an MoE (untied, ZeRO-3 with every parameter partitioned), a tied MoE and a tied dense model.

The tied cases fail without the CPU ``lm_head`` repack refresh in ``rollout.weight_sync`` (log-probs drift by
~0.5 from the first sync on); the MoE cases fail without the CPU expert-repack fix.
"""

from __future__ import annotations

import json

import pytest
import torch

from learner.config import LearnerConfig
from rollout.config import RolloutConfig
from tests.helpers.sync import learner_logprobs, sft_batch

TOL = 1e-5


def build_model(folder, kind: str):
    """A tiny random model in Hugging Face format with the char tokenizer: ``moe`` (the embedded tiny MoE),
    ``moe_tied`` (the same with tied embeddings) or ``dense_tied`` (Qwen3 dense, tied)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from cluster.models.tiny_model import build_char_tokenizer, build_tiny_moe

    build_tiny_moe(folder, seed=0)
    if kind == "moe":
        return str(folder)
    cfg = json.loads((folder / "config.json").read_text())
    if kind == "moe_tied":
        cfg["tie_word_embeddings"] = True
        (folder / "config.json").write_text(json.dumps(cfg))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    else:
        config = Qwen3Config(vocab_size=cfg["vocab_size"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                             max_position_embeddings=512, pad_token_id=cfg["pad_token_id"],
                             bos_token_id=cfg["bos_token_id"], eos_token_id=cfg["eos_token_id"], dtype="float32")
        config.architectures = ["Qwen3ForCausalLM"]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    for f in folder.glob("model*.safetensors*"):
        f.unlink()
    model.save_pretrained(folder, safe_serialization=True)
    build_char_tokenizer().save_pretrained(folder)
    return str(folder)


class HungEngine:
    """An engine that never answers the start of a weight update (a stuck process)."""

    def start_weight_update(self) -> None:
        import time

        time.sleep(600)


# every case in `make test-matrix`: the default set's sync is test_deferred_sync_... (the shipped default's,
# the engines loading beside the learner), exact against the learner too
@pytest.mark.parametrize("kind,zero_stage,transport", [
    pytest.param(kind, zero, transport, marks=pytest.mark.matrix) for kind, zero, transport in [
        ("moe", 3, "object_store"), ("moe_tied", 2, "object_store"), ("dense_tied", 2, "object_store"),
        ("moe", 3, "collective"), ("moe_tied", 2, "collective")]])
def test_streamed_sync_is_exact_after_training(ray_cluster, tmp_path, kind, zero_stage, transport):
    from learner.service import LearnerRank
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    path = build_model(tmp_path / kind, kind)
    cfg = LearnerConfig(zero_stage=zero_stage, micro_batch_size=4, lr=1e-2, zero3_param_persistence_threshold=0)
    learner = ray.remote(LearnerRank).options(num_cpus=1).remote(
        path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, seed=0, temperature=1.0)
    # the engine's environment as the fleet gives it (eager mode without torch.compile: vLLM's CPU GEMM packing)
    engine_env = {"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
    engine = ray.remote(RolloutEngine).options(num_cpus=1, runtime_env=engine_env).remote(
        path, RolloutConfig(max_model_len=64, max_response_tokens=4), cache_dir=str(tmp_path / "cache"))
    dead = ray.remote(RolloutEngine).options(num_cpus=0).remote(path, RolloutConfig(), cache_dir=str(tmp_path / "c2"))
    ray.kill(dead)
    hung = ray.remote(HungEngine).options(num_cpus=0).remote()
    try:
        ray.get([learner.pid.remote(), engine.pid.remote()])
        checkpoint_bytes = sum(t.numel() * t.element_size() for t in ray.get(learner.checkpoint_state_dict.remote()).values())
        seq, start = [1] + [5 + (i * 7) % 50 for i in range(30)], 6
        for version in (1, 2):
            ray.get(learner.sft_step.remote(sft_batch(version), 8 * 11))
            report = ray.get(learner.sync_weights.remote([engine, dead, hung], version, 0.01, 2, 2.0, transport))
            assert sorted(report.failed_engines) == [1, 2]  # dead and hung engines are reported, not raised
            assert (report.transport, report.fallback) == (transport, "")  # the group left them out
            assert "engine_timeout_s" in report.failed_engines[2]
            assert report.buckets > 2
            # the one live engine's own load seconds, summed over buckets: within the sync (its calls run in turn)
            assert 0 < report.engine_load_s <= report.seconds
            assert report.bytes == checkpoint_bytes  # each byte once to the one live engine, no view blowup;
            # failed engines count nothing
            assert ray.get(engine.weight_version.remote()) == version
            engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, start)))
            diff = (engine_lp - learner_logprobs(ray, learner, seq, start)).abs().max().item()
            assert diff < TOL, (kind, version, diff)
    finally:
        for a in (learner, engine, hung):
            ray.kill(a)


class DyingEngine:
    """A real rollout engine whose process exits when asked to load bucket ``die_at`` of a sync."""

    def __init__(self, *args, die_at: int, **kwargs):
        from rollout.engine import RolloutEngine

        self.engine, self.die_at = RolloutEngine(*args, **kwargs), die_at

    def __getattr__(self, name):
        return getattr(self.__dict__["engine"], name)

    def transfer_world_size(self) -> int:
        return self.engine.transfer_world_size()

    def init_weight_transfer_group(self, info) -> None:
        self.engine.init_weight_transfer_group(info)

    def start_weight_update(self) -> None:
        self.engine.start_weight_update()

    def update_weights(self, meta, buffers) -> float:
        import os

        if meta.get("bucket") == self.die_at:
            os._exit(1)
        return self.engine.update_weights(meta, buffers)

    def pid(self) -> int:
        return self.engine.pid()


@pytest.mark.matrix  # wide case: the default set syncs through the object store (test_deferred_sync_...)
def test_collective_sync_survives_an_engine_dying_mid_sync(ray_cluster, tmp_path):
    """``sync.transport=collective``: an engine process that dies half-way through a sync breaks the broadcast.
    Group ranks: learner 0, live engines 1 and 2, the dying engine 3; gloo's broadcast is a tree in which rank 1
    relays to rank 3, so a healthy engine fails its receive too. The object store carries the bucket to the
    engines that did not load it and the rest of the sync; both live engines end exact, only the dead one is
    reported. The next sync builds a new group without it."""
    from learner.service import LearnerRank
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    path = build_model(tmp_path / "moe", "moe")
    cfg = LearnerConfig(zero_stage=2, micro_batch_size=4, lr=1e-2)
    learner = ray.remote(LearnerRank).options(num_cpus=1).remote(
        path, cfg, rank=0, world_size=1, master_addr="127.0.0.1", master_port=0, seed=0, temperature=1.0)
    env = {"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
    rc = RolloutConfig(max_model_len=64, max_response_tokens=4)
    live = [ray.remote(RolloutEngine).options(num_cpus=0, runtime_env=env).remote(
        path, rc, engine_index=i, cache_dir=str(tmp_path / f"c{i}")) for i in range(2)]
    dying = ray.remote(DyingEngine).options(num_cpus=0, runtime_env=env, max_restarts=0).remote(
        path, rc, die_at=2, cache_dir=str(tmp_path / "c2"))
    seq, start = [1] + [5 + (i * 7) % 50 for i in range(30)], 6

    def assert_exact() -> None:
        want = learner_logprobs(ray, learner, seq, start)
        for e in live:
            assert (torch.tensor(ray.get(e.sequence_logprobs.remote(seq, start))) - want).abs().max().item() < TOL

    try:
        ray.get([learner.pid.remote(), dying.pid.remote()] + [e.pid.remote() for e in live])
        ray.get(learner.sft_step.remote(sft_batch(1), 8 * 11))
        report = ray.get(learner.sync_weights.remote([*live, dying], 1, 0.01, 2, 10.0, "collective"))
        assert sorted(report.failed_engines) == [2], report.failed_engines
        assert report.fallback.startswith("bucket 2: ") and report.transport == "object_store"
        assert_exact()
        ray.get(learner.sft_step.remote(sft_batch(2), 8 * 11))
        report = ray.get(learner.sync_weights.remote(live, 2, 0.01, 2, 10.0, "collective"))
        assert (report.transport, report.fallback, report.failed_engines) == ("collective", "", {})
        assert_exact()
    finally:
        for a in (learner, dying, *live):
            ray.kill(a)


class DyingAtFinish(DyingEngine):
    """A real rollout engine whose process exits when asked to finish a weight update."""

    def finish_weight_update(self, version: int) -> int:
        import os

        os._exit(1)


def test_deferred_sync_leaves_the_engines_last_calls_to_the_driver(ray_cluster, tmp_path):
    """``sync.load_beside_learner``: the learner returns once the buckets are put, with the engines' start, last
    load and finish pending; it trains on meanwhile, and the engine still ends with the weights it was sent (the
    put bytes, not the learner's later ones). The driver's wait (``EngineFleet.settle``) finds the engine that
    died finishing and replaces it."""
    from cluster.common import REPO_ROOT
    from cluster.config import load_config
    from cluster.runtime.services import EngineFleet
    from learner.service import LearnerRank
    from rollout.engine import RolloutEngine

    ray = ray_cluster
    path = build_model(tmp_path / "moe", "moe")
    learner = ray.remote(LearnerRank).options(num_cpus=1).remote(
        path, LearnerConfig(zero_stage=0, micro_batch_size=4, lr=1e-2), rank=0, world_size=1,
        master_addr="127.0.0.1", master_port=0, seed=0, temperature=1.0)
    env = {"env_vars": {"TORCH_COMPILE_DISABLE": "1"}}
    rc = RolloutConfig(max_model_len=64, max_response_tokens=4)
    engine = ray.remote(RolloutEngine).options(num_cpus=0, runtime_env=env).remote(path, rc, cache_dir=str(tmp_path / "c0"))
    dying = ray.remote(DyingAtFinish).options(num_cpus=0, runtime_env=env, max_restarts=0).remote(
        path, rc, die_at=-1, cache_dir=str(tmp_path / "c1"))
    seq, start = [1] + [5 + (i * 7) % 50 for i in range(30)], 6
    try:
        ray.get([learner.pid.remote(), engine.pid.remote(), dying.pid.remote()])
        ray.get(learner.sft_step.remote(sft_batch(1), 8 * 11))
        report = ray.get(learner.sync_weights.remote([engine, dying], 1, 0.01, 2, 60.0, "object_store", True))
        assert report.failed_engines == {} and sorted(report.pending.calls) == [0, 1]
        # start, the last bucket (2 in flight at most: the one put last was not waited for), finish
        assert [len(c) for c in report.pending.calls.values()] == [3, 3] and report.pending.loads[0] == [1]
        sent = learner_logprobs(ray, learner, seq, start)
        ray.get(learner.sft_step.remote(sft_batch(2), 8 * 11))  # trains on while the engines may still load
        fleet = EngineFleet(load_config(REPO_ROOT / "configs" / "tiny_moe.yaml"), path, tmp_path, weight_sync=None)
        fleet.engines, fleet._pending, replaced = [engine, dying], report.pending, []
        fleet.replace_many = replaced.extend  # starting real replacements is the fleet's own tests' business
        waited = fleet.settle()
        assert replaced == [1]  # died finishing: replaced, the live engine not
        assert ray.get(engine.weight_version.remote()) == 1
        settled = fleet.take_settled()
        assert settled["sync/engine_load_s"] > 0 and settled["timing/wait_engine_load_s"] == pytest.approx(waited)
        assert fleet.settle() == 0.0 and fleet.take_settled() == {}
        engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, start)))
        assert (engine_lp - sent).abs().max().item() < TOL  # the weights put, exactly
        now = learner_logprobs(ray, learner, seq, start)
        assert (engine_lp - now).abs().max().item() > 1e-3  # not the learner's newer ones: the check can fail
        # version None: the learner labels the weights itself (synced 1, trained since: 2), as a replacement
        # engine's load queued behind a training step needs (EngineFleet._load_current)
        assert ray.get(learner.current_version.remote()) == 2
        labelled = ray.get(learner.sync_weights.remote([engine], None, 0.01, 2, 60.0))
        assert labelled.version == 2 and labelled.failed_engines == {}
        assert ray.get(engine.weight_version.remote()) == 2 and ray.get(learner.current_version.remote()) == 2
        engine_lp = torch.tensor(ray.get(engine.sequence_logprobs.remote(seq, start)))
        assert (engine_lp - now).abs().max().item() < TOL
        with pytest.raises(ray.exceptions.RayTaskError, match="load_beside_learner needs sync.transport='object_store'"):
            ray.get(learner.sync_weights.remote([engine], 2, 0.01, 2, 60.0, "collective", True))
    finally:
        for a in (learner, engine, dying):
            ray.kill(a)
