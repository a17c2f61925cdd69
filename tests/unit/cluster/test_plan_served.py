"""The served models in the dry-run resource plan (cluster/planning): the LLM judge's (``reward.judge``) and the
distillation teacher's (``distill``) engines as actors, CPUs, placement groups, host RAM parts and busy threads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from cluster.config import load_config
from cluster.planning.actor_placement import PlanError, cpu_oversubscription, served_models
from cluster.planning.memory_budget import HOST_PROCESS_GIB
from cluster.planning.plan import plan
from cluster.planning.shapes import safetensors_params
from tests.helpers import REPO_ROOT

GIB = 2**30
TINY = REPO_ROOT / "configs/tiny_moe.yaml"
# P = 2**30 parameters for the policy: bfloat16 weights are exactly 2 GiB
POLICY = ["model.num_params_b=1.073741824", "learner.algorithm=gspo_token"]
OLD_PARTS = {"learner_ranks", "learner_optimizer_offload", "checkpoint_export_rank0", "engines", "reward_workers",
             "driver", "object_store_sync", "learner_load_zero3", "total"}


def write_safetensors(path, tensors: dict[str, tuple[str, list[int]]], itemsize: int) -> None:
    """A safetensors file by its format (8-byte little-endian header length, the JSON header, the data), the
    data left as a sparse hole of the right size (zeros, no disk used)."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = itemsize
        for d in shape:
            size *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.truncate(8 + len(raw) + offset)


@pytest.fixture
def judge_folder(tmp_path):
    """A judge model folder of two bfloat16 shards, 2**28 parameters in all (0.5 GiB on disk, 1 GiB in
    float32)."""
    (tmp_path / "config.json").write_text("{}")  # unread: the safetensors headers come first
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [8192, 16384])}, 2)
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors",
                      {"b": ("BF16", [8192, 16000]), "c": ("BF16", [8192, 384])}, 2)
    return tmp_path


def served_overrides(judge_path) -> list[str]:
    """A judge of 2 float32 engines (0.5 CPU, 0.5 GiB KV cache, a custom resource each) on ``judge_path``, and
    a teacher of 1 bfloat16 engine (1 CPU, 0.25 GiB KV cache) serving the policy itself."""
    return [f"reward.judge.model_path={judge_path}", "reward.judge.num_engines=2",
            "reward.judge.num_cpus_per_engine=0.5", "reward.judge.kv_cache_gb=0.5", "reward.judge.dtype=float32", "reward.judge.node_resources={judge_node: 1}",
            "distill.model_path=builtin:tiny_moe", "distill.dtype=bfloat16", "distill.num_cpus_per_engine=1.0",
            "distill.kv_cache_gb=0.25"]


