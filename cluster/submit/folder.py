"""A user's own folder submitted with the job (``gspo-submit myconf.yaml`` from a folder outside the repository).

What travels is what ``ray job submit --working-dir`` ships, with Ray's own runtime-env mechanism:

- the folder itself (config, verifier / environment / loss modules, data files, everything not excluded) as
  the job's ``working_dir``: Ray unpacks it on every node, runs the entry point (``python -m cluster.train
  <config relative to the folder> overrides``) in it, and puts it on the job's and its workers' ``PYTHONPATH``,
  so the folder's modules import by name everywhere and its relative data paths resolve in the shipped copy;
- this project's packages (``PROJECT_PACKAGES``) as ``py_modules`` (folders; on a cluster whose image has the
  project installed they simply shadow it with the submitting checkout's code, as the repository's own
  ``working_dir`` does for a config inside it);
- user modules found outside both (on ``PYTHONPATH``) as ``py_modules`` too, when they are package folders:
  Ray 2.60's job client packs every ``py_modules`` entry as a folder, so a single-file module there is refused
  here, naming it.

Left out: the runtime env's ``excludes`` (``cluster.submit.job.WORKING_DIR_EXCLUDES``: ``.git``, ``.venv``,
``__pycache__``, ``outputs``, ...), what a ``.gitignore`` (unless ``RAY_RUNTIME_ENV_IGNORE_GITIGNORE=1``) or a
``.rayignore`` in the folder names. The package must stay under Ray's limit, the GCS's largest message,
``RAY_max_grpc_message_size`` (512 MiB by default; ``ray._private.runtime_env.packaging.GCS_STORAGE_MAX_SIZE``),
checked here before anything is submitted, with the largest files named.
"""

from __future__ import annotations

import os
from pathlib import Path

from cluster.common import REPO_ROOT
from cluster.config import ConfigError

MIB = 1024 * 1024
PROJECT_PACKAGES = ("rollout", "learner", "reward", "cluster")  # pyproject.toml's top-level packages


def ray_package_limit() -> int:
    """Ray's largest runtime-env package in bytes (``RAY_max_grpc_message_size``, default 512 MiB)."""
    from ray._private.runtime_env.packaging import GCS_STORAGE_MAX_SIZE

    return int(GCS_STORAGE_MAX_SIZE)


def _include_gitignore() -> bool:
    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE

    return os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"


def choose_folder(config: str, folder: str | None = None, cwd: Path | None = None) -> Path:
    """The folder that travels with a config outside the repository: ``folder`` when given, else the working
    directory when the config lies in it, else the config's own folder.

    Raises:
        ConfigError: the config is not inside the folder, or the folder holds the repository.
    """
    cfg_path = Path(config).resolve()
    cwd = (cwd or Path.cwd()).resolve()
    if folder is not None:
        root = Path(folder).resolve()
        if not root.is_dir():
            raise ConfigError(f"--folder {folder!r} is not a folder")
    else:
        root = cwd if cfg_path.is_relative_to(cwd) else cfg_path.parent
    if not cfg_path.is_relative_to(root):
        raise ConfigError(f"config {config!r} is not inside the folder {str(root)!r} that is shipped with the job")
    if REPO_ROOT.is_relative_to(root):
        raise ConfigError(f"the folder {str(root)!r} holds this repository ({REPO_ROOT}); run gspo-submit from "
                          "your project's own folder, or name it with --folder")
    return root


def folder_files(root: Path, excludes: list[str]) -> list[tuple[Path, int]]:
    """``(path, bytes)`` of every file Ray would package from ``root`` (its ``excludes``, ``.gitignore`` and
    ``.rayignore`` applied by Ray's own walk), largest first."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    found: list[tuple[Path, int]] = []

    def handler(path: Path) -> None:
        if path.is_file():
            found.append((path, path.stat().st_size))

    _dir_travel(root, [_get_excludes(root, excludes)], handler, include_gitignore=_include_gitignore())
    return sorted(found, key=lambda item: -item[1])


#: bytes a zip entry adds beside its data (headers and central directory, a generous bound for short names)
ZIP_ENTRY_OVERHEAD = 200


def check_folder_size(root: Path, excludes: list[str], limit: int | None = None) -> int:
    """Refuse a folder whose package would be over Ray's limit; returns the package's estimated bytes.

    Ray zips a package without compression (``zipfile.ZipFile``'s default, ``ZIP_STORED``, in
    ``packaging._zip_files``), so its size is the files' sizes plus a few hundred bytes per file.

    Raises:
        ConfigError: the package reaches ``limit`` (default ``ray_package_limit()``); the message names the
            folder, the sizes, the largest files and how to leave files out.
    """
    limit = ray_package_limit() if limit is None else limit
    files = folder_files(root, excludes)
    total = sum(size for _, size in files) + ZIP_ENTRY_OVERHEAD * len(files)
    if total < limit:
        return total
    largest = ", ".join(f"{p.relative_to(root)} ({size / MIB:.1f} MiB)" for p, size in files[:5])
    raise ConfigError(
        f"the folder {str(root)!r} is too large to travel with the job: {total / MIB:.1f} MiB in {len(files)} files, "
        f"Ray's limit for one runtime-env package is {limit / MIB:.1f} MiB (RAY_max_grpc_message_size). Largest "
        f"files: {largest}. Leave files out with a .gitignore or .rayignore in the folder (outputs/, .git, .venv "
        "and __pycache__ are left out already), or keep large data and models on a filesystem every node sees "
        "and name them by absolute path")


def repo_top_names() -> set[str]:
    """Top-level module names this repository provides (a user module of the same name would shadow it)."""
    names = {p.stem for p in REPO_ROOT.glob("*.py")}
    names |= {p.name for p in REPO_ROOT.iterdir() if (p / "__init__.py").is_file()}
    return names


def top_level_modules(root: Path, files: list[tuple[Path, int]]) -> list[str]:
    """The folder's top-level modules, importable by name in the job: ``*.py`` files and package folders (with
    an ``__init__.py``) among ``files`` (``folder_files``), sorted.

    Raises:
        ConfigError: one has the name of a top-level module of this repository (it would shadow it).
    """
    mods: set[Path] = set()
    for path, _ in files:
        rel = path.relative_to(root)
        if len(rel.parts) == 1 and rel.suffix == ".py":
            mods.add(path)
        elif len(rel.parts) == 2 and rel.name == "__init__.py":
            mods.add(path.parent)
    clash = sorted(m.stem if m.is_file() else m.name for m in mods) if mods else []
    clash = [name for name in clash if name in repo_top_names()]
    if clash:
        raise ConfigError(f"the folder {str(root)!r} has modules named like this project's own ({', '.join(clash)}); "
                          "they would shadow them in the job: rename them")
    return sorted(str(m) for m in mods)


def folder_entrypoint(root: Path, config: str, overrides: list[str], python: str = "python") -> list[str]:
    """The job's command: ``cluster.train`` on the config's path relative to the folder (the job's working
    directory on every node)."""
    rel = Path(config).resolve().relative_to(root).as_posix()
    return [python, "-m", "cluster.train", rel, *overrides]


def project_modules() -> list[str]:
    """This project's package folders, the job's ``py_modules`` beside a user folder."""
    return [str(REPO_ROOT / name) for name in PROJECT_PACKAGES]
