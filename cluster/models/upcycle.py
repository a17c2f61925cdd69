"""``gspo-upcycle`` (``make real-moe``): a dense Llama (SmolLM2-135M-Instruct) sparsely upcycled into a Mixtral.

The dense ``LlamaForCausalLM`` becomes a ``MixtralForCausalLM`` with ``experts`` routed experts and top-``top_k``
routing. Attention, norms, embeddings (tied or not, as in the dense model), the tokenizer files and the
generation config are copied as they are. Every expert is a copy of the dense MLP (``gate_proj`` -> ``w1``,
``up_proj`` -> ``w3``, ``down_proj`` -> ``w2``) plus independent Gaussian noise of standard deviation
``noise * rms(W)`` for each weight matrix ``W``; the router (``block_sparse_moe.gate``) is drawn from
``N(0, router_std^2)``. Both are seeded: the router is drawn first from ``seed``, then the expert noise in a fixed
order, so a seed gives the same router for every ``noise`` and the same noise directions scaled by ``noise``.

Mixtral renormalises its top-k gates to sum to 1, so with ``noise = 0`` (identical experts) every token's MoE
output is the dense MLP's output and the logits equal the dense model's, whatever the router. The checks,
printed and stored in ``upcycle.json`` beside the weights, are computed on the saved folder reloaded: the
largest |logit difference| to the dense model and the mean per-token KL(dense || moe) over a few fixed prompts
(float32). With ``noise = 0`` a difference above ``ZERO_NOISE_TOL`` is an error and nothing is installed.

The model is written to a temporary folder beside ``--out`` and renamed into place, so a crash never leaves a
half-written model at ``--out``.

``gspo-upcycle [--dense PATH] [--experts 4] [--top-k 2] [--noise 0.0] [--router-std 0.02] [--seed 0] [--out PATH]
[--force] [--eval N] [--eval-config configs/smollm2_arith.yaml]``
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from cluster.config import ConfigError
from cluster.models.heldout import DEFAULT_EVAL_CONFIG

DEFAULT_DENSE = Path("models/smollm2-135m-instruct")
DEFAULT_EXPERTS, DEFAULT_TOP_K, DEFAULT_NOISE, DEFAULT_ROUTER_STD, DEFAULT_SEED = 4, 2, 0.0, 0.02, 0
INFO_FILE = "upcycle.json"
# float32 through 30 layers: the renormalised gates sum to 1 up to rounding, so differences of ~1e-6 remain.
ZERO_NOISE_TOL = 1e-4
CHECK_PROMPTS = (
    "What is 7 plus 5? Answer with a number.",
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, there was a little",
)
# Files of the dense folder copied as they are (the tokenizer and its chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
DENSE_TYPES = ("llama", "mistral")


def default_out(experts: int, top_k: int, noise: float) -> Path:
    """``models/smollm2-135m-moe-e<E>k<K>-s<noise>`` (``noise`` written with ``%g``)."""
    return Path(f"models/smollm2-135m-moe-e{experts}k{top_k}-s{noise:g}")


def check_args(experts: int, top_k: int, noise: float, router_std: float) -> None:
    """Raises ValueError naming the argument (as on the command line) for a value the upcycling cannot use."""
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
        raise ValueError(f"--experts={experts!r} must be an integer >= 1")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"--top-k={top_k!r} must be an integer >= 1")
    if top_k > experts:
        raise ValueError(f"--top-k={top_k} must not exceed --experts={experts}")
    if not math.isfinite(noise) or noise < 0:
        raise ValueError(f"--noise={noise!r} must be a finite number >= 0 (a fraction of each weight's RMS)")
    if not math.isfinite(router_std) or router_std < 0:
        raise ValueError(f"--router-std={router_std!r} must be a finite number >= 0")


def _dense_config(dense: Path):
    from transformers import AutoConfig

    if not (dense / "config.json").is_file():
        raise FileNotFoundError(
            f"--dense={str(dense)!r}: no dense model there (no config.json); run `make real-model` to build "
            f"{DEFAULT_DENSE}, or pass --dense with a Llama-style Hugging Face folder")
    config = AutoConfig.from_pretrained(dense)
    if config.model_type not in DENSE_TYPES:
        raise ValueError(f"--dense={str(dense)!r} is a {config.model_type!r} model; upcycling takes one of "
                         f"{DENSE_TYPES} (Llama-style attention and a gate/up/down MLP)")
    for flag in ("attention_bias", "mlp_bias"):
        if getattr(config, flag, False):
            raise ValueError(f"--dense={str(dense)!r} has {flag}=True, which a Mixtral cannot hold")
    return config


def mixtral_config(dense_config, experts: int, top_k: int):
    """The ``MixtralConfig`` of the upcycled model: every shape, rope, norm and token setting of the dense one."""
    from transformers import MixtralConfig

    d = dense_config
    rope = getattr(d, "rope_parameters", None)
    config = MixtralConfig(
        vocab_size=d.vocab_size, hidden_size=d.hidden_size, intermediate_size=d.intermediate_size,
        num_hidden_layers=d.num_hidden_layers, num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=getattr(d, "head_dim", None) or d.hidden_size // d.num_attention_heads,
        hidden_act=d.hidden_act, max_position_embeddings=d.max_position_embeddings,
        initializer_range=d.initializer_range, rms_norm_eps=d.rms_norm_eps, use_cache=True,
        pad_token_id=d.pad_token_id, bos_token_id=d.bos_token_id, eos_token_id=d.eos_token_id,
        tie_word_embeddings=bool(d.tie_word_embeddings), sliding_window=None,
        attention_dropout=getattr(d, "attention_dropout", 0.0),
        num_experts_per_tok=top_k, num_local_experts=experts, output_router_logits=False,
        router_jitter_noise=0.0, rope_parameters=dict(rope) if rope is not None else None,
        dtype=str(d.dtype).removeprefix("torch.") if d.dtype is not None else "float32",
    )
    config.architectures = ["MixtralForCausalLM"]
    return config


def _rms(t) -> float:
    return float(t.double().pow(2).mean().sqrt())


def upcycle_model(dense_model, *, experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K,
                  noise: float = DEFAULT_NOISE, router_std: float = DEFAULT_ROUTER_STD, seed: int = DEFAULT_SEED):
    """A ``MixtralForCausalLM`` upcycled from the loaded dense ``LlamaForCausalLM`` (in its dtype; noise drawn
    in float32). The dense model is left unchanged.

    Raises:
        ValueError: a bad argument (named as on the command line), or a dense model Mixtral cannot hold.
    """
    import torch
    from transformers import MixtralForCausalLM

    check_args(experts, top_k, noise, router_std)
    d = dense_model.config
    if d.model_type not in DENSE_TYPES or getattr(d, "attention_bias", False) or getattr(d, "mlp_bias", False):
        raise ValueError(f"a {d.model_type!r} model (attention_bias/mlp_bias set?) cannot be upcycled to Mixtral")
    config = mixtral_config(d, experts, top_k)
    dtype = next(dense_model.parameters()).dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the init below is overwritten; this only keeps the caller's RNG untouched
        moe = MixtralForCausalLM(config).to(dtype).eval()

    dense_sd = dense_model.state_dict()
    gen = torch.Generator().manual_seed(int(seed))
    layers = range(d.num_hidden_layers)
    new: dict[str, Any] = {}
    # 1. the routers, all layers, first (so they do not depend on --noise)
    for i in layers:
        w = torch.randn(experts, d.hidden_size, generator=gen, dtype=torch.float32) * router_std
        new[f"model.layers.{i}.mlp.gate.weight"] = w.to(dtype)
    # 2. the experts: dense MLP + noise * rms(W) * N(0, 1), layer by layer, expert by expert, gate/up/down
    for i in layers:
        p = f"model.layers.{i}.mlp."
        mats = {name: dense_sd[p + name + ".weight"].float() for name in ("gate_proj", "up_proj", "down_proj")}
        rms = {name: _rms(w) for name, w in mats.items()}
        gate_up, down = [], []
        for _ in range(experts):
            e = {}
            for name, w in mats.items():
                z = torch.randn(w.shape, generator=gen, dtype=torch.float32) if noise > 0 else None
                e[name] = w + (noise * rms[name]) * z if z is not None else w.clone()
            gate_up.append(torch.cat([e["gate_proj"], e["up_proj"]], dim=0))  # chunk(2): gate first, then up
            down.append(e["down_proj"])
        new[p + "experts.gate_up_proj"] = torch.stack(gate_up).to(dtype)  # (E, 2 I, H)
        new[p + "experts.down_proj"] = torch.stack(down).to(dtype)  # (E, H, I)
    # 3. everything else as it is
    for key, value in dense_sd.items():
        if ".mlp." in key:
            continue
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue
        new[key] = value
    moe_sd = moe.state_dict()
    missing = [k for k in moe_sd if k not in new and not (k == "lm_head.weight" and config.tie_word_embeddings)]
    unexpected = [k for k in new if k not in moe_sd]
    if missing or unexpected:
        raise RuntimeError(f"upcycling does not cover the Mixtral's weights: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    with torch.no_grad():
        for key, value in new.items():
            if moe_sd[key].shape != value.shape:
                raise RuntimeError(f"{key}: Mixtral shape {tuple(moe_sd[key].shape)} != {tuple(value.shape)}")
            moe_sd[key].copy_(value)
    if config.tie_word_embeddings:
        moe.tie_weights()
        assert moe.lm_head.weight.data_ptr() == moe.model.embed_tokens.weight.data_ptr(), "embeddings not tied"
    return moe


def compare_logits(dense_model, moe_model, tokenizer, prompts=CHECK_PROMPTS) -> dict[str, float]:
    """``max_abs_logit_diff`` and ``mean_token_kl`` (KL(dense || moe) in nats, mean over every prompt token)
    of the two models on ``prompts``, each run alone, in float32; and ``dense_fp32_vs_fp64_logit_diff``, the
    dense model's float32 logits against its float64 ones, the scale of float32 rounding for comparison (the
    router's gates are computed in float32, so even with identical experts the MoE is only exact to that scale)."""
    import torch

    worst, kl_sum, tokens, fp32 = 0.0, 0.0, 0, 0.0
    with torch.no_grad():
        for text in prompts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            a = dense_model(input_ids=ids).logits.float()[0]
            b = moe_model(input_ids=ids).logits.float()[0]
            worst = max(worst, float((a - b).abs().max()))
            la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
            kl_sum += float((la.exp() * (la - lb)).sum(-1).sum())
            tokens += a.shape[0]
        # the scale of float32 rounding: the dense model's own float32 logits against its float64 ones
        dense64 = copy.deepcopy(dense_model).double()
        for text in prompts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            a = dense_model(input_ids=ids).logits.double()[0]
            fp32 = max(fp32, float((a - dense64(input_ids=ids).logits[0]).abs().max()))
        del dense64
    return {"max_abs_logit_diff": worst, "mean_token_kl": kl_sum / max(tokens, 1), "tokens": tokens,
            "dense_fp32_vs_fp64_logit_diff": fp32}


