"""The calculator agent as a command-line program that scores itself (``python -m reward.envs.calc_cli``).

A harness of this kind (a coding agent that runs its task's tests, say) is a separate process: it finds its
model in ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, as every OpenAI client does, and when given the expected answer
it ends its session itself with its own reward: ``POST <base URL without /v1>/close`` with the session's key and
``{"reward": float}``, a plain HTTP call any language can make. ``reward/envs/cli_agent.py`` runs it as an
``env.agent``.

    OPENAI_BASE_URL=http://host:port/s/<id>/v1 OPENAI_API_KEY=<key> \\
        python -m reward.envs.calc_cli --prompt "What is 6*7?" --answer 42

Exit status 0 when the loop ran (whatever the reward), 1 when the session refused the close, 2 for bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import httpx
import openai

from reward.envs.calc_agent import chat


def score(text: str, answer: str) -> float:
    """1.0 when the last integer in ``text`` is ``answer``, else 0.0."""
    numbers = re.findall(r"-?\d+", text)
    return float(bool(numbers) and numbers[-1] == answer.strip())


def close(reward: float) -> bool:
    """End this program's session with ``reward`` over the gateway's REST route; True when it was taken."""
    url = os.environ["OPENAI_BASE_URL"].rstrip("/").removesuffix("/v1") + "/close"
    r = httpx.post(url, json={"reward": reward}, timeout=30.0,
                   headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
    return r.status_code == 200


def main(argv: list[str] | None = None) -> int:
    """Run the calculator loop on ``--prompt``; with ``--answer``, close the session with the reward."""
    parser = argparse.ArgumentParser(prog="python -m reward.envs.calc_cli", description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", required=True, help="the task")
    parser.add_argument("--answer", help="the expected answer: score the model's and close the session")
    parser.add_argument("--max-turns", type=int, default=3, help="model calls at most")
    args = parser.parse_args(argv)
    messages = chat(args.prompt, openai.OpenAI(max_retries=0), args.max_turns)
    last = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
    print(last)
    if args.answer is None:
        return 0
    reward = score(last, args.answer)
    print(f"reward {reward}", file=sys.stderr)
    return 0 if close(reward) else 1


if __name__ == "__main__":
    sys.exit(main())
