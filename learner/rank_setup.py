"""Building one learner rank: its device and DeepSpeed accelerator, the process group, the optimizer and the
policy under DeepSpeed wrapped as this rank's ``Replica`` (``learner.service.LearnerRank`` calls these once at
start, and again when it switches to LoRA).
"""

from __future__ import annotations

import datetime
import importlib
import os

import torch

from learner import lora
from learner.config import LearnerConfig
from learner.moe import RouterTap, find_routers
from learner.replica import Replica


def learner_device(cfg: LearnerConfig) -> str:
    """The learner's device type from the config alone: ``"cuda"`` when each rank holds a GPU
    (``learner.num_gpus_per_rank > 0``), ``"cpu"`` otherwise. The environment does not decide it: a
    ``DS_ACCELERATOR=cpu`` inherited from a CPU default (a Makefile, a shell) must not move a GPU run's learner
    to the CPU; ``LearnerRank`` sets ``DS_ACCELERATOR`` from this value."""
    return "cuda" if cfg.num_gpus_per_rank > 0 else "cpu"


def select_accelerator(device: str) -> None:
    """Point DeepSpeed's accelerator at ``device`` (``DS_ACCELERATOR``, read at its first use in the process).

    Raises:
        RuntimeError: ``device`` is ``"cuda"`` but torch sees no CUDA device, or DeepSpeed's accelerator was
            already chosen for another device in this process.
    """
    from deepspeed.accelerator import real_accelerator

    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("learner.num_gpus_per_rank > 0 but this learner process sees no CUDA device "
                           f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    os.environ["DS_ACCELERATOR"] = device
    chosen = real_accelerator.ds_accelerator
    if chosen is not None and chosen.device_name() != device:
        raise RuntimeError(f"DeepSpeed's accelerator in this process is already {chosen.device_name()!r}; the "
                           f"learner config asks for {device!r}")


def init_distributed(cfg: LearnerConfig, rank: int, world_size: int, local_rank: int, master_addr: str,
                     master_port: int) -> None:
    """Environment for torch.distributed, the DeepSpeed accelerator, and the process group (gloo on the CPU,
    NCCL on GPUs: ``learner_device``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    on_gpu = learner_device(cfg) == "cuda"

    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
        LOCAL_SIZE=os.environ.get("LOCAL_SIZE", str(world_size)),
        MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port),
    )
    torch.set_num_threads(cfg.threads_per_rank)
    if on_gpu:
        get_accelerator().set_device(local_rank)
    elif not cfg.cpu_shm_allreduce:
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op at every init_distributed
        # that finds no valid build cache (30 s idle, minutes on a busy machine); plain gloo is as fast
        # for the tensors of a tiny model. Opt back in with learner.cpu_shm_allreduce=true.
        # (importlib: `import deepspeed.comm.torch as m` binds the real torch, an attribute of deepspeed.comm)
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
        ds_torch_comm.build_shm_op = lambda: None
    deepspeed.init_distributed(
        dist_backend="nccl" if on_gpu else "gloo",
        auto_mpi_discovery=False,
        verbose=False,
        timeout=datetime.timedelta(seconds=cfg.dist_timeout_s),
        rank=rank,
        world_size=world_size,
    )


def build_partitioned(cfg: LearnerConfig, on_gpu: bool) -> bool:
    """Whether a rank builds its model partitioned (``HfDeepSpeedConfig`` before ``from_pretrained``, i.e. under
    ``deepspeed.zero.Init``): ZeRO-3 on GPUs. The CPU runs keep their full-copy build (their numbers are
    unchanged; a tiny model's copy costs nothing)."""
    return cfg.zero_stage == 3 and on_gpu


def param_groups(model: torch.nn.Module, cfg: LearnerConfig) -> list[dict]:
    """The optimizer's parameter groups: everything trainable at ``learner.lr`` and, when
    ``learner.router_lr_scale != 1`` on an MoE model, the expert routers' parameters in a second group with
    ``lr = learner.lr x router_lr_scale`` (``lr_scale`` kept in the group for ``set_lr``). One group otherwise,
    exactly as before the key existed.

    Raises:
        ValueError: ``router_lr_scale != 1`` on a model without expert routers.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.router_lr_scale == 1.0:
        return [{"params": params, "lr_scale": 1.0}]
    routers = {id(p) for _, _, m in find_routers(model) for p in m.parameters() if p.requires_grad}
    if not routers:
        raise ValueError(f"learner.router_lr_scale={cfg.router_lr_scale} needs an MoE model (no expert router found)")
    return [{"params": [p for p in params if id(p) not in routers], "lr_scale": 1.0},
            {"params": [p for p in params if id(p) in routers], "lr": cfg.lr * cfg.router_lr_scale,
             "lr_scale": cfg.router_lr_scale}]


def build_optimizer(model: torch.nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer:
    """The client optimizer handed to ``deepspeed.initialize``: AdamW over ``param_groups(model, cfg)`` at
    ``learner.lr``, ``adam_betas``, ``weight_decay`` (eps 1e-8 in both). ``offload_optimizer='none'``: torch's
    AdamW (``fused`` per ``learner.fused_optimizer``); ``'cpu'``: DeepSpeed's CPU Adam in AdamW mode (decoupled
    weight decay), the optimizer DeepSpeed requires next to ZeRO-Offload (``zero_force_ds_cpu_optimizer``).

    Raises:
        ValueError: ``router_lr_scale != 1`` on a model without expert routers (``param_groups``).
        RuntimeError: DeepSpeed's ``cpu_adam`` op fails to build or load (it is JIT-compiled with the C++
            toolchain on first use and cached under ``~/.cache/torch_extensions``).
    """
    groups = param_groups(model, cfg)
    if cfg.offload_optimizer == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                                adamw_mode=True)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), weight_decay=cfg.weight_decay,
                             fused=cfg.fused_optimizer or None)


def keep_checkpointing_on(model: torch.nn.Module) -> int:
    """Put the checkpointed decoder layers of an ``eval()`` model back in training mode, and only them.

    transformers checkpoints a layer when ``layer.gradient_checkpointing and layer.training``
    (``GradientCheckpointingLayer.__call__``), so an eval-mode model never checkpoints. Setting the flag of
    those layer modules alone (not ``train()``, which recurses) turns checkpointing back on while every other
    module, the attention and any dropout included, stays in eval mode: no dropout, the same policy as the
    pre-update and reference passes. Under ``torch.no_grad`` the checkpoint wrapper stores nothing.

    Returns:
        The number of layers switched (0 when the model has no checkpointed layer).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    for layer in layers:
        layer.training = True
    return len(layers)


