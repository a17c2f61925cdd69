"""Submit training as a Ray job: ``python -m cluster.submit CONFIG [dotted.key=value ...]`` (``gspo-submit``).

The job's entry point is ``python -m cluster.train CONFIG overrides`` run by the cluster's job server (the Ray
Jobs API, ``ray job submit`` semantics): the repository is shipped as the job's ``working_dir`` (without
``.venv``, ``outputs``, ``.git`` and caches), user ``module:function`` verifiers found outside it (in the
working directory or on ``PYTHONPATH``) as ``py_modules``, the driver connects to the cluster through the
``RAY_ADDRESS`` that the job server sets, this command follows the job's logs and exits with its status.

A config outside the repository is a user's own project: its folder (the working directory when the config
lies in it, else the config's folder, or ``--folder DIR``) is the job's ``working_dir`` instead, this project's
packages travel as ``py_modules``, the folder's modules import by name on every node and its relative data
paths resolve in the shipped copy (``cluster.submit.folder``); what is too large for Ray or missing is refused
before anything is submitted.

Where the job goes:

- ``--address`` or ``RAY_API_SERVER_ADDRESS`` / ``RAY_ADDRESS``: the dashboard of a running cluster
  (``http://127.0.0.1:8265`` style; the job server lives in the dashboard).
- Neither: a local head is started for this job, bound to 127.0.0.1 (GCS, dashboard and job server
  included, every port chosen free, a private temp dir), and stopped when the job ends unless
  ``--keep-cluster`` (or ``--no-wait``) is given. Its workers use this interpreter's environment (no
  package installs in the runtime env); a real cluster runs an image with the project installed.

Other verbs, against ``--address`` / ``RAY_ADDRESS``: ``--status ID``, ``--logs ID``, ``--stop ID``; and
``--stop-head DIR`` stops a local head that ``--keep-cluster``/``--no-wait`` left running.

Exit status: 0 when the job SUCCEEDED, 1 FAILED, 3 STOPPED, 2 bad arguments or config, 4 no cluster (the
local head did not start, or nothing answers at the address), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from cluster.submit import folder as submit_folder
from cluster.common import REPO_ROOT
from cluster.config import ConfigError, load_config
from cluster.runtime.user_code import check_user_env, check_user_loss, check_user_verifiers, verifier_names
# The local head and the Jobs API client; re-exported (cluster.submit.job.LocalHead etc.).
from cluster.runtime.local_head import (
    HEAD_STATE_FILE,
    LocalHead,
    SubmitError,
    head_processes,
    make_client,
    stop_head_from_dir,
    stop_head_processes,
)


#: gitignore-style patterns left out of the shipped working_dir (Ray also honours .gitignore).
WORKING_DIR_EXCLUDES = [
    ".venv/",
    ".git/",
    "outputs/",
    "wandb/",
    "__pycache__/",
    "*.pyc",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".cache/",
    "*.egg-info/",
    "build/",
    "venv/",
]

#: Variables copied from the submitting shell into the job's environment when they are set there. Secrets
#: (WANDB_API_KEY, HF_TOKEN) are NOT in this list: a runtime env is visible to anyone who can read the
#: dashboard. Set them on the cluster's nodes, or pass them on purpose with ``--env NAME``.
FORWARDED_ENV = (
    "DS_ACCELERATOR",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_HOME",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
    "VLLM_CPU_KVCACHE_SPACE",
    "RAY_DEDUP_LOGS",
    "WANDB_MODE",
    "WANDB_SILENT",
    "WANDB_DIR",
)

EXIT_CODES = {"SUCCEEDED": 0, "FAILED": 1, "STOPPED": 3}


# ------------------------------------------------------------------------------------------- the job


def resolve_address(address: str | None) -> str | None:
    """The cluster to submit to: ``address``, else ``RAY_API_SERVER_ADDRESS``, else ``RAY_ADDRESS``, else None."""
    return address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or None


#: forwarded for CPU runs only: a GPU run's services take their device from the config (cluster.runtime.services.actor_env)
CPU_ONLY_FORWARDED = ("DS_ACCELERATOR", "VLLM_CPU_KVCACHE_SPACE")


def job_runtime_env(extra_env: dict[str, str] | None = None, extra: dict[str, Any] | None = None,
                    py_modules: list[str] | None = None, on_gpu: bool = False,
                    working_dir: Path | None = None) -> dict[str, Any]:
    """The job's runtime env: the repository (or ``working_dir``, a user's folder: ``cluster.submit.folder``) as
    ``working_dir`` (minus ``WORKING_DIR_EXCLUDES``), the user
    verifier modules as ``py_modules`` (``cluster.runtime.user_code.check_user_verifiers``: files or folders outside
    the repository, shipped to every node and put on the job's and its workers' ``PYTHONPATH``), the
    ``FORWARDED_ENV`` variables set in this shell, ``extra_env``, and ``extra`` merged on top (for example
    ``{"pip": [...]}`` or ``{"image_uri": ...}``; ``env_vars``, ``excludes`` and ``py_modules`` are merged,
    not replaced). ``on_gpu`` (the run's learner or engines hold GPUs): ``CPU_ONLY_FORWARDED`` stay behind."""
    skip = CPU_ONLY_FORWARDED if on_gpu else ()
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ and k not in skip}
    env.setdefault("GSPO_PROGRESS", "0")  # no live progress bar in job logs: one log line per step
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra_env or {})
    rt: dict[str, Any] = {"working_dir": str(working_dir or REPO_ROOT), "excludes": list(WORKING_DIR_EXCLUDES),
                          "env_vars": env}
    if py_modules:
        rt["py_modules"] = list(py_modules)
    for key, value in (extra or {}).items():
        if key == "env_vars":
            rt["env_vars"].update(value)
        elif key in ("excludes", "py_modules"):
            rt[key] = rt.get(key, []) + list(value)
        else:
            rt[key] = value
    return rt