def test_safetensors_headers_give_the_parameter_count(judge_folder, tmp_path_factory):
    assert safetensors_params(judge_folder) == 2**28
    assert safetensors_params(tmp_path_factory.mktemp("empty")) is None
    bad = tmp_path_factory.mktemp("bad")
    (bad / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors header"):
        safetensors_params(bad)


def test_plan_places_and_budgets_the_judge_and_the_teacher(judge_folder):
    """Hand values: the judge's engine holds 1.05 (CPU engine base) + 0.5 (KV) + 4 x 2**28 / 2**30 = 1.0 GiB
    (float32 weights from bfloat16 shards) = 2.55 GiB, two of them 5.1; the teacher serves the policy (same
    model_path and build_seed), so P = 2**30 at bfloat16: 1.05 + 0.25 + 2.0 = 3.3 GiB."""
    base = plan(load_config(TINY, POLICY))
    p = plan(load_config(TINY, POLICY + served_overrides(judge_folder)))
    assert [sm.name for sm in served_models(load_config(TINY, POLICY + served_overrides(judge_folder)))] == [
        "judge", "teacher"]
    # actors on node 0, their CPUs on it and among the logical CPUs (tiny_moe: 0.5 + 0.5 + 0.25 = 1.25)
    node = p["nodes"][0]
    assert node["actors"][-3:] == ["judge engine 0", "judge engine 1", "teacher engine 0"]
    assert base["logical_cpus"] == base["nodes"][0]["cpus"] == 1.25
    assert p["logical_cpus"] == node["cpus"] == 1.25 + 2 * 0.5 + 1.0
    # their placement groups, as model_fleet / services.start_engine asks for them
    assert p["placement"]["judge"] == {"bundles_per_engine": {"CPU": 0.5, "judge_node": 1.0}, "engines": 2,
                                       "strategy": "STRICT_PACK (one group per engine)",
                                       "model_path": str(judge_folder), "section": "reward.judge"}
    assert p["placement"]["teacher"]["bundles_per_engine"] == {"CPU": 1.0}
    assert p["placement"]["teacher"]["engines"] == 1 and p["placement"]["teacher"]["section"] == "distill"
    # host RAM: a part per served model, per process, and how the weights were counted
    host = p["memory"]["host_ram_gib"]
    assert HOST_PROCESS_GIB["engine_cpu"] == 1.05
    assert host["served_models"]["judge"]["per_engine_gib"] == {"base": 1.05, "kv_cache": 0.5, "weights": 1.0,
                                                                "total": 2.55}
    assert host["served_models"]["teacher"]["per_engine_gib"] == {"base": 1.05, "kv_cache": 0.25, "weights": 2.0,
                                                                  "total": 3.3}
    assert "safetensors headers" in host["served_models"]["judge"]["weights"]
    assert host["served_models"]["teacher"]["weights"].startswith("the policy model's")
    assert host["per_process"]["judge_engine"] == 2.55 and host["per_process"]["teacher_engine"] == 3.3
    n0, b0 = host["node 0"], base["memory"]["host_ram_gib"]["node 0"]
    assert (n0["judge_engines"], n0["teacher_engines"]) == (5.1, 3.3)
    assert n0["total"] == pytest.approx(b0["total"] + 5.1 + 3.3, abs=0.011)
    assert {k: v for k, v in n0.items() if k in OLD_PARTS and k != "total"} == {
        k: v for k, v in b0.items() if k != "total"}


def test_served_weights_from_config_json_or_not_counted(tmp_path):
    """A folder with only config.json: the Qwen3-layout count of its shape (SmolLM2-135M's numbers: 134,518,848
    parameters, float32 by default); a hub id not fetched and a builtin of another architecture: no weights, said so (an unknown builtin name is
    refused at load: tests/unit/cluster/test_config.py)."""
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576,
           "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152,
           "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    host = plan(load_config(TINY, [f"reward.judge.model_path={tmp_path}"]))["memory"]["host_ram_gib"]
    judge = host["served_models"]["judge"]
    assert "config.json" in judge["weights"] and "134518848 parameters" in judge["weights"]
    assert judge["per_engine_gib"]["weights"] == round(4 * 134_518_848 / GIB, 2) == 0.5
    for path in ("nobody-here/not-fetched-model", "builtin:tiny_llama"):
        judge = plan(load_config(TINY, [f"reward.judge.model_path={path}"]))["memory"]["host_ram_gib"][
            "served_models"]["judge"]
        assert judge["weights"].startswith("weights not counted: " + path)
        assert judge["per_engine_gib"] == {"base": 1.05, "kv_cache": 0.25, "weights": 0.0, "total": 1.3}


def test_served_builtin_is_built_from_its_seed_alone():
    """A served builtin:tiny_moe is the policy only where the policy has the default build keys: with other keys
    (or model.num_params_b set), the served one counts the default keys' 913,152 parameters."""
    bigger = load_config(TINY, ["model.num_layers=4", "reward.judge.model_path=builtin:tiny_moe"])
    judge = plan(bigger)["memory"]["host_ram_gib"]["served_models"]["judge"]
    assert judge["weights"] == "builtin:tiny_moe at its default build keys: 913152 parameters"
    same = load_config(TINY, ["reward.judge.model_path=builtin:tiny_moe"])
    assert plan(same)["memory"]["host_ram_gib"]["served_models"]["judge"]["weights"].startswith("the policy model's")


def test_served_engines_over_host_memory_are_refused_by_name(judge_folder):
    base = plan(load_config(TINY, POLICY))["memory"]["host_ram_gib"]["node 0"]["total"]
    limit = [f"cluster.host_memory_gib={base + 1.0}"]
    assert plan(load_config(TINY, POLICY + limit))["memory"]["host_ram_gib"]["checked"] is True
    with pytest.raises(PlanError) as err:
        plan(load_config(TINY, POLICY + limit + served_overrides(judge_folder)))
    msg = str(err.value)
    assert msg.startswith(f"host RAM over budget on node 0: {base + 8.4:.1f} GiB needed")
    assert "'judge_engines': 5.1" in msg and "'teacher_engines': 3.3" in msg
    assert "the served judge engines hold 5.1 GiB" in msg and "reward.judge.num_engines=2" in msg
    assert "the served teacher engines hold 3.3 GiB" in msg and "distill.num_engines=1" in msg


def test_plan_without_served_models_is_unchanged():
    """No judge and no teacher: no served key anywhere, the parts and per-process entries of before."""
    p = plan(load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml"))
    assert set(p["placement"]) == {"learner", "rollout", "reward"}
    assert not any("judge" in a or "teacher" in a for a in p["nodes"][0]["actors"])
    host = p["memory"]["host_ram_gib"]
    assert set(host["node 0"]) == OLD_PARTS and "served_models" not in host
    assert set(host["per_process"]) == {"learner_rank", "engine", "reward_worker", "driver"}
    assert served_models(SimpleNamespace(reward=SimpleNamespace(judge=SimpleNamespace(model_path=None)))) == []
    assert served_models(SimpleNamespace(reward=SimpleNamespace())) == []  # a config without either section


def test_cpu_oversubscription_counts_the_judge_beside_the_engines_and_the_teacher_after():
    """tiny_moe_zero2: 1 engine x 2 threads, 2 ranks x 1 thread, on-policy: max(2, 2) fits 2 cores. A 1-thread
    judge scores pieces while the engines generate: max(2 + 1, 2) = 3. A 2-thread teacher runs once the rollout
    is complete: max(max(2, 2), 2) = 2 fits; overlapped, a 3-thread teacher: max(2, 3) + 2 = 5."""
    zero2 = REPO_ROOT / "configs/tiny_moe_zero2.yaml"
    msg = cpu_oversubscription(load_config(zero2, ["reward.judge.model_path=builtin:tiny_moe"]), 2)
    assert msg.startswith("3 compute threads at once on 2 CPU cores") and "reward.judge.threads_per_engine=1" in msg
    teacher = ["learner.algorithm=gspo_token", "distill.model_path=builtin:tiny_moe"]
    assert cpu_oversubscription(load_config(zero2, teacher + ["distill.threads_per_engine=2"]), 2) is None
    over = load_config(zero2, teacher + ["distill.threads_per_engine=3", "trainer.max_staleness=1"])
    msg = cpu_oversubscription(over, 2)
    assert msg.startswith("5 compute threads at once on 2 CPU cores")
    assert "distill.threads_per_engine=3 once the rollout is complete" in msg
    assert cpu_oversubscription(over, 5) is None
