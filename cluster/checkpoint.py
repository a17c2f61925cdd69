"""Checkpoint folders written atomically: everything goes into ``step_NNNNNNNN.tmp``, a ``COMPLETE`` marker is
written last, then the folder is renamed. A folder without the marker (a crash mid-write) is never picked as
the latest and is removed on the next save."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{8})$")
MARKER = "COMPLETE"
STATE_FILE = "trainer_state.json"


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def temp_dir_for(run_dir: Path, step: int) -> Path:
    """A fresh temporary folder for the checkpoint of ``step`` (any leftover of a crash is removed)."""
    tmp = checkpoint_root(run_dir) / f"step_{step:08d}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def finalize(run_dir: Path, tmp: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write the trainer state and the marker into ``tmp``, fsync, rename it to ``step_NNNNNNNN`` and prune
    old checkpoints down to ``keep``. Returns the final folder."""
    with open(tmp / STATE_FILE, "w") as f:
        json.dump(state, f)
        f.flush()
        os.fsync(f.fileno())
    with open(tmp / MARKER, "w") as f:
        f.write(str(step))
        f.flush()
        os.fsync(f.fileno())
    final = checkpoint_root(run_dir) / f"step_{step:08d}"
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in complete_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoint folders, oldest first (a folder counts only with its ``COMPLETE`` marker)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / MARKER).is_file() and (p / STATE_FILE).is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def read_state(ckpt: Path) -> dict[str, Any]:
    """The trainer state saved with a checkpoint.

    Raises:
        ValueError: the state file is unreadable (names the file).
    """
    try:
        return json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint state {str(ckpt / STATE_FILE)!r} is unreadable: {e}") from e