def _config_in_repo(config: str) -> str:
    """The config's path relative to the repository root (the job sees only the shipped copy)."""
    p = Path(config).resolve()
    try:
        rel = p.relative_to(REPO_ROOT)
    except ValueError:
        raise ConfigError(f"config {config!r} is outside the repository {str(REPO_ROOT)!r}; only the repository "
                          "is shipped to the cluster: copy it into configs/") from None
    top = rel.parts[0] + "/"
    if top in WORKING_DIR_EXCLUDES:
        raise ConfigError(f"config {config!r} is in {top}, which is not shipped to the cluster")
    return rel.as_posix()


def path_overrides(config: str, overrides: list[str], cwd: Path | None = None,
                   folder: Path | None = None) -> list[str]:
    """Overrides that make the run's relative paths absolute, so that the job (which runs in a copy of the
    repository in Ray's temp dir) reads and writes the caller's files: ``trainer.output_dir`` (relative to
    ``cwd``), ``data.train_path``/``data.test_path`` (as ``cluster.data.prompts`` resolves them: from ``cwd`` when the
    file exists there, else from the repository root) and ``model.path`` when it is a relative folder (not a hub id).

    On a multi-node cluster these paths must exist on the head node (shared filesystem, same mount point).

    ``folder``: the user's folder that travels with the job (``cluster.submit.folder``): a relative data path
    found in it stays relative (the job runs in the shipped copy); one found nowhere (folder, ``cwd``, the
    repository root) is refused.

    Raises:
        ConfigError: the config does not load or validate, or (with ``folder``) a data path does not exist.
    """
    from cluster.data.prompts import resolve_data_path

    cwd = (cwd or Path.cwd()).resolve()
    cfg = load_config(config, overrides)
    out = []
    if not Path(cfg.trainer.output_dir).is_absolute():
        out.append(f"trainer.output_dir={cwd / cfg.trainer.output_dir}")
    for key in ("train_path", "test_path"):
        value = getattr(cfg.data, key)
        if not value:
            continue
        if folder is not None:
            if _found(folder / value):
                continue
            if not any(_found(base / value) for base in (cwd, REPO_ROOT)):
                raise ConfigError(f"data.{key}={value!r} does not exist: not in the shipped folder {str(folder)!r}, "
                                  f"the working directory {str(cwd)!r} nor the repository {str(REPO_ROOT)!r}")
        if not Path(value).is_absolute():
            p = cwd / value
            out.append(f"data.{key}={p.resolve() if p.exists() else resolve_data_path(value).resolve()}")
    mp = cfg.model.path
    from cluster.models.hub_model import is_hub_id

    if not mp.startswith("builtin:") and not is_hub_id(mp, cwd) and not Path(mp).is_absolute():
        out.append(f"model.path={(cwd / mp).resolve()}")
    return out


