"""Rows from your own files (``data.task: files``): each file type, globs, ``save_to_disk`` folders, chat
prompts, templates, the errors and skips, the seeded held-out split; the prompt encoder (chat template, system
prompt, BOS never doubled) on tokenizers built here; the engine's EOS ids."""

from __future__ import annotations

import json
import logging

import pytest

from cluster.config import ConfigError, load_config
from cluster.config_sections import DataConfig
from cluster.data.files import file_rows
from cluster.data.prompting import PromptEncoder, PromptError, tokenizer_adds_bos
from cluster.data.prompts import DataError, resolve_data_path
from cluster.models.tiny_model import build_char_tokenizer
from rollout.vllm_setup import eos_token_ids
from tests.helpers import REPO_ROOT
from tests.helpers.data_files import BOS, EOS, chars, write_jsonl

# A chat template that writes the BOS itself (as Llama-3's and Gemma's do), one line per message.
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


ROWS = [{"task_text": f"What is {i} + {i}?", "gold": 2 * i, "checker": "exact" if i % 2 else None,
         "tests": [f"assert f({i}) == {2 * i}"]} for i in range(10)]


def _tokenizer(tmp_path, name, *, chat=False, add_bos=False):
    """The character tokenizer, optionally with ``CHAT_TEMPLATE`` and/or settings that add a BOS, saved to
    ``tmp_path/name`` and loaded back with ``AutoTokenizer`` (what a run does with a model folder)."""
    from transformers import AutoTokenizer

    tok = build_char_tokenizer()
    if chat:
        tok.chat_template = CHAT_TEMPLATE
    tok.add_bos_token = add_bos
    tok.save_pretrained(tmp_path / name)
    return AutoTokenizer.from_pretrained(tmp_path / name)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("toks")
    return {"plain": _tokenizer(root, "plain"), "bos": _tokenizer(root, "bos", add_bos=True),
            "chat": _tokenizer(root, "chat", chat=True), "chat_bos": _tokenizer(root, "chat_bos", chat=True, add_bos=True)}


def cfg(path, **kw):
    base = {"task": "files", "train_path": str(path), "prompt_key": "task_text", "answer_key": "gold",
            "max_prompt_tokens": 200}
    return DataConfig(**{**base, **kw})


def plain(text):  # the encoder of the character tokenizer without chat template or BOS: text as it is
    return text, chars(text)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_each_file_type_gives_the_same_rows(tmp_path, fmt):
    from datasets import Dataset

    ds = Dataset.from_list([{k: r[k] for k in ("task_text", "gold")} for r in ROWS])
    path = tmp_path / f"rows.{fmt}"
    {"jsonl": lambda: ds.to_json(path), "json": lambda: path.write_text(json.dumps(ds.to_list())),
     "parquet": lambda: ds.to_parquet(path), "csv": lambda: ds.to_csv(path, index=False)}[fmt]()
    test = write_jsonl(tmp_path / "test.jsonl", [{"task_text": "What is 7 + 1?", "gold": "8"}])
    train, held = file_rows(cfg(path, test_path=str(test)), plain)
    assert [r.uid for r in train] == [f"train/{i}" for i in range(10)]
    assert [r.prompt for r in train] == [r["task_text"] for r in ROWS]
    assert [r.answer for r in train] == [str(2 * i) for i in range(10)]  # numbers become text
    assert train[3].prompt_token_ids == chars("What is 3 + 3?") and train[3].verifier == "math"
    assert [(r.uid, r.answer) for r in held] == [("eval/0", "8")]


