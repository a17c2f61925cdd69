"""Every node sees the same files: the shared-storage contract of docs/cluster.md, checked at start.

Before any actor starts, one small task per live node (pinned with Ray's ``NodeAffinitySchedulingStrategy``)
looks at the paths the run's actors will open there, and the driver compares the answers with its own view:

- the model folder: ``config.json``, the tokenizer's files and ``generation_config.json`` exist with the same
  size and SHA-256 as on the driver (the weights are large: they are only checked to exist, with their size);
- the served models' folders (``reward.judge.model_path``, ``distill.model_path``) when they are local folders
  the driver sees, compared as the model folder (a ``builtin:`` model is built into the run folder and a hub id
  is fetched when the model starts: neither exists yet);
- the data files (``data.train_path``, ``data.test_path`` resolved as ``cluster.data.prompts`` does): exist, same size;
- the output folder (``trainer.output_dir``): exists and is writable (the learner ranks write checkpoints there);
- the user verifier modules (``module:function``): import there, with the job's runtime env, and name a callable.

A mismatch stops the run with a ``ConfigError`` naming the node (its id and address), the field for a served
model's folder, and the path.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import Any

from cluster.config import Config, ConfigError

#: files of a model folder compared by content (small); any ``*.safetensors`` / ``*.bin`` is compared by size
HASHED_MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _data_files(cfg: Config) -> list[str]:
    """The data files the run reads (globs expanded), as absolute paths; none for generated tasks."""
    from cluster.data.prompts import resolve_data_path

    out: list[str] = []
    for path in (cfg.data.train_path, cfg.data.test_path):
        if path and cfg.data.task in ("files", "gsm8k"):
            p = resolve_data_path(path)
            out += sorted(glob.glob(str(p), recursive=True)) if glob.has_magic(str(p)) else [str(p)]
    return out


def served_folders(cfg: Config) -> dict[str, str]:
    """The served models' local folders (``cluster.planning.actor_placement.served_models``), by field:
    ``{"reward.judge.model_path": path, "distill.model_path": path}``, each only when the model is on and its
    path is neither ``builtin:...`` nor a hub id (``cluster.models.hub_model.is_hub_id``); the path as the config
    holds it (``cluster.config.absolute_paths`` made it absolute)."""
    from cluster.models.hub_model import is_hub_id
    from cluster.planning.actor_placement import served_models

    out = {}
    for m in served_models(cfg):
        path = str(m.settings.model_path)
        if not path.startswith("builtin:") and not is_hub_id(path):
            out[f"{m.section}.model_path"] = path
    return out


def _model_files(folder: Path) -> dict[str, Any]:
    """Per model file of ``folder`` its ``[size in bytes, SHA-256 hex]`` (the digest ``None`` for weights)."""
    files: dict[str, Any] = {}
    for f in sorted(folder.glob("*")) if folder.is_dir() else []:
        if f.name in HASHED_MODEL_FILES:
            files[f.name] = [f.stat().st_size, _digest(f)]
        elif f.suffix in (".safetensors", ".bin"):
            files[f.name] = [f.stat().st_size, None]
    return files


def look(model_path: str, data_files: list[str], output_dir: str, verifiers: list[str],
         served: dict[str, str] | None = None) -> dict[str, Any]:
    """What one node sees (runs on that node): per model file its size and digest (``None`` when missing),
    per data file its size, whether the output folder is writable, per verifier an import error or None, and per
    served model's folder (``served``: field -> path, ``served_folders``) its path, whether it is a folder and
    its files as the model's."""
    model = Path(model_path)
    files = _model_files(model)
    data = {p: (os.path.getsize(p) if os.path.isfile(p) else None) for p in data_files}
    out = Path(output_dir)
    writable = out.is_dir() and os.access(out, os.W_OK | os.X_OK)
    errors: dict[str, str | None] = {}
    for name in verifiers:
        module, _, func = name.partition(":")
        try:
            import importlib

            fn = getattr(importlib.import_module(module), func)
            errors[name] = None if callable(fn) else f"{func!r} is not callable"
        except Exception as e:  # noqa: BLE001 - any failure to import is the answer
            errors[name] = f"{type(e).__name__}: {e}"
    served_seen = {field: {"path": path, "dir": Path(path).is_dir(), "files": _model_files(Path(path))}
                   for field, path in (served or {}).items()}
    return {"model_dir": model.is_dir(), "model": files, "data": data, "output_writable": writable,
            "verifiers": errors, "served": served_seen}