def _found(p: Path) -> bool:
    """A data path (file, folder or glob) matches something."""
    import glob

    return p.exists() or (glob.has_magic(str(p)) and bool(glob.glob(str(p), recursive=True)))


def train_entrypoint(config: str, overrides: list[str], python: str = "python") -> str:
    """The job's shell command: ``python -m cluster.train CONFIG overrides`` (quoted)."""
    return shlex.join([python, "-m", "cluster.train", _config_in_repo(config), *overrides])


def submit_job(client, entrypoint: str, runtime_env: dict[str, Any], submission_id: str | None = None) -> str:
    """Submit ``entrypoint`` with ``runtime_env`` through the Jobs API; returns the submission id."""
    return client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env, submission_id=submission_id)


def follow(client, job_id: str, out=None, poll_s: float = 2.0) -> str:
    """Print the job's logs as they come (``tail_job_logs``) until it ends; returns its final status name.

    If the log stream breaks (a restarted dashboard, a proxy), falls back to polling the status.
    """
    out = out or sys.stdout

    async def tail() -> None:
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except RuntimeError as e:
        print(f"[cluster.submit] log stream of {job_id} ended: {e}; polling its status", file=sys.stderr)
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status.value
        time.sleep(poll_s)


def wait_terminal(client, job_id: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> str:
    """Poll until the job is in a terminal state or ``timeout_s`` passes; returns the last status name."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal() or time.monotonic() > deadline:
            return status.value
        time.sleep(poll_s)


# -------------------------------------------------------------------------------------------------- CLI


def _parse_env(items: list[str]) -> dict[str, str]:
    env = {}
    for item in items:
        if "=" in item:
            k, v = item.split("=", 1)
        elif item in os.environ:
            k, v = item, os.environ[item]
        else:
            raise ConfigError(f"--env {item}: not of the form NAME=VALUE and NAME is not set in this shell")
        env[k] = v
    return env


def _local_cpus(config: str, overrides: list[str]) -> int:
    from cluster.planning.plan import plan

    cfg = load_config(config, overrides)
    return max(os.cpu_count() or 1, math.ceil(plan(cfg)["logical_cpus"] - 1e-9))


def _uses_gpus(config: str, overrides: list[str]) -> bool:
    cfg = load_config(config, overrides)
    return bool(cfg.learner.num_gpus_per_rank or cfg.rollout.num_gpus_per_engine)


def prepare_config(config: str, overrides: list[str], folder: str | None = None,
                   extra_excludes: list[str] = (), limit: int | None = None) -> dict[str, Any]:
    """Check a config before submission and decide what travels with it.

    Returns:
        ``overrides`` (with ``path_overrides`` added), ``py_modules`` (user package folders outside the
        repository; with a user folder, this project's packages and user packages outside the folder), ``on_gpu``
        and ``root``: the user's folder (``submit_folder.choose_folder``), the job's ``working_dir``, for a config
        outside the repository, else None.

    Raises:
        ConfigError: the config is refused, a user module does not import, a data path is missing, or the user's
            folder is over Ray's package ``limit`` (``submit_folder.check_folder_size``).
    """
    root = None
    if not Path(config).resolve().is_relative_to(REPO_ROOT):
        root = submit_folder.choose_folder(config, folder)
    elif folder is not None:
        raise ConfigError("--folder is for a config outside the repository (the repository travels already)")
    overrides = overrides + path_overrides(config, overrides, folder=root)
    cfg = load_config(config, overrides)  # refuse a bad config here, before anything starts
    if root is None:
        _config_in_repo(config)
    # User verifiers, losses and environments import here (or the config is refused naming them) and travel.
    modules = check_user_verifiers(verifier_names(cfg), cwd=root)
    modules += [m for m in check_user_loss(cfg, cwd=root) + check_user_env(cfg, cwd=root) if m not in modules]
    on_gpu = cfg.learner.num_gpus_per_rank > 0 or cfg.rollout.num_gpus_per_engine > 0
    if root is not None:
        modules = _folder_modules(root, modules, WORKING_DIR_EXCLUDES + list(extra_excludes), limit)
    elif single := [m for m in modules if not Path(m).is_dir()]:
        raise ConfigError(f"the user module {single[0]!r} is a single file outside the repository, which Ray's job "
                          "client cannot ship (py_modules entries travel as folders): make it a package folder, or "
                          "put the config beside it and submit from that folder (it then travels as the job's "
                          "working_dir)")
    return {"overrides": overrides, "py_modules": modules, "on_gpu": on_gpu, "root": root}


def _folder_modules(root: Path, modules: list[str], excludes: list[str], limit: int | None) -> list[str]:
    """``py_modules`` beside a user folder (the job's ``working_dir``): this project's packages and the user
    ``modules`` outside the folder. Refuses a folder over ``limit``, a module of the folder named like one of
    this project's, a named module that lies in the folder but is left out of its package, and a single-file
    module outside it (Ray's job client ships ``py_modules`` entries as folders only)."""
    submit_folder.check_folder_size(root, excludes, limit)
    files = submit_folder.folder_files(root, excludes)
    submit_folder.top_level_modules(root, files)  # refuses a module that would shadow this project's
    shipped = {p for p, _ in files}
    for m in modules:
        src = Path(m)
        if src.is_relative_to(root) and not (src in shipped or any(f.is_relative_to(src) for f in shipped)):
            raise ConfigError(f"the module {str(src)!r} that the config names is left out of the shipped folder by "
                              "a .gitignore, .rayignore or the excludes: it would be missing in the job")
    outside = [m for m in modules if not Path(m).is_relative_to(root)]
    if single := [m for m in outside if not Path(m).is_dir()]:
        raise ConfigError(f"the module {single[0]!r} lies outside the shipped folder {str(root)!r} and is a single "
                          "file, which Ray's job client cannot ship (py_modules entries travel as folders): move it "
                          "into the folder, or make it a package folder")
    return [*submit_folder.project_modules(), *outside]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gspo-submit", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("config", nargs="?", help="YAML config: in the repository (configs/*.yaml), or in your own "
                   "folder, which then travels with the job")
    p.add_argument("overrides", nargs="*", help="dotted.key=value overrides passed to cluster.train")
    p.add_argument("--address", help="job server of a running cluster (http://HOST:8265); default RAY_ADDRESS")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return (keeps a local head)")
    p.add_argument("--keep-cluster", action="store_true", help="leave the local head running after the job")
    p.add_argument("--status", metavar="ID", help="print a job's status")
    p.add_argument("--logs", metavar="ID", help="print a job's logs so far")
    p.add_argument("--stop", metavar="ID", help="stop a job and wait until it has ended")
    p.add_argument("--stop-head", metavar="DIR", help="stop the local head whose temp dir is DIR")
    p.add_argument("--env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="extra job environment variable (NAME alone copies it from this shell); repeatable")
    p.add_argument("--runtime-env-json", help="JSON merged into the runtime env (pip, image_uri, env_vars, ...)")
    p.add_argument("--entrypoint", metavar="CMD",
                   help="run CMD instead of cluster.train (smoke-test a cluster); CONFIG is then not needed")
    p.add_argument("--folder", metavar="DIR",
                   help="config outside the repository: the folder shipped with it (default: the working directory "
                   "when the config is in it, else the config's folder)")
    p.add_argument("--submission-id", help="job id to use (default: Ray picks one)")
    p.add_argument("--python", default=None,
                   help="interpreter of the entry point (default: this one on a local head, `python` on a cluster)")
    p.add_argument("--temp-dir", help="local head: its --temp-dir (default /tmp/gspo-ray-*)")
    p.add_argument("--num-cpus", type=int, help="local head: logical CPUs (default: what the config reserves, "
                                                  "at least the machine's cores)")
    return p


def _verb(args, address: str | None) -> int:
    if not address:
        print("error: --status/--logs/--stop need --address or RAY_ADDRESS (the dashboard, http://HOST:8265)",
              file=sys.stderr)
        return 2
    try:
        client = make_client(address)
    except SubmitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    job_id = args.status or args.logs or args.stop
    try:
        if args.status:
            info = client.get_job_info(job_id)
            print(f"{job_id}: {info.status.value}" + (f" ({info.message})" if info.message else ""))
        elif args.logs:
            sys.stdout.write(client.get_job_logs(job_id))
        else:
            stopped = client.stop_job(job_id)
            final = wait_terminal(client, job_id)
            print(f"{job_id}: {'stop requested' if stopped else 'was not running'}; status {final}")
    except Exception as e:  # unknown job id, refused request: Ray raises RuntimeError and its own errors
        print(f"error: job {job_id!r} at {address}: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """The ``gspo-submit`` command (``python -m cluster.submit``); returns the exit code."""
    args = build_parser().parse_args(argv)
    address = resolve_address(args.address)
    try:
        if args.stop_head:
            n = stop_head_from_dir(args.stop_head)
            print(f"stopped {n} processes of the head in {args.stop_head}")
            return 0
        if args.status or args.logs or args.stop:
            return _verb(args, address)
        if not args.config and not args.entrypoint:
            print("error: a CONFIG is needed (or --entrypoint, --status, --logs, --stop, --stop-head)", file=sys.stderr)
            return 2
        if args.entrypoint and (args.config or args.overrides):
            print("error: --entrypoint replaces CONFIG and overrides; give one or the other", file=sys.stderr)
            return 2
        overrides = list(args.overrides)
        extra = json.loads(args.runtime_env_json) if args.runtime_env_json else None
        # an --entrypoint job's device and files are its own business
        prep: dict[str, Any] = {"overrides": overrides, "py_modules": [], "on_gpu": False, "root": None}
        if args.config:
            prep = prepare_config(args.config, overrides, args.folder, (extra or {}).get("excludes", []))
            overrides = prep["overrides"]
        runtime_env = job_runtime_env(_parse_env(args.env), extra, prep["py_modules"], on_gpu=prep["on_gpu"],
                                      working_dir=prep["root"])
    except (ConfigError, SubmitError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    head = None
    if not address:
        if args.config:
            num_cpus = args.num_cpus or _local_cpus(args.config, overrides)
            num_gpus = None if _uses_gpus(args.config, overrides) else 0
        else:
            num_cpus, num_gpus = args.num_cpus or (os.cpu_count() or 1), None
        head = LocalHead(num_cpus=num_cpus, num_gpus=num_gpus, temp_dir=args.temp_dir)
        print(f"[cluster.submit] starting a local Ray head on 127.0.0.1 (temp dir {head.temp_dir})", file=sys.stderr)
        try:
            head.start()
        except SubmitError as e:
            print(f"error: {e}", file=sys.stderr)
            return 4
        address = head.dashboard_url
        print(f"[cluster.submit] Ray dashboard: {address}", file=sys.stderr)
    keep = head is not None and (args.keep_cluster or args.no_wait)
    python = args.python or (sys.executable if head is not None else "python")
    job_id = None
    try:
        client = head.client() if head is not None else make_client(address)
        if args.entrypoint:
            entrypoint = args.entrypoint
        elif prep["root"] is not None:
            entrypoint = shlex.join(submit_folder.folder_entrypoint(prep["root"], args.config, overrides, python))
        else:
            entrypoint = train_entrypoint(args.config, overrides, python)
        job_id = submit_job(client, entrypoint, runtime_env, args.submission_id)
        print(f"[cluster.submit] submitted {job_id}: {entrypoint}", file=sys.stderr)
        if args.no_wait:
            print(job_id)
            return 0
        status = follow(client, job_id)
        print(f"[cluster.submit] job {job_id} {status}", file=sys.stderr)
        return EXIT_CODES.get(status, 1)
    except SubmitError as e:
        print(f"error: {e}", file=sys.stderr)
        return 4
    except KeyboardInterrupt:
        if head is not None and not keep and job_id:
            print(f"[cluster.submit] interrupted: stopping {job_id} and the local head", file=sys.stderr)
            try:
                client.stop_job(job_id)
                wait_terminal(client, job_id, timeout_s=30)
            except Exception:
                pass
        elif job_id:
            print(f"[cluster.submit] interrupted: job {job_id} keeps running; stop it with "
                  f"`python -m cluster.submit --address {address} --stop {job_id}`", file=sys.stderr)
        return 130
    finally:
        if head is not None:
            if keep:
                auth = " ".join(f"{k}={v}" for k, v in head.auth_env().items())
                print(f"[cluster.submit] local head kept. Use it with: {auth} RAY_ADDRESS={head.dashboard_url} "
                      f"python -m cluster.submit ...; stop it with "
                      f"`python -m cluster.submit --stop-head {head.temp_dir}`", file=sys.stderr)
            else:
                head.stop(remove_temp_dir=True)


if __name__ == "__main__":
    sys.exit(main())
