"""``gspo-merge-lora CHECKPOINT OUT``: a LoRA run's checkpoint as one full Hugging Face model.

CHECKPOINT is a run's checkpoint folder (``.../checkpoints/step_NNNNNNNN``), its ``learner/`` folder, or a peft
adapter folder; the base is the checkpoint's ``lora_base/`` (the frozen weights the adapter was trained on), or
``--base`` for a bare adapter folder. peft's ``merge_and_unload`` folds ``(alpha / r) B A`` into each adapted
weight (``learner.lora.merge_to_folder``); OUT is loadable by transformers and vLLM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from learner.lora import ADAPTER_SUBDIR, BASE_SUBDIR, merge_to_folder


def locate(checkpoint: Path) -> tuple[Path, Path | None]:
    """``(adapter folder, base folder or None)`` inside ``checkpoint`` (see the module docstring).

    Raises:
        FileNotFoundError: no adapter folder there.
    """
    for learner in (checkpoint / "learner", checkpoint):
        if (learner / ADAPTER_SUBDIR / "adapter_config.json").is_file():
            base = learner / BASE_SUBDIR
            return learner / ADAPTER_SUBDIR, base if base.is_dir() else None
    if (checkpoint / "adapter_config.json").is_file():
        return checkpoint, None
    raise FileNotFoundError(f"{checkpoint} holds no LoRA adapter (no {ADAPTER_SUBDIR}/adapter_config.json, "
                            f"learner/{ADAPTER_SUBDIR}/ or adapter_config.json): was the run trained with learner.lora?")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``gspo-merge-lora``; returns the exit status (2 for a folder without an adapter)."""
    parser = argparse.ArgumentParser(prog="gspo-merge-lora", description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="checkpoint folder, its learner/ folder, or an adapter folder")
    parser.add_argument("out", type=Path, help="where the full model is written")
    parser.add_argument("--base", type=Path, default=None, help="base model folder (default: the checkpoint's)")
    args = parser.parse_args(argv)
    try:
        adapter, base = locate(args.checkpoint)
        out = merge_to_folder(adapter, args.out, args.base or base)
    except FileNotFoundError as err:
        print(f"gspo-merge-lora: {err}", file=sys.stderr)
        return 2
    print(f"merged {adapter} into {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
