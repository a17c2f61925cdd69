"""What the terminal shows during a run, and where everything else goes.

Quiet (the default): the terminal shows this project's own log records (``cluster``, ``learner``,
``reward``, ``rollout``), the live step line, and errors from anywhere (ERROR and above, Ray's
actor-death messages, tracebacks). Everything else goes to the run's ``logs/`` folder:

- ``logs/driver.log``: every log record of the driver at INFO and above (third-party ones and Python
  warnings included);
- ``logs/workers/worker-<pid>.log``: the whole stdout and stderr of each Ray worker process (learner ranks,
  rollout engines, reward workers and their children): vLLM and torch warnings, "Loading weights" bars.
  A Ray ``worker_process_setup_hook`` (``redirect_worker_output``) points the process's file descriptors 1
  and 2 there, so output written by C++ code and by child processes lands there too; the driver does not
  stream the workers' output (``ray.init(log_to_driver=False)``). Ray's own error reports about dead
  workers still reach the terminal (they travel on Ray's error channel, not the log stream).

Verbose (``--verbose``): everything as before, on the terminal.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

LOG_DIR_ENV = "GSPO_WORKER_LOG_DIR"  # the workers' log folder, read by redirect_worker_output
WORKER_SETUP_HOOK = "cluster.runtime.console.redirect_worker_output"  # a module path: Ray imports it in each worker
OWN_LOGGERS = ("cluster", "learner", "reward", "rollout", "bench", "__main__")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Progress bars carry no information worth keeping in a log file (a quiet run's workers inherit these from
# the driver's environment when it starts the local Ray): tqdm and huggingface_hub read them at import.
QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
}


def log_dir(run_dir: Path) -> Path:
    """The run's log folder: ``<run_dir>/logs``."""
    return Path(run_dir) / "logs"


def worker_log_dir(run_dir: Path) -> Path:
    """The Ray workers' log folder: ``<run_dir>/logs/workers``."""
    return log_dir(run_dir) / "workers"


class OwnOrErrors(logging.Filter):
    """Passes this project's records (``OWN_LOGGERS``) and any record at ERROR or above."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".")[0] in OWN_LOGGERS


def setup_driver_logging(run_dir: Path | None, verbose: bool) -> Path | None:
    """Configure the driver's logging: a terminal handler (everything at INFO when ``verbose``, else
    ``OwnOrErrors``) and, when ``run_dir`` is given, ``logs/driver.log`` with every record at INFO.

    When quiet, Python warnings become log records (file only), ``QUIET_ENV`` is set for libraries not
    imported yet, and with ``run_dir`` transformers' records go through the root logger (its own stderr
    handler is removed) so that they reach the file, not the terminal. Replaces the root logger's handlers
    (a second call reconfigures).

    Returns:
        The log folder, or None without ``run_dir``.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    fmt = logging.Formatter(LOG_FORMAT, datefmt="%H:%M:%S")
    term = logging.StreamHandler(sys.stderr)
    term.setFormatter(fmt)
    if not verbose:
        term.addFilter(OwnOrErrors())
        for key, value in QUIET_ENV.items():
            os.environ.setdefault(key, value)
    root.addHandler(term)
    logging.captureWarnings(not verbose)
    if run_dir is None:
        return None
    folder = log_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    file = logging.FileHandler(folder / "driver.log")
    file.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(file)
    if not verbose:
        worker_log_dir(run_dir).mkdir(parents=True, exist_ok=True)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_default_handler()
        hf_logging.enable_propagation()
    return folder


def through_root(name: str) -> None:
    """Send logger ``name``'s records through the root logger's handlers instead of its own (Ray installs a
    stderr handler on ``ray`` when imported, and stops propagation)."""
    lib = logging.getLogger(name)
    for handler in list(lib.handlers):
        lib.removeHandler(handler)
    lib.propagate = True


def redirect_worker_output() -> None:
    """Ray ``worker_process_setup_hook``: point this worker process's stdout and stderr (file descriptors 1
    and 2, inherited by its children) at ``$GSPO_WORKER_LOG_DIR/worker-<pid>.log``. Does nothing when the
    variable is unset (a verbose run)."""
    folder = os.environ.get(LOG_DIR_ENV)
    if not folder:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(folder) / f"worker-{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
