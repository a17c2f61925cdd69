"""A command-line agent program as an ``env.agent`` (``reward.envs.cli_agent:run``): each episode starts
``python -m reward.envs.calc_cli`` with the episode's session in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``.

The program closes its session itself with its own reward (it is given the row's answer); the runner's close
after ``run`` returns is then a no-op, since a session takes one close. Had the program not closed it, the row's
verifier would score the last assistant message (``run`` returns None). A program that fails (a non-zero exit
status) or outlives ``timeout_s`` (it is killed) raises, which ends the episode as an error scored by
``env.on_error``, unless the program had closed its session with a reward first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from reward.agent_runner import session_env

ROOT = Path(__file__).resolve().parents[2]  # the program runs from the checkout's root (``-m reward.envs...``)


def run(row: dict, client, timeout_s: float = 300.0) -> None:
    """Run the calculator program on ``row["prompt"]`` against the client's session.

    Args:
        row: the task row (``prompt``, ``answer``).
        client: an ``openai.OpenAI`` client on the episode's session (only its base URL and key are used).
        timeout_s: seconds the program may run before it is killed.

    Raises:
        RuntimeError: the program exited with a non-zero status (the message has its stderr's end).
        subprocess.TimeoutExpired: it ran past ``timeout_s``.
    """
    session = {"base_url": str(client.base_url).rstrip("/"), "api_key": client.api_key}
    command = [sys.executable, "-m", "reward.envs.calc_cli", "--prompt", row["prompt"]]
    if row.get("answer") is not None:
        command += ["--answer", str(row["answer"])]
    done = subprocess.run(command, cwd=ROOT, env={**os.environ, **session_env(session)}, capture_output=True,
                          text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"calc_cli exited with status {done.returncode}: {done.stderr[-300:]}")
    return None
