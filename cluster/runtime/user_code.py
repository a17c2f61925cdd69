"""User code that the run imports by name: ``module:function`` verifiers (``reward.verifier``, the
``reward.extra_terms``, a data row's own ``verifier``) and a ``module:function`` policy loss
(``learner.algorithm``, ``learner/loss_registry.py``).

Each one is imported on the driver before any actor starts, so that a missing module is a config error that
names the key (``reward.verifier``) and the module, not an actor traceback a minute later. Its module is
looked for where ``python -m`` looks: the working directory the run was started from, then ``PYTHONPATH``,
then the installed packages. (A console script such as ``gspo-train`` has its own folder, not the working
directory, first on ``sys.path``; ``with_working_dir_on_path`` puts the working directory back.)

The workers get the module through Ray's ``runtime_env`` ``py_modules`` (Ray's way to ship local modules to
every node; it prepends them to the workers' ``PYTHONPATH`` before the ``env_vars`` one: see
``ray/_private/runtime_env/py_modules.py`` and ``working_dir.set_pythonpath_in_context``). What is shipped is
the module's top-level file (``myrew.py``) or its top-level package folder (``mypkg/`` for
``mypkg.scores:fn``); a verifier that imports sibling modules should be a package. A module inside the
repository (already on the workers' ``PYTHONPATH``) or among the installed packages (in the workers'
environment) is not shipped.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from cluster.common import REPO_ROOT
from cluster.config import Config, ConfigError


def verifier_names(cfg: Config, rows: Iterable[Any] = ()) -> dict[str, str]:
    """The ``module:function`` verifiers the run uses, each with the config key (or data row) naming it.

    Args:
        cfg: the run config.
        rows: the data rows (``PromptRow``); their own ``verifier`` counts only when ``reward.verifier`` is
            unset (it overrides the rows' otherwise).

    Returns:
        ``{verifier name: where it is named}``, e.g. ``{"myrew:score": "reward.verifier"}``; built-in names
        (``math``, ``exact``, ...) are left out.
    """
    rw = cfg.reward
    named: dict[str, str] = {}
    if rw.verifier is not None and ":" in rw.verifier:
        named[rw.verifier] = "reward.verifier"
    for i, term in enumerate(rw.extra_terms):
        if ":" in term.verifier:
            named.setdefault(term.verifier, f"reward.extra_terms[{i}].verifier")
    if rw.verifier is None:
        for row in rows:
            if ":" in row.verifier:
                named.setdefault(row.verifier, f"the 'verifier' of data row {row.uid!r}")
    return named


def with_working_dir_on_path(cwd: Path | None = None) -> Path:
    """Put the working directory first on ``sys.path`` unless it is there (``python -m`` puts it there; a
    console script does not). Returns the working directory."""
    cwd = (cwd or Path.cwd()).resolve()
    if not any(_same(entry, cwd) for entry in sys.path):
        sys.path.insert(0, str(cwd))
    return cwd


def _same(entry: str, cwd: Path) -> bool:
    try:
        return Path(entry or ".").resolve() == cwd
    except OSError:
        return False


def _shared_roots() -> list[Path]:
    """Folders whose modules every worker already has: the repository and the interpreter's own paths."""
    roots = [REPO_ROOT]
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            roots.append(Path(path).resolve())
    return roots


def module_source(module: ModuleType) -> Path | None:
    """What to ship for a top-level user module: its ``.py`` file or its package folder; None when the
    workers already have it (inside the repository or the interpreter's paths) or it is not Python source
    (a built-in or compiled module, which must be installed on the nodes)."""
    paths = list(getattr(module, "__path__", None) or [])
    if paths:
        if len(paths) != 1:
            return None  # a namespace package split over folders: Ray's py_modules takes one folder
        src = Path(paths[0]).resolve()
    else:
        file = getattr(module, "__file__", None)
        if not file or not file.endswith(".py"):
            return None
        src = Path(file).resolve()
    if any(src == root or src.is_relative_to(root) for root in _shared_roots()):
        return None
    return src


def check_user_verifiers(named: dict[str, str], cwd: Path | None = None) -> list[str]:
    """Import every user verifier on the driver and list the modules the workers need shipped.

    Args:
        named: ``verifier_names``'s answer.
        cwd: the working directory the run was started from (default: this process's); put on ``sys.path``.

    Returns:
        Paths for the runtime env's ``py_modules`` (files or folders, each once, in order).

    Raises:
        ConfigError: a verifier's module cannot be imported or has no such function; the message names the
            config key, the verifier and the module, and where the module was looked for.
    """
    from reward.verifiers import get_verifier

    cwd = with_working_dir_on_path(cwd)
    ship: list[str] = []
    for name, key in named.items():
        try:
            get_verifier(name)
        except ValueError as err:
            raise ConfigError(_not_found(f"{key}={name!r}", err, "verifier", name, cwd)) from None
        src = _shipped_source(name)
        if src is not None and src not in ship:
            ship.append(src)
    return ship


def _not_found(what: str, err: ValueError, kind: str, name: str, cwd: Path) -> str:
    """The message of a user ``kind``'s (``module:function``) import failure, with where its module was looked for."""
    module_name = name.partition(":")[0]
    return (f"{what}: {err}. A user {kind}'s module (here {module_name!r}) must be in the working directory "
            f"({cwd}), on PYTHONPATH ({os.environ.get('PYTHONPATH') or 'unset'}) or installed")


def _shipped_source(name: str) -> str | None:
    """``module_source`` of the top-level package of an imported ``module:function``, as a string."""
    src = module_source(sys.modules[name.partition(":")[0].split(".")[0]])
    return None if src is None else str(src)


def check_user_loss(cfg: Config, cwd: Path | None = None) -> list[str]:
    """Import a ``module:function`` policy loss (``learner.algorithm``) on the driver, build its settings from
    the config, and list its module for the workers (the learner ranks import it), as for a verifier.

    Returns:
        ``[]`` for a built-in loss; otherwise the paths for the runtime env's ``py_modules`` (empty when the
        module is inside the repository or installed).

    Raises:
        ConfigError: the module cannot be imported, has no such loss, or the loss refuses the config's
            ``learner.clip_low`` / ``clip_high`` / ``loss_agg`` / ``loss_options``; the message names the key.
    """
    from learner.loss_registry import get_policy_loss
    from learner.loss_settings import is_user_loss
    from learner.objectives import resolve_objective

    lc = cfg.learner
    if not is_user_loss(lc.algorithm):
        return []
    cwd = with_working_dir_on_path(cwd)
    try:
        get_policy_loss(lc.algorithm)
        resolve_objective(lc.algorithm, lc.clip_low, lc.clip_high, lc.loss_agg, lc.loss_options)
    except ValueError as err:
        raise ConfigError(_not_found(f"learner.algorithm={lc.algorithm!r}", err, "loss", lc.algorithm, cwd)) from None
    src = _shipped_source(lc.algorithm)
    return [] if src is None else [src]


def check_user_env(cfg: Config, cwd: Path | None = None) -> list[str]:
    """Import the environment class (``env.cls``), tool functions (``env.tools``, with their tools' schemas) or
    agent (``env.agent``) on the driver, and list their modules for the workers (the env workers import them), as
    for a verifier.

    Returns:
        ``[]`` without ``env``; otherwise the paths for the runtime env's ``py_modules`` (none for modules inside
        the repository or installed).

    With ``env.openenv`` the server is checked instead (``_check_openenv``).

    Raises:
        ConfigError: a module cannot be imported, has no such class or function, or a tool has no usable schema
            (type hints and a docstring); an OpenEnv server that does not start or answer; the message names the
            key.
    """
    from reward.environment import load_environment_class, load_tools, tool_schemas

    ec = cfg.env
    if not ec.enabled:
        return []
    cwd = with_working_dir_on_path(cwd)
    if ec.openenv.enabled:
        return _check_openenv(cfg, cwd)
    if ec.agent is None and ec.gateway.harness is not None:
        return []  # a separate program: nothing of it imports here
    names = [ec.cls] if ec.cls is not None else [ec.agent] if ec.agent is not None else list(ec.tools)
    key = "env.cls" if ec.cls is not None else "env.agent" if ec.agent is not None else "env.tools"
    try:
        if ec.cls is not None:
            load_environment_class(ec.cls)
        elif ec.agent is not None:
            from reward.agent_runner import load_agent

            load_agent(ec.agent)
        else:
            tool_schemas(load_tools(ec.tools))
    except ValueError as err:
        raise ConfigError(_not_found(f"{key}={ec.cls or ec.agent or ec.tools!r}", err, "environment", names[0],
                                     cwd)) from None
    return sorted({src for name in names if (src := _shipped_source(name)) is not None})


def _check_openenv(cfg: Config, cwd: Path) -> list[str]:
    """``env.openenv`` before any service starts: its app imported here (its module shipped as a verifier's),
    then the server started on this machine (or the URL reached), one session opened, reset and closed, the server
    stopped (``reward.openenv_env.probe``).

    Raises:
        ConfigError: the app's module does not import, or the server does not start or answer; the message names
            the key and the reason (with the end of the server's log).
    """
    import logging

    from reward.environment import resolve_user_object
    from reward.openenv_env import probe
    from reward.openenv_server import OpenEnvStartError

    oc = cfg.env.openenv
    shipped: list[str] = []
    if oc.app is not None:
        try:
            resolve_user_object(oc.app, "env.openenv.app")
        except ValueError as err:
            raise ConfigError(_not_found(f"env.openenv.app={oc.app!r}", err, "OpenEnv app", oc.app, cwd)) from None
        if (src := _shipped_source(oc.app)) is not None:
            shipped.append(src)
    try:
        logging.getLogger(__name__).info("OpenEnv: %s", probe(cfg.env))
    except OpenEnvStartError as err:
        raise ConfigError(f"the OpenEnv server does not start or answer, so the run stops before any service "
                          f"starts: {err}") from None
    return shipped
