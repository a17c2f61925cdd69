"""LoRA (learner/lora.py) without services: the config section, the merge the engines get (against the LoRA
equation by hand and against peft's own merge_and_unload), what may be adapted, the dropout switch, and the
checkpoint parts with the merge command's round trip."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from learner import lora
from learner.config import DEFAULT_TARGETS, LearnerConfig, LoraConfigSection


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).float().eval()


def tiny_moe(seed: int = 0):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=40, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, decoder_sparse_step=1, mlp_only_layers=[])
    return Qwen3MoeForCausalLM(cfg).float().eval()


def randomise_adapter(model, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


# -- config ---------------------------------------------------------------------------------------------------

def test_lora_section_defaults_off_and_validates():
    assert not lora.enabled(LearnerConfig().lora)
    assert not lora.enabled(LoraConfigSection(rank=0))
    on = LoraConfigSection(rank=4)
    assert lora.enabled(on) and on.target_modules == list(DEFAULT_TARGETS) and on.alpha is None
    assert lora.peft_config(on).lora_alpha == 4.0  # alpha None = rank: scale 1
    assert lora.peft_config(LoraConfigSection(rank=4, alpha=16)).lora_alpha == 16.0
    for bad in ({"rank": -1}, {"rank": 4, "alpha": 0}, {"rank": 4, "dropout": 1.0}, {"rank": 4, "target_modules": []},
                {"rank": 4, "target_modules": ""}, {"rank": 4, "bogus": 1}):
        with pytest.raises(ValidationError):
            LoraConfigSection(**bad)
    with pytest.raises(ValidationError, match="learner.router_lr_scale"):
        LearnerConfig(router_lr_scale=2.0, lora={"rank": 4})
    assert LearnerConfig(router_lr_scale=2.0, lora={"rank": 0}).router_lr_scale == 2.0
    with pytest.raises(ValidationError, match="learner.zero_stage=3 on GPUs"):
        LearnerConfig(zero_stage=3, num_gpus_per_rank=1, lora={"rank": 4})
    assert LearnerConfig(zero_stage=3, lora={"rank": 4}).lora.rank == 4  # the CPU builds full copies: fine
    cfg = LearnerConfig(lora={"rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"], "dropout": 0.1})
    assert (cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules, cfg.lora.dropout) == (8, 16, ["q_proj", "v_proj"],
                                                                                           0.1)


# -- merge -----------------------------------------------------------------------------------------------------

def test_merged_bucket_is_w0_plus_scaled_ba_by_hand():
    """One q_proj with hand-set A and B: merged = W0 + (alpha / r) B A (Hu et al. 2021, Eq. 3)."""
    model = lora.wrap(tiny_llama(), LoraConfigSection(rank=2, alpha=6, target_modules=["q_proj"]))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        layer.lora_A["default"].weight.zero_()
        layer.lora_B["default"].weight.zero_()
        layer.lora_A["default"].weight[0, 0] = 1.0  # A = e_0^T on row 0
        layer.lora_B["default"].weight[3, 0] = 2.0  # B[3, 0] = 2: B A has the single entry (3, 0) = 2
    params = {n: p.detach() for n, p in model.named_parameters()}
    base, merged = lora.merged_bucket(model, params)
    assert base is model.get_base_model()
    assert not any(".lora_" in k or ".base_layer." in k for k in merged)
    w0 = layer.base_layer.weight.detach()
    want = w0.clone()
    want[3, 0] += 2.0 * (6 / 2)  # scale alpha / r = 3
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], want)
    assert torch.equal(merged["model.layers.1.self_attn.q_proj.weight"], model.base_model.model.model.layers[1]
                       .self_attn.q_proj.base_layer.weight.detach())  # B = 0 there: W0 itself
    assert torch.equal(merged["model.embed_tokens.weight"], params["base_model.model.model.embed_tokens.weight"])


def test_merged_state_matches_peft_merge_and_unload_and_the_forward():
    model = lora.wrap(tiny_llama(), LoraConfigSection(rank=4, alpha=8))
    randomise_adapter(model)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    with torch.no_grad():
        want_logits = model(input_ids=ids).logits
    state = lora.merged_checkpoint_state(model)
    reference = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    assert set(state) == set(reference) - {"lm_head.weight"} or set(state) == set(reference)
    for k, v in state.items():
        assert torch.allclose(v, reference[k], atol=1e-6, rtol=0), k
    plain = tiny_llama()
    plain.load_state_dict(state, strict=False)
    with torch.no_grad():
        assert (plain(input_ids=ids).logits - want_logits).abs().max().item() < 1e-5


def test_merged_bucket_refuses_a_layer_cut_from_its_adapter():
    model = lora.wrap(tiny_llama(), LoraConfigSection(rank=2, target_modules=["q_proj"]))
    bucket = {n: p.detach() for n, p in model.named_parameters() if "layers.0.self_attn.q_proj.base_layer" in n}
    with pytest.raises(KeyError, match="lora_A"):
        lora.merged_bucket(model, bucket)


def test_plain_model_passes_through():
    model = tiny_llama()
    tensors = {n: p.detach() for n, p in model.named_parameters()}
    assert lora.merged_bucket(model, tensors) == (model, tensors)


def test_moe_default_targets_leave_experts_and_router_frozen_and_refuse_them_when_named():
    model = lora.wrap(tiny_moe(), LoraConfigSection(rank=2))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n and "self_attn" in n for n in trainable)
    for targets in ("all-linear", ["q_proj", "down_proj"]):  # peft maps down_proj onto the fused experts
        with pytest.raises(ValueError, match="only plain linear layers"):
            lora.wrap(tiny_moe(), LoraConfigSection(rank=2, target_modules=targets))
    with pytest.raises(ValueError, match="learner.lora.target_modules"):
        lora.wrap(tiny_llama(), LoraConfigSection(rank=2, target_modules=["no_such_proj"]))


def test_dropout_is_switched_alone():
    model = lora.wrap(tiny_llama(), LoraConfigSection(rank=2, dropout=0.5))
    model.eval()
    lora.set_dropout(model, True)
    drops = [m for n, m in model.named_modules() if ".lora_dropout." in n]
    assert drops and all(m.training for m in drops)
    assert not any(m.training for n, m in model.named_modules() if ".lora_dropout." not in n and n)
    lora.set_dropout(model, False)
    assert not any(m.training for m in drops)


# -- checkpoint parts and the merge command ----------------------------------------------------------------

def test_checkpoint_parts_and_merge_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    from learner.lora_merge import main

    model = lora.wrap(tiny_llama(), LoraConfigSection(rank=4, alpha=8))
    randomise_adapter(model)
    state = {n: p.detach().clone() for n, p in model.named_parameters()}
    lora.save_checkpoint_parts(model, tmp_path / "learner", state, "hf")
    adapter = tmp_path / "learner" / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")
    assert (adapter / "adapter_model.safetensors").is_file()
    (tmp_path / "learner" / "learner_state.json").write_text('{"lora": true}')
    assert main([str(tmp_path / "learner"), str(tmp_path / "merged")]) == 0
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        for folder in ("merged", "learner/hf"):
            got = AutoModelForCausalLM.from_pretrained(tmp_path / folder, dtype=torch.float32)(input_ids=ids).logits
            assert (got - want).abs().max().item() < 1e-5, folder
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "learner" / "lora_base", dtype=torch.float32)
        assert (base(input_ids=ids).logits - tiny_llama()(input_ids=ids).logits).abs().max().item() == 0.0


def test_merge_command_names_a_folder_without_adapter(tmp_path, capsys):
    from learner.lora_merge import main

    assert main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "adapter" in capsys.readouterr().err