def build_replica(model_path: str, cfg: LearnerConfig, rank: int, world_size: int, temperature: float,
                  partitioned: bool, weights: dict[str, torch.Tensor] | None = None) -> Replica:
    """The policy under DeepSpeed (``build_optimizer``'s AdamW, the config's ZeRO stage and offload), the reference
    model when ``kl_coef > 0`` and the MoE router tap, wrapped as this rank's ``Replica``. ``partitioned``: build
    the model under ``deepspeed.zero.Init`` (ZeRO-3 only). ``weights`` (full tensors by transformers name): the
    policy starts from them instead of the folder's, wrapped with ``learner.lora``'s adapter (``enable_lora``)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from transformers import AutoModelForCausalLM

    from learner.attention import use_fp32_attention
    from learner.ds_config import build_ds_config

    device = torch.device(get_accelerator().current_device_name())
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" else torch.float32
    ds_config = build_ds_config(cfg, world_size, on_gpu=learner_device(cfg) == "cuda", policy=True)
    # ZeRO-3 on GPUs: the model is built partitioned (HfDeepSpeedConfig makes from_pretrained run under
    # deepspeed.zero.Init and load the checkpoint shard by shard), not one full copy per rank in host RAM.
    if partitioned:
        from transformers.integrations import HfDeepSpeedConfig

        hf_ds = HfDeepSpeedConfig(ds_config)  # noqa: F841 - transformers holds a weak reference while it is alive
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    model.config.use_cache = False
    if device.type == "cpu":
        use_fp32_attention(model)  # bf16 on the CPU: attention in float32 (faster there; learner/attention.py)
    if weights is not None:
        model = lora.start_from(model, weights, cfg.lora)
    if cfg.routing_replay != "off" and not find_routers(model):
        raise ValueError(f"learner.routing_replay={cfg.routing_replay!r} needs an MoE model; {model_path!r} has no "
                         "expert router")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, _, _, _ = deepspeed.initialize(
        model=model, optimizer=build_optimizer(model, cfg), config=ds_config, dist_init_required=False
    )
    if partitioned:
        del hf_ds
    engine.eval()  # no dropout anywhere: training, recompute and reference passes see one policy
    if world_size == 1 and (cfg.zero_stage == 0 or isinstance(engine.optimizer, BF16_Optimizer)):
        # one rank has nothing to all-reduce; DeepSpeed would still flatten and copy every gradient per step (a
        # ZeRO-1/2 optimizer of float32 weights needs its reduce hooks; the bf16 one keeps its fp32 gradients
        # itself, in backward_epilogue, which runs either way)
        engine.enable_backward_allreduce = False
    if cfg.gradient_checkpointing:
        keep_checkpointing_on(engine.module)
    ref_model = None
    if cfg.kl_coef > 0:
        ref_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
        use_fp32_attention(ref_model)
        ref_model.config.use_cache = False
        ref_model.eval().requires_grad_(False)
    # MoE: forward hooks on the routers (expert load, routing volatility, Routing Replay); None if dense.
    tap = None
    if cfg.routing_replay != "off" or cfg.moe_diagnostics:
        tap = RouterTap(engine.module)
        if not tap.is_moe:
            tap.remove()
            tap = None
    if cfg.routing_replay != "off" and (tap is None or not tap.can_replay):
        raise ValueError(f"learner.routing_replay={cfg.routing_replay!r}: the routers of {model_path!r} do not "
                         "support replay")
    return Replica(engine, cfg, rank=rank, world_size=world_size, device=device, temperature=temperature,
                   ref_model=ref_model, tap=tap)
