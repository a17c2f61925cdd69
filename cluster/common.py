"""Small facts and helpers the wiring modules share: the repository root, a free port, a mean."""

from __future__ import annotations

import socket
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout; services' PYTHONPATH and relative data paths


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` now (for the learner's rendezvous and a private Ray head)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def mean(xs: list[float]) -> float:
    """Arithmetic mean; NaN for an empty list."""
    return float(sum(xs) / len(xs)) if xs else float("nan")
