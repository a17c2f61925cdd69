"""The shared-files check of cluster/runtime/node_files.py on real folders (fast, no cluster): what a node sees
(``look``) and how it is compared with the driver's view (``compare``), the served models' folders
(``reward.judge.model_path``, ``distill.model_path``) included, and ``check_nodes`` over a fake cluster. The
per-node tasks run in tests/test_multinode.py on a 3-node cluster."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest

from cluster.config import ConfigError
from cluster.runtime import node_files
from cluster.runtime.node_files import compare, look, served_folders


def _model(folder, vocab: str = '{"a": 0}'):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"hidden_size": 128}')
    (folder / "tokenizer.json").write_text(vocab)
    (folder / "model.safetensors").write_bytes(b"\0" * 64)
    return folder


def _look(model, tmp_path, verifiers=()):
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text('{"q": 1}\n')
    return look(str(model), [str(data)], str(tmp_path), list(verifiers))


def test_the_same_files_compare_equal(tmp_path):
    model = _model(tmp_path / "m")
    mine = _look(model, tmp_path, ["json:dumps"])
    assert mine["model"]["config.json"][1] and mine["model"]["model.safetensors"] == [64, None]
    assert compare(mine, _look(model, tmp_path, ["json:dumps"]), "n1", {"model": str(model), "output": "o"}) == []


def test_a_changed_tokenizer_a_missing_weight_file_and_data_file_are_named(tmp_path):
    driver = _model(tmp_path / "driver")
    node = _model(tmp_path / "node", vocab='{"b": 0}')  # same size, other content
    (node / "model.safetensors").unlink()
    mine = _look(driver, tmp_path)
    theirs = _look(node, tmp_path)
    theirs["data"] = {p: None for p in theirs["data"]}
    problems = compare(mine, theirs, "abc (10.0.0.2)", {"model": str(driver), "output": "o"})
    assert any("abc (10.0.0.2)" in p and "tokenizer.json" in p and "content" in p for p in problems)
    assert any("model.safetensors is missing" in p for p in problems)
    assert any("train.jsonl is missing" in p for p in problems)
    assert not any("config.json" in p for p in problems)


def test_a_missing_model_folder_output_folder_and_verifier_are_named(tmp_path):
    model = _model(tmp_path / "m")
    mine = _look(model, tmp_path)
    theirs = look(str(tmp_path / "nowhere"), [], str(tmp_path / "no-out"), ["no_such_module_x:score"])
    problems = compare(mine, theirs, "n2", {"model": str(tmp_path / "nowhere"), "output": "o"})
    assert problems == [f"node n2: model.path {tmp_path / 'nowhere'} does not exist there"]
    shutil.copytree(model, tmp_path / "nowhere")
    theirs = look(str(tmp_path / "nowhere"), [], str(tmp_path / "no-out"), ["no_such_module_x:score"])
    problems = compare(mine, theirs, "n2", {"model": str(model), "output": str(tmp_path / "no-out")})
    assert any("trainer.output_dir" in p and "no-out" in p for p in problems)
    assert any("no_such_module_x:score does not import" in p and "ModuleNotFoundError" in p for p in problems)


def _served_cfg(teacher: str | None = None, judge: str | None = None):
    """A config-like object with the served models' sections (``served_models`` reads only these)."""
    return SimpleNamespace(reward=SimpleNamespace(judge=SimpleNamespace(model_path=judge)),
                           distill=SimpleNamespace(model_path=teacher))