def upcycle(dense: str | os.PathLike = DEFAULT_DENSE, out: str | os.PathLike | None = None, *,
            experts: int = DEFAULT_EXPERTS, top_k: int = DEFAULT_TOP_K, noise: float = DEFAULT_NOISE,
            router_std: float = DEFAULT_ROUTER_STD, seed: int = DEFAULT_SEED, force: bool = False,
            prompts=CHECK_PROMPTS, eval_prompts: int = 0, eval_config: str | os.PathLike = DEFAULT_EVAL_CONFIG,
            log=print) -> dict[str, Any]:
    """Upcycle the dense folder into ``out`` (written beside it, then renamed in); returns the summary stored
    in ``out/upcycle.json`` (arguments and checks). With ``eval_prompts`` > 0 the summary also holds
    ``heldout_accuracy`` of the saved MoE and ``dense_heldout_accuracy`` of the dense model: greedy, on the first
    ``eval_prompts`` held-out prompts of ``eval_config``'s task (``cluster.models.heldout``).

    Raises:
        ValueError: a bad argument, named; with ``noise = 0`` a logit difference above ``ZERO_NOISE_TOL``.
        FileNotFoundError: no dense model at ``dense`` (run ``make real-model``).
        FileExistsError: ``out`` exists and ``force`` is not set.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, MixtralForCausalLM

    check_args(experts, top_k, noise, router_std)
    if eval_prompts < 0:
        raise ValueError(f"--eval={eval_prompts} must be >= 0 (0 skips the held-out evaluation)")
    dense = Path(dense)
    _dense_config(dense)
    out = Path(out) if out is not None else default_out(experts, top_k, noise)
    if out.exists() and not force:
        raise FileExistsError(f"--out={str(out)!r} exists; pass --force to replace it")
    dense_model = AutoModelForCausalLM.from_pretrained(dense).eval()
    moe = upcycle_model(dense_model, experts=experts, top_k=top_k, noise=noise, router_std=router_std, seed=seed)
    if (dense / "generation_config.json").is_file():
        moe.generation_config = GenerationConfig.from_pretrained(dense)
    n_params = sum(p.numel() for p in moe.parameters())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        moe.save_pretrained(tmp, safe_serialization=True)
        del moe
        copied = []
        for name in TOKENIZER_FILES:
            if (dense / name).is_file():
                shutil.copy2(dense / name, tmp / name)
                copied.append(name)
        # the checks run on what was written, reloaded
        saved = MixtralForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        tied = bool(saved.config.tie_word_embeddings)
        if tied and saved.lm_head.weight.data_ptr() != saved.model.embed_tokens.weight.data_ptr():
            raise RuntimeError("the saved Mixtral's lm_head is not tied to its embeddings after reloading")
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        checks = compare_logits(dense_model.float(), saved, tokenizer, prompts)
        if eval_prompts:
            checks.update(_heldout(dense_model, saved, dense, eval_config, eval_prompts, log))
        del saved
        summary = {"dense": str(dense), "out": str(out), "experts": experts, "top_k": top_k, "noise": noise,
                   "router_std": router_std, "seed": seed, "parameters": n_params, "tie_word_embeddings": tied,
                   "copied_files": copied, "prompts": list(prompts), **checks}
        log(f"upcycled {dense} -> {out}: {experts} experts, top-{top_k}, noise {noise:g} x RMS, "
            f"router std {router_std:g}, seed {seed}, {n_params / 1e6:.1f} M parameters, tied embeddings: {tied}")
        log(f"check on {len(prompts)} prompts ({checks['tokens']} tokens, float32): "
            f"max |logit(moe) - logit(dense)| = {checks['max_abs_logit_diff']:.3g}, "
            f"mean per-token KL(dense || moe) = {checks['mean_token_kl']:.3g} nats "
            f"(float32 rounding scale: the dense model's float32 vs float64 logits differ by "
            f"{checks['dense_fp32_vs_fp64_logit_diff']:.3g})")
        if noise == 0 and not checks["max_abs_logit_diff"] <= ZERO_NOISE_TOL:
            raise ValueError(f"--noise=0 but the MoE's logits differ from the dense model's by "
                             f"{checks['max_abs_logit_diff']:.3g} > {ZERO_NOISE_TOL:g}; nothing installed")
        (tmp / INFO_FILE).write_text(json.dumps(summary, indent=1) + "\n")
        old = None
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
        tmp.rename(out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return summary


def build_tiny_llama(folder: str | os.PathLike, tied: bool, seed: int = 0) -> Path:
    """A tiny dense Llama to upcycle in tests (no hub): float32, 2 layers, hidden 64, MLP 128, 2 query heads of
    size 32 over 1 KV head, rope theta 50000, the character tokenizer of ``cluster.models.tiny_model``, tied or
    untied embeddings; seeded random weights, the norms moved away from 1 so that copying them is tested."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from cluster.models.tiny_model import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, VOCAB_SIZE, build_char_tokenizer, char_vocab

    folder = Path(folder)
    vocab = char_vocab()
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                         rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                         tie_word_embeddings=tied, pad_token_id=vocab[PAD_TOKEN], bos_token_id=vocab[BOS_TOKEN],
                         eos_token_id=vocab[EOS_TOKEN], dtype="float32")
    config.architectures = ["LlamaForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))
    model.generation_config = GenerationConfig(bos_token_id=vocab[BOS_TOKEN], eos_token_id=vocab[EOS_TOKEN],
                                               pad_token_id=vocab[PAD_TOKEN])
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return folder


def _heldout(dense_model, moe_model, dense: Path, config, n: int, log) -> dict[str, Any]:
    """Greedy held-out accuracy of both models on ``config``'s first ``n`` held-out prompts (logged)."""
    from cluster.models.heldout import heldout_accuracy, heldout_rows

    rows, max_new, tokenizer = heldout_rows(config, dense, n)
    acc = {"dense_heldout_accuracy": heldout_accuracy(dense_model, tokenizer, rows, max_new),
           "heldout_accuracy": heldout_accuracy(moe_model, tokenizer, rows, max_new),
           "eval_config": str(config), "eval_prompts": len(rows)}
    log(f"held-out accuracy on {len(rows)} prompts of {config} (greedy, {max_new} tokens): "
        f"MoE {acc['heldout_accuracy']:.3f}, dense {acc['dense_heldout_accuracy']:.3f}")
    return acc


def main(argv: list[str] | None = None) -> int:
    """The command line; returns 0, or 2 with the error on stderr for a bad argument or a missing dense model."""
    parser = argparse.ArgumentParser(prog="gspo-upcycle", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dense", type=Path, default=DEFAULT_DENSE,
                        help=f"the dense Llama folder (default {DEFAULT_DENSE}, from `make real-model`)")
    parser.add_argument("--experts", type=int, default=DEFAULT_EXPERTS, help="routed experts (default 4)")
    parser.add_argument("--top-k", type=int, default=DEFAULT_TOP_K, help="experts per token (default 2)")
    parser.add_argument("--noise", type=float, default=DEFAULT_NOISE,
                        help="expert noise, a fraction of each weight's RMS (default 0: exact copies)")
    parser.add_argument("--router-std", type=float, default=DEFAULT_ROUTER_STD,
                        help=f"standard deviation of the router's init (default {DEFAULT_ROUTER_STD})")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of the router and the noise")
    parser.add_argument("--out", type=Path, default=None,
                        help="target folder (default models/smollm2-135m-moe-e<E>k<K>-s<noise>)")
    parser.add_argument("--force", action="store_true", help="replace --out when it exists")
    parser.add_argument("--eval", type=int, default=0, metavar="N",
                        help="also report the greedy held-out accuracy of the MoE and the dense model on the first N "
                        "held-out prompts of --eval-config's task (default 0: skipped)")
    parser.add_argument("--eval-config", type=Path, default=DEFAULT_EVAL_CONFIG,
                        help=f"the run config whose task --eval uses (default {DEFAULT_EVAL_CONFIG})")
    args = parser.parse_args(argv)
    try:
        upcycle(args.dense, args.out, experts=args.experts, top_k=args.top_k, noise=args.noise,
                router_std=args.router_std, seed=args.seed, force=args.force, eval_prompts=args.eval,
                eval_config=args.eval_config)
    except (ValueError, FileNotFoundError, FileExistsError, ConfigError) as exc:
        print(f"gspo-upcycle: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
