"""``model.path`` -> a model folder: the builtin tiny models are built on first use, a folder is checked.

The one place that knows both builders (``tiny_model`` for ``builtin:tiny_moe``, ``tiny_archs`` for
``builtin:tiny_<arch>``), so that neither imports the other's caller.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cluster.models import hub_model
from cluster.models.tiny_archs import ARCHS, build_tiny_arch, builtin_arch
from cluster.models.tiny_model import BUILTIN_TINY_MOE, build_tiny_moe


def builtin_names() -> list[str]:
    """Every ``builtin:`` model name ``ensure_model`` builds: ``builtin:tiny_moe`` and ``builtin:tiny_<arch>``."""
    return [BUILTIN_TINY_MOE] + [f"builtin:tiny_{a}" for a in ARCHS]


def check_builtin(path: str | None, field: str) -> None:
    """Refuse a ``builtin:`` name that is no builtin model (at config load, before anything starts).

    Raises:
        ValueError: naming ``field``, the value and the builtin names.
    """
    if path and path.startswith("builtin:") and path not in builtin_names():
        raise ValueError(f"{field}={path!r} is no builtin model: the builtin models are {builtin_names()}")


def ensure_model(path_or_builtin: str, out_root: str | os.PathLike, **build_kwargs: Any) -> Path:
    """The model folder for ``model.path``: builds ``builtin:tiny_moe`` into ``out_root/tiny_moe`` (with
    ``build_kwargs`` passed to ``build_tiny_moe``), ``builtin:tiny_<arch>`` (``cluster.models.tiny_archs.ARCHS``)
    into ``out_root/tiny_<arch>`` (only ``build_kwargs["seed"]`` applies: their shapes are fixed), fetches a
    hub id (``owner/name`` naming no local path; ``cluster.models.hub_model``), or checks that a Hugging Face
    folder exists.

    Raises:
        FileNotFoundError: a folder path that does not exist or has no ``config.json``; a hub id the hub did not
            give.
        ValueError: an unknown ``builtin:`` name, or build arguments ``build_tiny_moe`` refuses.
    """
    if path_or_builtin.startswith("builtin:"):
        check_builtin(path_or_builtin, "model.path")
        arch = builtin_arch(path_or_builtin)
        if arch is not None:
            return build_tiny_arch(Path(out_root) / f"tiny_{arch}", arch, seed=build_kwargs.get("seed", 0))
        return build_tiny_moe(Path(out_root) / "tiny_moe", **build_kwargs)
    if hub_model.is_hub_id(path_or_builtin):
        return hub_model.download(path_or_builtin)  # a hub id: the snapshot folder (cluster/models/hub_model.py)
    path = Path(path_or_builtin).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model.path={path_or_builtin!r} is not a folder (give a Hugging Face model folder or {BUILTIN_TINY_MOE!r})"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path={path_or_builtin!r} has no config.json (not a Hugging Face model folder)")
    return path