def test_served_folders_are_the_local_folders_of_the_models_that_are_on(tmp_path):
    teacher = str(tmp_path / "teacher")
    assert served_folders(_served_cfg(teacher, "builtin:tiny_moe")) == {"distill.model_path": teacher}
    assert served_folders(_served_cfg("HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path / "j"))) == {
        "reward.judge.model_path": str(tmp_path / "j")}
    assert served_folders(_served_cfg()) == {}


def test_a_teacher_folder_that_differs_on_another_node_is_named_with_its_field(tmp_path):
    model = _model(tmp_path / "m")
    driver_teacher = _model(tmp_path / "driver_teacher")
    node_teacher = _model(tmp_path / "node_teacher", vocab='{"c": 0}')  # same size, other tokenizer
    (node_teacher / "model.safetensors").write_bytes(b"\0" * 32)
    data = tmp_path / "train.jsonl"
    data.write_text('{"q": 1}\n')
    mine = look(str(model), [str(data)], str(tmp_path), [], {"distill.model_path": str(driver_teacher)})
    theirs = look(str(model), [str(data)], str(tmp_path), [], {"distill.model_path": str(node_teacher)})
    problems = compare(mine, theirs, "w1 (10.0.0.2)", {"model": str(model), "output": "o"})
    assert problems == [
        f"node w1 (10.0.0.2): distill.model_path {driver_teacher}/model.safetensors differs from the driver's (size)",
        f"node w1 (10.0.0.2): distill.model_path {driver_teacher}/tokenizer.json differs from the driver's "
        "(content (SHA-256))"]


def test_a_served_folder_missing_on_another_node_is_refused_naming_node_field_and_path(tmp_path):
    model = _model(tmp_path / "m")
    judge = _model(tmp_path / "judge")
    mine = look(str(model), [], str(tmp_path), [], {"reward.judge.model_path": str(judge)})
    theirs = look(str(model), [], str(tmp_path), [], {"reward.judge.model_path": str(tmp_path / "not_here")})
    assert compare(mine, theirs, "w2 (10.0.0.3)", {"model": str(model), "output": "o"}) == [
        f"node w2 (10.0.0.3): reward.judge.model_path {judge} does not exist there"]
    theirs = look(str(tmp_path / "no_model"), [], str(tmp_path), [], {"reward.judge.model_path": str(judge)})
    assert compare(mine, theirs, "w2", {"model": str(model), "output": "o"}) == [
        f"node w2: model.path {model} does not exist there"]  # the same judge folder: only the model is named
    assert compare(mine, look(str(model), [], str(tmp_path), [], {"reward.judge.model_path": str(judge)}),
                   "w2", {"model": str(model), "output": "o"}) == []


def test_check_nodes_refuses_a_teacher_folder_another_node_lacks(tmp_path, monkeypatch):
    """``check_nodes`` end to end with a fake cluster: the task of the other node sees no teacher folder."""
    import ray

    head, worker = "aa" * 28, "bb" * 28  # Ray's hex node ids
    model, teacher = _model(tmp_path / "m"), _model(tmp_path / "teacher")
    cfg = SimpleNamespace(data=SimpleNamespace(task="arithmetic", train_path=None, test_path=None),
                          trainer=SimpleNamespace(output_dir=str(tmp_path)),
                          reward=SimpleNamespace(judge=SimpleNamespace(model_path=None)),
                          distill=SimpleNamespace(model_path=str(teacher)))

    class _Task:
        """``ray.remote(look)``: runs ``look`` here; on the worker the teacher folder is not there."""

        def options(self, scheduling_strategy=None, **_):
            self.node = scheduling_strategy.node_id
            return self

        def remote(self, *args):
            if self.node == worker:
                args = (*args[:4], {field: str(tmp_path / "gone") for field in args[4]})
            return look(*args)

    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": n, "Alive": True, "NodeManagerAddress": ip}
                                               for n, ip in ((head, "10.0.0.1"), (worker, "10.0.0.2"))])
    monkeypatch.setattr(ray, "remote", lambda fn: _Task())
    monkeypatch.setattr(ray, "get", lambda refs: refs)
    with pytest.raises(ConfigError) as err:
        node_files.check_nodes(cfg, str(model), [], {})
    assert str(err.value).endswith(f"node bbbbbbbbbbbb (10.0.0.2): distill.model_path {teacher} does not exist there")
    assert "aaaaaaaaaaaa" not in str(err.value)  # the driver's node sees the same folder
