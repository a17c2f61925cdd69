"""The embedded tiny Qwen3-MoE: deterministic build, character tokenizer, shape checks, transformers load."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from cluster.models.resolve import ensure_model
from cluster.models.tiny_model import (
    BUILD_INFO_FILE,
    VOCAB_SIZE,
    build_char_tokenizer,
    build_tiny_moe,
)


def test_same_seed_bit_identical_other_seed_differs(tiny_moe, tmp_path):
    again = build_tiny_moe(tmp_path / "again", seed=0)  # tiny_moe's seed (tests/conftest.py)
    other = build_tiny_moe(tmp_path / "other", seed=1)
    a, b, c = (load_file(p / "model.safetensors") for p in (tiny_moe, again, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if a[k].numel() > 1000)
    assert all(t.dtype == torch.float32 for t in a.values())


def test_build_leaves_caller_rng_untouched(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_moe(tmp_path / "m", seed=0, num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_reuse_when_args_match_rebuild_when_they_differ(tmp_path):
    out = tmp_path / "m"
    build_tiny_moe(out, seed=1, num_layers=1)
    weights = out / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert build_tiny_moe(out, seed=1, num_layers=1) == out
    assert weights.stat().st_mtime_ns == mtime  # reused, not rewritten
    build_tiny_moe(out, seed=2, num_layers=1)
    assert json.loads((out / BUILD_INFO_FILE).read_text())["seed"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_refuses_to_overwrite_a_foreign_folder(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a tiny-model build"):
        build_tiny_moe(tmp_path / "x")
    assert (tmp_path / "x" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"hidden_size": 100}, "hidden_size=100"),
        ({"moe_intermediate_size": 48}, "moe_intermediate_size=48"),
        ({"head_dim": 16}, "head_dim=16"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "num_key_value_heads=3"),
        ({"num_experts": 4, "num_experts_per_tok": 5}, "num_experts_per_tok=5"),
    ],
)
def test_kernel_constraints_are_checked(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_moe(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize(
    "text",
    ["12 + 7 = 19", "  two  spaces\nand a newline\n", "0123456789", "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", ""],
)
def test_tokenizer_round_trip_one_token_per_char(tiny_moe, text):
    from transformers import AutoTokenizer

    for tok in (AutoTokenizer.from_pretrained(tiny_moe), build_char_tokenizer()):
        ids = tok(text, add_special_tokens=True)["input_ids"]
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
        assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text


def test_tokenizer_specials_and_unknown(tiny_moe):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_moe)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == VOCAB_SIZE == 100
    a, b = tok.convert_tokens_to_ids(["a", "b"])
    assert tok("a\tb")["input_ids"] == [a, tok.unk_token_id, b]
    assert len(set(tok.convert_tokens_to_ids(list("az09 \n")))) == 6


def test_transformers_loads_config_and_runs(tiny_moe):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(tiny_moe)
    cfg = model.config
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and model.dtype == torch.float32
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok) == (128, 2, 8, 2)
    assert (cfg.moe_intermediate_size, cfg.head_dim, cfg.vocab_size) == (128, 32, VOCAB_SIZE)
    assert (cfg.eos_token_id, cfg.pad_token_id) == (2, 0)
    assert GenerationConfig.from_pretrained(tiny_moe).eos_token_id == 2
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, VOCAB_SIZE) and torch.isfinite(logits).all()


def test_ensure_model(tmp_path, tiny_moe):
    built = ensure_model("builtin:tiny_moe", tmp_path, seed=3, num_layers=1)
    assert built == tmp_path / "tiny_moe" and (built / "config.json").is_file()
    assert json.loads((built / BUILD_INFO_FILE).read_text())["num_layers"] == 1
    assert ensure_model(str(tiny_moe), tmp_path / "unused") == tiny_moe
    with pytest.raises(FileNotFoundError, match="model.path='/nonexistent/x'"):
        ensure_model("/nonexistent/x", tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ensure_model(str(tmp_path / "empty"), tmp_path)
    with pytest.raises(ValueError, match="builtin:other"):
        ensure_model("builtin:other", tmp_path)


def test_tiny_archs_build_deterministically_and_resolve_as_builtins(tmp_path):
    from cluster.models.tiny_archs import ARCHS, build_tiny_arch

    built = ensure_model("builtin:tiny_qwen2_moe", tmp_path, seed=5, num_layers=7)  # tiny_moe's shape keys ignored
    assert built == tmp_path / "tiny_qwen2_moe"
    cfg = json.loads((built / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2MoeForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert cfg["shared_expert_intermediate_size"] == 64 and cfg["tie_word_embeddings"] is False
    assert json.loads((built / BUILD_INFO_FILE).read_text())["seed"] == 5
    again = build_tiny_arch(tmp_path / "again", "qwen2_moe", seed=5)
    assert (again / "model.safetensors").read_bytes() == (built / "model.safetensors").read_bytes()
    other = build_tiny_arch(tmp_path / "other", "qwen2_moe", seed=6)
    assert (other / "model.safetensors").read_bytes() != (built / "model.safetensors").read_bytes()
    tied = json.loads((build_tiny_arch(tmp_path / "tied", "qwen3_moe_tied") / "config.json").read_text())
    assert tied["tie_word_embeddings"] is True and tied["architectures"] == ["Qwen3MoeForCausalLM"]
    assert set(ARCHS) >= {"llama", "qwen3_tied", "qwen3_moe", "qwen3_moe_tied", "mixtral", "qwen2_moe", "olmoe"}
    with pytest.raises(ValueError, match="builtin:tiny_gpt2"):
        ensure_model("builtin:tiny_gpt2", tmp_path)
    with pytest.raises(ValueError, match="arch='gpt2'"):
        build_tiny_arch(tmp_path / "x", "gpt2")
