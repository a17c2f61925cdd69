"""model.path as a hub id (cluster/models/hub_model.py): told apart from local folders, fetched through
huggingface_hub, refused with the cause when the hub does not give it (here: offline, nothing cached)."""

import pytest

from cluster.models.hub_model import is_hub_id
from cluster.models.resolve import ensure_model


def test_hub_ids_and_local_paths(tmp_path, monkeypatch):
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M-Instruct")
    for local in ("./a/b", "/abs/x", "a/b/c", "builtin:tiny_moe", "name"):
        assert not is_hub_id(local)
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert not is_hub_id("org/model", cwd=tmp_path) and is_hub_id("org/model", cwd=tmp_path / "org")


def test_train_keeps_hub_ids_and_refuses_an_unreachable_one(tmp_path, monkeypatch):
    from cluster.config import load_config
    from cluster.config import absolute_paths

    cfg = absolute_paths(load_config("configs/smollm2_arith.yaml", ["model.path=HuggingFaceTB/SmolLM2-135M-Instruct"]),
                         cwd=tmp_path)
    assert cfg.model.path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(FileNotFoundError, match=r"model.path='HuggingFaceTB/SmolLM2-135M-Instruct'.*make real-model"):
        ensure_model("HuggingFaceTB/SmolLM2-135M-Instruct", tmp_path)
