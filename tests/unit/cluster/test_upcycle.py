"""``gspo-upcycle``: a dense Llama upcycled into a Mixtral (cluster/models/upcycle.py), on tiny local models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cluster.models import upcycle as up

SMOLLM2 = Path(__file__).resolve().parents[3] / "models" / "smollm2-135m-instruct"


_tiny_llama = up.build_tiny_llama


@pytest.fixture(scope="module")
def dense_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dense")
    return {tied: _tiny_llama(root / f"llama_tied{int(tied)}", tied) for tied in (True, False)}


@pytest.fixture(scope="module")
def dense_models(dense_dirs):
    from transformers import AutoModelForCausalLM

    return {tied: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for tied, d in dense_dirs.items()}


def _experts(moe, layer: int):
    e = moe.model.layers[layer].mlp.experts
    return e.gate_up_proj.detach(), e.down_proj.detach()


@pytest.mark.parametrize("tied", [True, False])
def test_zero_noise_saved_mixtral_has_the_dense_logits(dense_dirs, dense_models, tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "moe"
    summary = up.upcycle(dense_dirs[tied], out, experts=4, top_k=2, noise=0.0, seed=3, log=lambda *_: None)
    assert summary["max_abs_logit_diff"] <= 1e-5
    assert abs(summary["mean_token_kl"]) <= 1e-7
    assert json.loads((out / up.INFO_FILE).read_text())["max_abs_logit_diff"] == summary["max_abs_logit_diff"]
    assert not list(tmp_path.glob(".moe.tmp-*")), "the temporary folder is left behind"

    moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    cfg, dcfg = moe.config, dense_models[tied].config
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.sliding_window) == (4, 2, None)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(cfg, key) == getattr(dcfg, key), key
    assert cfg.rope_parameters["rope_theta"] == dcfg.rope_parameters["rope_theta"] == 50000.0
    assert cfg.tie_word_embeddings is tied
    if tied:
        assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    else:
        assert torch.equal(moe.lm_head.weight, dense_models[tied].lm_head.weight)

    # the tokenizer is the dense one, and the logits match on prompts other than the built-in checks
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(dense_dirs[tied]).get_vocab()
    texts = ("12 + 30 = 42, so 7 * 6 is 42 too.", "Hello, upcycled world!!! Hello again.")
    ids = torch.tensor([tok(t)["input_ids"][:24] for t in texts])  # a batch of two
    with torch.no_grad():
        a, b = dense_models[tied](input_ids=ids).logits, moe(input_ids=ids).logits
    assert float((a - b).abs().max()) <= 1e-5
    # the gates renormalise: the top-k weights of each token sum to 1
    with torch.no_grad():
        h = torch.randn(10, cfg.hidden_size)
        _, scores, idx = moe.model.layers[0].mlp.gate(h)
    assert scores.shape == idx.shape == (10, 2)
    assert torch.allclose(scores.sum(-1), torch.ones(10), atol=1e-6)


def test_experts_are_the_dense_mlp_plus_seeded_noise_of_relative_size_sigma(dense_models):
    dense = dense_models[True]
    sigma, experts = 0.05, 4
    moe = up.upcycle_model(dense, experts=experts, top_k=2, noise=sigma, router_std=0.02, seed=11)
    same = up.upcycle_model(dense, experts=experts, top_k=2, noise=sigma, router_std=0.02, seed=11)
    other = up.upcycle_model(dense, experts=experts, top_k=2, noise=sigma, router_std=0.02, seed=12)
    zero = up.upcycle_model(dense, experts=experts, top_k=2, noise=0.0, router_std=0.02, seed=11)
    for layer in range(dense.config.num_hidden_layers):
        mlp = dense.model.layers[layer].mlp
        w = {"gate": mlp.gate_proj.weight.detach(), "up": mlp.up_proj.weight.detach(), "down": mlp.down_proj.weight.detach()}
        gate_up, down = _experts(moe, layer)
        inter = w["gate"].shape[0]
        per_expert = {"gate": gate_up[:, :inter], "up": gate_up[:, inter:], "down": down}
        for name, stacked in per_expert.items():
            rms = float(w[name].pow(2).mean().sqrt())
            for e in range(experts):
                rel = float((stacked[e] - w[name]).pow(2).mean().sqrt()) / rms
                assert rel == pytest.approx(sigma, rel=0.1), (layer, name, e, rel)
                for f in range(e):  # independent noise: two experts differ by sqrt(2) sigma RMS
                    rel_ef = float((stacked[e] - stacked[f]).pow(2).mean().sqrt()) / rms
                    assert rel_ef == pytest.approx(sigma * 2 ** 0.5, rel=0.1), (layer, name, e, f)
        # sigma = 0: exact copies of the dense MLP (gate first, then up, in gate_up_proj)
        gate_up0, down0 = _experts(zero, layer)
        for e in range(experts):
            assert torch.equal(gate_up0[e], torch.cat([w["gate"], w["up"]]))
            assert torch.equal(down0[e], w["down"])
        # seeded: the same seed gives the same weights, another seed other noise
        assert torch.equal(gate_up, _experts(same, layer)[0]) and torch.equal(down, _experts(same, layer)[1])
        assert not torch.equal(gate_up, _experts(other, layer)[0])
    # attention, norms and embeddings are copied unchanged; the dense model is not modified
    msd, dsd = moe.state_dict(), dense.state_dict()
    for key, value in dsd.items():
        if ".mlp." not in key:
            assert torch.equal(msd[key], value), key
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()


def test_router_is_small_seeded_and_independent_of_the_noise(dense_models):
    dense = dense_models[False]
    a = up.upcycle_model(dense, experts=8, top_k=2, noise=0.0, router_std=0.01, seed=5)
    b = up.upcycle_model(dense, experts=8, top_k=2, noise=0.3, router_std=0.01, seed=5)
    c = up.upcycle_model(dense, experts=8, top_k=2, noise=0.0, router_std=0.01, seed=6)
    routers = [m.model.layers[i].mlp.gate.weight.detach() for m in (a,) for i in range(2)]
    for layer, w in enumerate(routers):
        assert w.shape == (8, dense.config.hidden_size)
        assert float(w.std()) == pytest.approx(0.01, rel=0.15)
        assert float(w.abs().max()) < 0.06
        assert torch.equal(w, b.model.layers[layer].mlp.gate.weight)  # same seed, any noise: same router
        assert not torch.equal(w, c.model.layers[layer].mlp.gate.weight)
    assert not torch.equal(routers[0], routers[1])  # each layer its own router
    zero = up.upcycle_model(dense, experts=4, top_k=4, noise=0.0, router_std=0.0, seed=0)
    assert not zero.model.layers[0].mlp.gate.weight.any()


def test_noise_moves_the_logits_and_kl_grows_with_sigma(dense_dirs, tmp_path):
    kls = []
    for sigma in (0.02, 0.2):
        s = up.upcycle(dense_dirs[True], tmp_path / f"s{sigma}", noise=sigma, seed=0, log=lambda *_: None)
        assert s["max_abs_logit_diff"] > 1e-4
        kls.append(s["mean_token_kl"])
    assert 0 < kls[0] < kls[1]


@pytest.mark.parametrize("kwargs, name", [
    ({"experts": 2, "top_k": 3}, "--top-k"),
    ({"experts": 0}, "--experts"),
    ({"top_k": 0}, "--top-k"),
    ({"noise": -0.1}, "--noise"),
    ({"noise": float("nan")}, "--noise"),
    ({"router_std": -1.0}, "--router-std"),
])
def test_bad_arguments_are_refused_by_name(dense_dirs, tmp_path, kwargs, name):
    with pytest.raises(ValueError, match=name):
        up.upcycle(dense_dirs[True], tmp_path / "x", log=lambda *_: None, **kwargs)
    assert not (tmp_path / "x").exists()


def test_cli_errors_name_the_argument(dense_dirs, tmp_path, capsys):
    assert up.main(["--dense", str(dense_dirs[True]), "--experts", "2", "--top-k", "3", "--out", str(tmp_path / "o")]) == 2
    assert "--top-k=3" in capsys.readouterr().err
    assert up.main(["--dense", str(dense_dirs[True]), "--noise", "-1", "--out", str(tmp_path / "o")]) == 2
    assert "--noise" in capsys.readouterr().err
    assert up.main(["--dense", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--dense" in err and "make real-model" in err
    assert not (tmp_path / "o").exists()


def test_cli_writes_refuses_to_overwrite_and_force_replaces(dense_dirs, tmp_path, capsys):
    out = tmp_path / "moe"
    argv = ["--dense", str(dense_dirs[False]), "--experts", "3", "--top-k", "1", "--out", str(out)]
    assert up.main(argv) == 0
    printed = capsys.readouterr().out
    assert "max |logit(moe) - logit(dense)|" in printed and "KL(dense || moe)" in printed
    info = json.loads((out / up.INFO_FILE).read_text())
    assert (info["experts"], info["top_k"], info["noise"]) == (3, 1, 0.0)
    assert up.main(argv) == 2 and "--out" in capsys.readouterr().err
    assert up.main(argv[:-2] + ["--out", str(out), "--noise", "0.1", "--force"]) == 0
    assert json.loads((out / up.INFO_FILE).read_text())["noise"] == 0.1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe"]  # no temporary or old folder left


def test_default_out_names_the_shape():
    assert up.default_out(4, 2, 0.0) == Path("models/smollm2-135m-moe-e4k2-s0")
    assert up.default_out(8, 2, 0.05) == Path("models/smollm2-135m-moe-e8k2-s0.05")


@pytest.mark.skipif(not (SMOLLM2 / "model.safetensors").is_file(), reason="run `make real-model` first")
def test_smollm2_upcycled_with_zero_noise_keeps_its_logits(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "smol-moe"
    prompts = ("What is 3 plus 4?", "The sky is")
    s = up.upcycle(SMOLLM2, out, experts=4, top_k=2, noise=0.0, seed=0, prompts=prompts, log=lambda *_: None)
    assert s["tie_word_embeddings"] is True
    assert s["max_abs_logit_diff"] <= 1e-4
    moe = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr()
    assert (out / "chat_template.jinja").read_text() == (SMOLLM2 / "chat_template.jinja").read_text()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == AutoTokenizer.from_pretrained(SMOLLM2).get_vocab()


def test_heldout_accuracy_batches_left_padded_prompts_as_each_alone(dense_dirs, dense_models):
    """``--eval``'s scorer: rows whose reference is the model's own greedy text (got one prompt at a time) score
    1, the others 0, so the mean is exactly their share; batching left-padded prompts of different lengths must
    not change a response."""
    from transformers import AutoTokenizer

    from cluster.models.heldout import heldout_accuracy
    from rollout.contracts import PromptRow

    model, tok = dense_models[True], AutoTokenizer.from_pretrained(dense_dirs[True])
    prompts = [[5, 9, 13], [7, 20, 8, 30, 41, 12], [11], [4, 4, 17, 22]]
    rows = []
    for k, ids in enumerate(prompts):
        alone = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=3, do_sample=False,
                               pad_token_id=tok.eos_token_id)
        text = tok.decode(alone[0, len(ids):].tolist(), skip_special_tokens=True)
        assert text.strip(), "the tiny model's greedy text is empty: the test cannot tell right from wrong"
        rows.append(PromptRow(uid=str(k), prompt="", prompt_token_ids=ids, verifier="exact",
                              answer=text if k % 2 == 0 else text + " no"))
    assert heldout_accuracy(model, tok, rows, max_new_tokens=3, batch_size=4) == 0.5
    assert heldout_accuracy(model, tok, rows[:1], max_new_tokens=3, batch_size=4) == 1.0
    with pytest.raises(ValueError, match="no rows"):
        heldout_accuracy(model, tok, [], max_new_tokens=3)


def test_negative_eval_count_is_refused_before_any_work(dense_dirs, tmp_path):
    with pytest.raises(ValueError, match="--eval=-1"):
        up.upcycle(dense_dirs[True], tmp_path / "x", eval_prompts=-1, log=lambda *_: None)
    assert not (tmp_path / "x").exists()
