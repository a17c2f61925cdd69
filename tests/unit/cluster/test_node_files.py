"""The shared-files check of cluster/runtime/node_files.py on real folders (fast, no cluster): what a node sees
(``look``) and how it is compared with the driver's view (``compare``). The per-node tasks run in
tests/test_multinode.py on a 3-node cluster."""

from __future__ import annotations

import shutil

from cluster.runtime.node_files import compare, look


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
