"""Learner checkpoints: what resuming a run needs from every rank, plus a Hugging Face copy of the weights.

Layout of one learner checkpoint folder (the driver writes it under a temporary name and renames it when
complete, ``cluster/driver/checkpoint.py``):

- ``deepspeed/``: DeepSpeed's own checkpoint (model, optimizer partitions of every rank, lr);
- ``rng/rank_<r>.pt``: each rank's Python, NumPy and torch RNG states;
- ``learner_state.json``: world size, ZeRO stage, optimizer steps (rank 0);
- ``hf/``: the full model in Hugging Face format (safetensors, checkpoint names) plus the tokenizer files,
  loadable by transformers and vLLM (rank 0); with LoRA (``learner.lora``) the merged policy, and beside it
  ``adapter/`` (the adapter in peft's format) and ``lora_base/`` (the frozen base it adapts, same format).
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import torch

from learner import lora
from learner.state import full_params

log = logging.getLogger(__name__)

DS_TAG = "deepspeed"  # tag of the DeepSpeed checkpoint folder inside a learner checkpoint
HF_SUBDIR = "hf"
RNG_SUBDIR = "rng"
STATE_FILE = "learner_state.json"
# Files of a Hugging Face model folder that belong to the tokenizer (copied next to the saved weights).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def save(rank, path: str) -> None:
    """Write ``rank``'s part of a learner checkpoint into ``path`` (layout above). Collective while the
    DeepSpeed checkpoint is written (every rank writes its own model and optimizer partitions, DeepSpeed's
    ``save_checkpoint``) and while the full weights are gathered parameter by parameter; rank 0's export of
    the gathered weights runs after the last collective, so no peer waits for it under the collective timeout.

    Args:
        rank: the ``learner.service.LearnerRank`` (its engine, rank, world size, model path, optimizer steps).
        path: the checkpoint's learner folder (created if missing).
    """
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    rank.engine.save_checkpoint(str(out), tag=DS_TAG, client_state={"optimizer_steps": rank.optimizer_steps})
    rng_dir = out / RNG_SUBDIR
    rng_dir.mkdir(exist_ok=True)
    torch.save(rng_state(), rng_dir / f"rank_{rank.rank}.pt")
    keep = rank.rank == 0
    state = {n: t for n, t in full_params(rank.engine, rank.zero3, keep) if t is not None}
    if keep:
        hf = out / HF_SUBDIR
        peft = lora.is_peft(rank.engine.module)
        if peft:  # hf/ the merged policy, lora_base/ the frozen base, adapter/ peft's own format (learner.lora)
            lora.save_checkpoint_parts(rank.engine.module, out, state, HF_SUBDIR)
        else:
            rank.engine.module.save_pretrained(str(hf), state_dict=state, safe_serialization=True)
        src = Path(rank.model_path)
        for folder in (hf, out / lora.BASE_SUBDIR) if peft else (hf,):
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, folder / name)
        (out / STATE_FILE).write_text(
            json.dumps({"world_size": rank.world_size, "zero_stage": rank.cfg.zero_stage,
                        "optimizer_steps": rank.optimizer_steps, "lora": peft}, indent=1) + "\n"
        )
    # No barrier after rank 0's Hugging Face export: writing the whole model (61 GB for Qwen3-30B-A3B) can take
    # longer than learner.dist_timeout_s, and peers waiting in a collective for it would time out. The driver
    # waits for every rank's call to return before it finalizes the folder, which is all the barrier gave.


def load(rank, path: str) -> None:
    """Restore weights, optimizer state, lr, optimizer steps and this rank's RNG states from ``save``'s
    folder. Collective.

    A LoRA checkpoint (``learner_state.json`` says ``"lora": true``) switches the rank to LoRA first.

    Raises:
        FileNotFoundError: ``path`` holds no learner checkpoint.
        ValueError: a full-parameter checkpoint loaded into a rank already on LoRA.
    """
    src = Path(path)
    if not (src / DS_TAG).is_dir():
        raise FileNotFoundError(f"path={path!r} holds no learner checkpoint (no {DS_TAG}/ folder)")
    saved_lora = (src / STATE_FILE).is_file() and bool(json.loads((src / STATE_FILE).read_text()).get("lora"))
    if saved_lora:
        rank.enable_lora()  # a LoRA checkpoint: its DeepSpeed state is the peft model's (no-op when on already)
    elif lora.is_peft(rank.engine.module):
        raise ValueError(f"path={path!r} was saved before LoRA started (full-parameter state) and this rank trains "
                         "a LoRA adapter already: load it into a fresh learner, which switches to LoRA after it")
    load_path, client_state = rank.engine.load_checkpoint(
        str(src), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if load_path is None:
        raise FileNotFoundError(f"DeepSpeed found no checkpoint in {path!r}")
    rank.optimizer_steps = int((client_state or {}).get("optimizer_steps", rank.optimizer_steps))
    rng_file = src / RNG_SUBDIR / f"rank_{rank.rank}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    else:
        log.warning("no RNG state for rank %d in %s; RNG not restored", rank.rank, path)


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    import numpy as np

    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % (1 << 32))


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) RNG states."""
    import numpy as np

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    import numpy as np

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
