"""The calculator agent as a separate program that takes the run's episodes itself (``env.gateway.harness:
"python -m reward.envs.calc_harness"``).

The driver starts it once per run with the gateway's root URL in ``GSPO_GATEWAY_URL`` and the run's key in
``GSPO_GATEWAY_KEY``. Each of its ``--parallel`` threads asks for an episode (``POST /sessions`` with the run key:
``reward.agent_runner.claim_session``), plays it with an ``openai`` client on the episode's base URL and key (the
loop of ``reward/envs/calc_agent.py``), scores the answer itself (``calc_cli.score`` against the row's answer) and
ends the session with that reward (``POST /s/<id>/close``: ``close_session``); a loop that raised closes it with
status ``error``. It stops when the gateway says the run is ending (410) or no longer answers, or after
``--max-sessions``. Any language can do the same with two HTTP calls around an OpenAI client.

    GSPO_GATEWAY_URL=http://127.0.0.1:PORT GSPO_GATEWAY_KEY=KEY python -m reward.envs.calc_harness --parallel 8
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import httpx
import openai

from reward.agent_runner import GatewayStopped, claim_session, close_session
from reward.envs.calc_agent import chat
from reward.envs.calc_cli import score


def play(session: dict, max_turns: int, http: httpx.Client) -> float | None:
    """One claimed episode: the calculator loop on its row, closed with the reward (None: the row has no answer,
    the run's verifier scores the last assistant message). Returns the reward sent."""
    row = session["row"]
    try:
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0,
                               http_client=http)
        messages = chat(row["prompt"], client, max_turns)
    except Exception as err:  # noqa: BLE001 - the episode's failure, told to the gateway
        close_session(session, None, "error", f"{type(err).__name__}: {err}"[:500], http=http)
        return None
    last = (messages[-1].get("content") or "") if messages[-1]["role"] == "assistant" else ""
    reward = score(last, str(row["answer"])) if row.get("answer") is not None else None
    close_session(session, reward, http=http)
    return reward


def worker(url: str, key: str, args: argparse.Namespace, budget: list[int], lock: threading.Lock) -> None:
    """Claim and play episodes until the run ends or the session budget (``budget[0]``, < 0: none) is spent."""
    with httpx.Client(timeout=300.0) as http:
        while True:
            with lock:
                if budget[0] == 0:
                    return
                budget[0] -= 1
            try:
                session = None
                while session is None:
                    session = claim_session(url, key, uid=args.uid, wait_s=args.wait_s, http=http)
            except GatewayStopped:
                return
            reward = play(session, args.max_turns, http)
            print(f"{session['session_id']} {session['row'].get('uid')} reward {reward}", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Take and play episodes (module docstring); exit status 0, or 2 without ``GSPO_GATEWAY_URL`` / ``_KEY``."""
    parser = argparse.ArgumentParser(prog="python -m reward.envs.calc_harness", description=__doc__.split("\n")[0])
    parser.add_argument("--parallel", type=int, default=8, help="episodes played at once (threads)")
    parser.add_argument("--max-sessions", type=int, default=-1, help="episodes to play in all (-1: until the end)")
    parser.add_argument("--max-turns", type=int, default=3, help="model calls per episode at most")
    parser.add_argument("--wait-s", type=float, default=30.0, help="how long one claim waits for an episode")
    parser.add_argument("--uid", help="take episodes of this row only")
    args = parser.parse_args(argv)
    url, key = os.environ.get("GSPO_GATEWAY_URL"), os.environ.get("GSPO_GATEWAY_KEY")
    if not url or not key:
        print("GSPO_GATEWAY_URL and GSPO_GATEWAY_KEY must be set (the driver sets them)", file=sys.stderr)
        return 2
    budget, lock = [args.max_sessions], threading.Lock()
    threads = [threading.Thread(target=worker, args=(url, key, args, budget, lock), daemon=True)
               for _ in range(max(args.parallel, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
