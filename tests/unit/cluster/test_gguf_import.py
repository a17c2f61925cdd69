"""``gspo-import-gguf`` on small GGUF files written here with the ``gguf`` package (llama.cpp's own writer): a
2-layer llama with a byte-level BPE tokenizer, a chat template, float32 and Q8_0 tensors and tied embeddings.
The converted folder's logits equal those of transformers' GGUF loader on the same file."""

import json

import numpy as np
import pytest
import torch

from cluster.models.gguf_import import gguf_model_type, import_gguf, main

gguf = pytest.importorskip("gguf")

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 2, 1, 128, 2
SPECIALS = ["<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return list(bytes_to_unicode().values())


def write_tiny_llama(path, arch="llama", seed=0):
    """A GGUF llama file: byte-level BPE vocabulary (256 bytes, one merge, two specials; EOS <|im_end|>)."""
    rng = np.random.default_rng(seed)
    tokens = byte_tokens() + ["Ġt"] + SPECIALS
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(256)
    w.add_block_count(LAYERS)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    w.add_chat_template(CHAT_TEMPLATE)

    def f32(name, *shape):
        w.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))

    def q8(name, *shape):
        data = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        quant = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, quant, raw_shape=quant.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)

    f32("token_embd.weight", vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        f32(f"blk.{i}.attn_norm.weight", HIDDEN)
        f32(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        f32(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        f32(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        f32(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        f32(f"blk.{i}.ffn_norm.weight", HIDDEN)
        q8(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
        q8(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
        q8(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    f32("output_norm.weight", HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_converted_folder_matches_the_gguf_model(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    summary = import_gguf(tiny_gguf, out)
    assert summary["model_type"] == "llama" and summary["tie_word_embeddings"] and summary["chat_template"]
    vocab = len(byte_tokens()) + 3
    assert summary["eos_token_ids"] == [vocab - 1] and summary["vocab_size"] == vocab
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == vocab - 1
    assert (out / "model.safetensors").is_file()

    source = AutoModelForCausalLM.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name,
                                                  dtype=torch.float32).eval()
    converted = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tok_src = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    tok = AutoTokenizer.from_pretrained(str(out))
    chat = [{"role": "user", "content": "what is 12 + 30? tell me"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text == tok_src.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text)["input_ids"]
    assert ids == tok_src(text)["input_ids"] and ids[0] == vocab - 2
    with torch.no_grad():
        a = source(torch.tensor([ids])).logits
        b = converted(torch.tensor([ids])).logits
    assert a.shape == (1, len(ids), vocab)
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    assert converted.lm_head.weight.data_ptr() == converted.model.embed_tokens.weight.data_ptr()


def test_bfloat16_through_the_command_line(tiny_gguf, tmp_path, capsys):
    from safetensors import safe_open

    assert main([str(tiny_gguf), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert "model_type: llama" in capsys.readouterr().out
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_unsupported_architecture_and_bad_options_are_refused(tmp_path, capsys):
    bad = write_tiny_llama(tmp_path / "rwkv.gguf", arch="rwkv6")
    with pytest.raises(ValueError, match=r"rwkv6.*llama"):
        gguf_model_type(bad)
    assert main([str(bad), str(tmp_path / "out")]) == 2
    assert "rwkv6" in capsys.readouterr().err and not (tmp_path / "out").exists()
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    with pytest.raises(ValueError, match="dtype='float16'"):
        import_gguf(bad, tmp_path / "out", dtype="float16")