def test_glob_reads_files_in_sorted_order_with_file_names_in_uids(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", ROWS[5:])
    write_jsonl(tmp_path / "a.jsonl", ROWS[:5])
    (tmp_path / "notes.txt").write_text("not data")
    train, _ = file_rows(cfg(tmp_path / "*.jsonl", test_path=str(tmp_path / "a.jsonl")), plain)
    assert [r.uid for r in train][:6] == [f"train/a.jsonl/{i}" for i in range(5)] + ["train/b.jsonl/0"]
    assert [r.answer for r in train] == [str(2 * i) for i in range(10)]
    with pytest.raises(DataError, match=r"data.test_path=.*no file matches"):
        file_rows(cfg(tmp_path / "a.jsonl", test_path=str(tmp_path / "*.parquet")), plain)


def test_save_to_disk_folders_dataset_and_dataset_dict(tmp_path):
    from datasets import Dataset, DatasetDict

    ds = Dataset.from_list([{k: r[k] for k in ("task_text", "gold")} for r in ROWS])
    ds.save_to_disk(str(tmp_path / "one"))
    DatasetDict({"train": ds.select(range(8)), "test": ds.select(range(8, 10))}).save_to_disk(str(tmp_path / "two"))
    train, held = file_rows(cfg(tmp_path / "one", test_path=str(tmp_path / "two")), plain)
    assert len(train) == 10 and [r.answer for r in held] == ["16", "18"]  # test_path takes the "test" split
    train, _ = file_rows(cfg(tmp_path / "two", test_path=str(tmp_path / "one")), plain)
    assert len(train) == 8
    (tmp_path / "loose").mkdir()
    write_jsonl(tmp_path / "loose" / "x.jsonl", ROWS)
    with pytest.raises(DataError, match=r"not written by datasets' save_to_disk.*glob"):
        file_rows(cfg(tmp_path / "loose", test_path=str(tmp_path / "one")), plain)


def test_verifier_meta_and_solution_fields(tmp_path):
    rows = [{**r, "worked": f"{r['gold']}"} for r in ROWS]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    train, _ = file_rows(cfg(path, verifier_key="checker", meta_keys=["tests"], solution_key="worked",
                             verifier="math", test_path=str(path)), plain)
    by_uid = {r.uid: r for r in train}
    assert by_uid["train/1"].verifier == "exact" and by_uid["train/2"].verifier == "math"  # None -> data.verifier
    assert by_uid["train/3"].meta == {"tests": ["assert f(3) == 6"], "solution": "6"}


def test_missing_field_names_key_file_and_row(tmp_path):
    path = write_jsonl(tmp_path / "mine.jsonl", [{"question": "q", "answer": "1"}])
    with pytest.raises(DataError) as err:
        file_rows(DataConfig(task="files", train_path=str(path), test_path=str(path)), plain)
    msg = str(err.value)
    assert "data.prompt_key names field 'prompt'" in msg and "mine.jsonl" in msg and "data.train_path" in msg
    assert "row 0 has fields ['answer', 'question']" in msg
    with pytest.raises(DataError, match=r"data.meta_keys names field 'tests'.*mine.jsonl"):
        file_rows(DataConfig(task="files", train_path=str(path), test_path=str(path), prompt_key="question",
                             meta_keys=["tests"]), plain)
    with pytest.raises(DataError, match=r"data.prompt_template names field 'topic'"):
        file_rows(DataConfig(task="files", train_path=str(path), test_path=str(path),
                             prompt_template="About {topic}: {question}"), plain)


def test_bad_rows_are_counted_and_skipped(tmp_path, caplog):
    rows = [{"task_text": "ok?", "gold": 1}, {"task_text": "", "gold": 2}, {"task_text": "no gold"},
            {"task_text": "x" * 300, "gold": 3}, {"task_text": "list gold", "gold": [1, 2]},
            {"task_text": [{"role": "user", "content": "chat without template"}], "gold": 4}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with caplog.at_level(logging.WARNING):
        train, _ = file_rows(cfg(path, test_path=str(path)), PromptEncoder(build_char_tokenizer()).encode)
    assert [r.answer for r in train] == ["1"]
    assert "bad.jsonl row 2: no value for field 'gold' (data.answer_key)" in caplog.text
    assert "bad.jsonl row 1: empty prompt" in caplog.text
    assert "bad.jsonl row 5: the prompt is a list of chat messages but no chat template" in caplog.text
    assert "prompt of 300 tokens exceeds data.max_prompt_tokens=200" in caplog.text
    assert "answer field 'gold' is a list" in caplog.text
    # a file datasets refuses as a whole (a broken line) is read line by line: the bad line alone is skipped
    broken = tmp_path / "broken.jsonl"
    broken.write_bytes(b'{"task_text": "fine", "gold": 5}\n{"task_text": broken\n\xff\xfe\n')
    train, _ = file_rows(cfg(broken, test_path=str(broken)), plain)
    assert [r.answer for r in train] == ["5"]


def test_prompt_template_fills_row_fields(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"topic": " sums ", "q": "1+1?", "a": "2"}, {"topic": "", "q": "x", "a": "1"}])
    d = DataConfig(task="files", train_path=str(path), test_path=str(path), answer_key="a",
                   prompt_template="Topic: {topic}\n{q} {{literal}}")
    train, _ = file_rows(d, plain)
    assert [r.prompt for r in train] == ["Topic: sums\n1+1? {literal}"]  # row 1: empty field -> skipped


def test_eval_fraction_split_is_seeded_and_disjoint(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"task_text": f"p{i}", "gold": i} for i in range(40)])

    def split(seed, **kw):
        train, held = file_rows(cfg(path, seed=seed, eval_fraction=0.25, **kw), plain)
        return [r.uid for r in train], [r.uid for r in held]

    tr, ev = split(5)
    assert split(5) == (tr, ev) and len(ev) == 10 and len(tr) == 30
    assert not {u.split("/")[1] for u in tr} & {u.split("/")[1] for u in ev}
    assert sorted(int(u.split("/")[1]) for u in tr + ev) == list(range(40))
    assert split(6)[1] != ev
    assert split(5, num_eval=4)[1] == ev[:4] and split(5, num_train=3)[0] == tr[:3]  # limits do not move the split