def _compare_model(mine: dict[str, Any], theirs: dict[str, Any], node: str, path: str, field: str = "") -> list[str]:
    """The model files (``_model_files``) of folder ``path`` that differ on ``node`` from the driver's, each
    sentence naming ``field`` first when given (a served model's, ``"distill.model_path"``)."""
    out, where = [], f"node {node}: {field + ' ' if field else ''}{path}"
    for name, (size, digest) in mine.items():
        got = theirs.get(name)
        if got is None:
            out.append(f"{where}/{name} is missing")
        elif got != [size, digest]:
            what = "size" if got[0] != size else "content (SHA-256)"
            out.append(f"{where}/{name} differs from the driver's ({what})")
    return out


def _compare_served(mine: dict[str, Any], theirs: dict[str, Any], node: str) -> list[str]:
    """The served models' folders that ``node`` lacks or sees other than the driver, naming the field; a folder
    the driver does not see itself is left to the model's own start (it refuses naming the field)."""
    out = []
    for field, seen in mine.get("served", {}).items():
        if not seen["dir"]:
            continue
        got = theirs.get("served", {}).get(field) or {"dir": False, "files": {}}
        if not got["dir"]:
            out.append(f"node {node}: {field} {seen['path']} does not exist there")
            continue
        out += _compare_model(seen["files"], got["files"], node, seen["path"], field)
    return out


def compare(mine: dict[str, Any], theirs: dict[str, Any], node: str, paths: dict[str, str]) -> list[str]:
    """The differences between the driver's ``look`` and a node's, one sentence each naming ``node`` and the
    path (``paths``: ``model``, ``output`` folder; a served model's folder is named with its field)."""
    if not theirs["model_dir"]:
        return [f"node {node}: model.path {paths['model']} does not exist there"] + _compare_served(mine, theirs, node)
    out = _compare_model(mine["model"], theirs["model"], node, paths["model"])
    for path, size in mine["data"].items():
        if theirs["data"].get(path) != size:
            seen = "missing" if theirs["data"].get(path) is None else f"{theirs['data'][path]} bytes, driver {size}"
            out.append(f"node {node}: data file {path} is {seen}")
    if not theirs["output_writable"]:
        out.append(f"node {node}: trainer.output_dir {paths['output']} is missing or not writable there")
    out += [f"node {node}: user verifier {name} does not import there ({err})"
            for name, err in theirs["verifiers"].items() if err]
    return out + _compare_served(mine, theirs, node)


def check_nodes(cfg: Config, model_path: str, verifiers: list[str], env: dict[str, str]) -> int:
    """Run ``look`` on every live node of the connected cluster and compare with the driver's own.

    Args:
        cfg: the run config (data paths, output folder, the served models' folders: ``served_folders``).
        model_path: the model folder every actor loads.
        verifiers: the ``module:function`` verifiers the run uses.
        env: the services' environment (``cluster.runtime.services.actor_env``): the tasks import as the actors do.

    Returns:
        the number of nodes checked.

    Raises:
        ConfigError: a node sees another model, served model (``reward.judge.model_path``,
            ``distill.model_path``), data file or output folder than the driver, or cannot import a verifier; the
            message names every such node, field and path.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    data = _data_files(cfg)
    args = (model_path, data, str(Path(cfg.trainer.output_dir).resolve()), sorted(verifiers), served_folders(cfg))
    mine = look(*args)
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    task = ray.remote(look)
    refs = [task.options(num_cpus=0, runtime_env={"env_vars": env},
                         scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote(*args)
            for n in nodes]
    paths = {"model": model_path, "output": args[2]}
    problems = []
    for n, seen in zip(nodes, ray.get(refs)):
        problems += compare(mine, seen, f"{n['NodeID'][:12]} ({n['NodeManagerAddress']})", paths)
    if problems:
        raise ConfigError("the nodes do not see the same files (docs/cluster.md, shared storage): "
                          + "; ".join(problems))
    return len(nodes)


def check_cluster(cfg: Config, model_path: str, verifiers: list[str]) -> None:
    """The start-up checks of a connected cluster, before any actor starts: the ``*.node_resources`` are
    offered (``cluster.runtime.placement.check_connected``) and, on a cluster this run did not start itself
    (``trainer.ray_address`` or ``RAY_ADDRESS``), every node sees the driver's files (``check_nodes``).

    Raises:
        ConfigError: see those two.
    """
    from cluster.runtime.placement import check_connected
    from cluster.runtime.services import actor_env

    check_connected(cfg)
    if cfg.trainer.ray_address or os.environ.get("RAY_ADDRESS"):
        check_nodes(cfg, model_path, verifiers, actor_env(1))