def test_relative_paths_from_the_working_directory_then_the_repo_root(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "mine.jsonl", ROWS)
    monkeypatch.chdir(tmp_path)
    assert resolve_data_path("mine.jsonl") == tmp_path.joinpath("mine.jsonl").relative_to(tmp_path)
    assert resolve_data_path("m*.jsonl").resolve().parent == tmp_path.resolve()
    assert resolve_data_path("configs/tiny_moe_zero2.yaml") == REPO_ROOT / "configs/tiny_moe_zero2.yaml"  # the old rule
    train, _ = file_rows(cfg("mine.jsonl", test_path="mine.jsonl"), plain)
    assert len(train) == 10


def test_config_checks_name_the_key():
    with pytest.raises(ConfigError, match=r"data.task='files' needs data.train_path"):
        load_config(None, ["data.task=files", "warm_start.steps=0"])
    with pytest.raises(ConfigError, match=r"warm_start.steps=\d+ with data.task='files' needs data.solution_key"):
        load_config(REPO_ROOT / "configs/tiny_moe_zero2.yaml", ["data.task=files", "data.train_path=x.jsonl"])
    with pytest.raises(ConfigError, match=r"data.prompt_template=.*must name row fields"):
        load_config(None, ["data.prompt_template=no fields here"])
    with pytest.raises(ConfigError, match=r"data.eval_fraction"):
        load_config(None, ["data.eval_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"data.apply_chat_template"):
        load_config(None, ["data.apply_chat_template=sometimes"])


def test_bos_only_when_the_tokenizer_adds_one_and_never_twice(toks):
    assert not tokenizer_adds_bos(toks["plain"]) and tokenizer_adds_bos(toks["bos"])
    assert PromptEncoder(toks["plain"]).encode("1+2=") == ("1+2=", chars("1+2="))
    assert PromptEncoder(toks["bos"]).encode("1+2=") == ("1+2=", [BOS, *chars("1+2=")])
    assert PromptEncoder(toks["bos"]).encode("<bos>1+2=")[1] == [BOS, *chars("1+2=")]  # text with its own BOS
    assert PromptEncoder(toks["plain"]).encode("<bos><bos>1")[1] == [BOS, *chars("1")]
    assert EOS not in PromptEncoder(toks["bos"]).ids("1+2=")


@pytest.mark.parametrize("which", ["chat", "chat_bos"])
def test_chat_template_auto_true_false(toks, which):
    tok = toks[which]
    text, ids = PromptEncoder(tok, "auto").encode("1+2=")
    assert text == "<bos>[user]1+2=\n[assistant]"
    assert ids == [BOS, *chars("[user]1+2=\n[assistant]")]  # the template's BOS, none added on top
    assert PromptEncoder(tok, True).encode("1+2=") == (text, ids)
    off = PromptEncoder(tok, False)
    assert off.encode("1+2=")[1] == ([BOS] if which == "chat_bos" else []) + chars("1+2=")
    with pytest.raises(PromptError, match="list of chat messages but no chat template"):
        off.encode([{"role": "user", "content": "hi"}])
    assert PromptEncoder(toks["plain"], "auto").encode("1+2=")[0] == "1+2="  # no template: plain
    with pytest.raises(PromptError, match="data.apply_chat_template=true but the model's tokenizer has no chat"):
        PromptEncoder(toks["plain"], True)


def test_chat_messages_and_system_prompt(toks, tmp_path):
    enc = PromptEncoder(toks["chat"], "auto", system_prompt="Be brief.")
    assert enc.render("1+2=") == "<bos>[system]Be brief.\n[user]1+2=\n[assistant]"
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi", "name": "extra"}]
    assert enc.render(own) == "<bos>[system]Mine.\n[user]hi\n[assistant]"  # the row's own system message wins
    with pytest.raises(PromptError, match="chat message 0 must be a dict"):
        enc.render([{"role": "user"}])
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": own, "gold": "1"}, {"messages": "plain text", "gold": "2"}])
    train, _ = file_rows(DataConfig(task="files", train_path=str(path), test_path=str(path), prompt_key="messages",
                                    answer_key="gold"), enc.encode)
    assert [r.prompt for r in train] == ["<bos>[system]Mine.\n[user]hi\n[assistant]",
                                         "<bos>[system]Be brief.\n[user]plain text\n[assistant]"]
    assert train[0].prompt_token_ids.count(BOS) == 1


def test_eos_ids_from_every_source():
    assert eos_token_ids({"eos_token_id": [151645, 151643]}, 151643, 151645) == [151643, 151645]
    assert eos_token_ids({"eos_token_id": 7}, None, 2) == [2, 7]
    assert eos_token_ids(None, [3, 3], None) == [3]
    assert eos_token_ids({}, None, None) == []
    with pytest.raises(ValueError, match=r"generation_config.eos_token_id=\['x'\]"):
        eos_token_ids({"eos_token_id": ["x"]}, None, 2)
