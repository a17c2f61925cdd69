"""The session gateway under many concurrent sessions: errors, and its own overhead per request (p50, p99).

The real ``cluster.runtime.gateway.Gateway`` served by uvicorn in this process, and agent programs run by the real
``reward.agent_runner.AgentRuns`` (one thread each, as an env worker runs them): ``--sessions`` episodes at once,
each ``--turns`` requests of the calculator agent's shape. In the driver's place a coroutine per session answers each
request after ``--generate-ms`` (a stand-in for the engine's time; 0 = at once), so the time an agent waits per
request minus that is the gateway's own overhead: HTTP, the protocol layer, the session's inbox and the client.

The baseline in the same invocation is the same exchange with no HTTP at all (the driver's coroutine answering a
queue the agent thread reads): the ratio says what the HTTP path costs on top of the bare hand-off.

    .venv/bin/python bench/gateway.py --sessions 256 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def agent_fn(turns: int, latencies: list):
    """An agent program of ``turns`` requests (a user message, then tool results), timing each request."""
    def run(row: dict, client) -> float:
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(turns):
            t = time.perf_counter()
            reply = client.chat.completions.create(model="policy", messages=messages)
            latencies.append(time.perf_counter() - t)
            messages += [reply.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": "x", "content": "42"}]
        return 1.0
    return run


async def serve_sessions(n: int, turns: int, generate_s: float) -> dict:
    """``n`` sessions at once through the gateway; the agents' latencies and the errors."""
    from cluster.runtime.gateway import Gateway
    from reward.agent_runner import AgentRuns
    from rollout.openai_protocol import Reply

    gateway = Gateway()
    await gateway.start()
    latencies: list[float] = []
    runs = AgentRuns(agent_fn(turns, latencies), timeout_s=120.0)
    ends: list[dict] = []

    async def drive(sid: str) -> None:
        event = await gateway.exchange(sid, None, 120.0)
        while event["kind"] == "request":
            await asyncio.sleep(generate_s)
            reply = Reply(content="42", tool_calls=[], finish_reason="stop", prompt_tokens=10, completion_tokens=2)
            event = await gateway.exchange(sid, reply, 120.0)
        ends.append(event)

    t0 = time.perf_counter()
    tasks = []
    for i in range(n):
        session = await gateway.open(f"s{i}")
        runs.start(f"e{i}", {"prompt": f"{i}+1="}, session)
        tasks.append(asyncio.create_task(drive(f"s{i}")))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    counters = await gateway.take_counters()
    await gateway.stop()
    bad = [e for e in ends if e.get("status") != "ok" or e.get("reward") != 1.0]
    return {"wall_s": wall, "latencies": latencies, "errors": len(bad), "example_error": bad[:1],
            "requests": counters.get("gateway/requests", 0.0)}


def bare_handoff(n: int, turns: int, generate_s: float) -> list[float]:
    """The baseline: the same exchange as a thread-safe hand-off without HTTP (a future per request)."""
    import concurrent.futures as cf

    latencies: list[float] = []
    lock = threading.Lock()

    def agent() -> None:
        for _ in range(turns):
            t = time.perf_counter()
            fut: cf.Future = cf.Future()
            threading.Timer(generate_s, fut.set_result, args=("42",)).start() if generate_s else fut.set_result("42")
            fut.result()
            with lock:
                latencies.append(time.perf_counter() - t)

    threads = [threading.Thread(target=agent) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return latencies


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--generate-ms", type=float, default=20.0, help="the stand-in engine's time per request")
    args = ap.parse_args()
    g = args.generate_ms / 1000
    out = asyncio.run(serve_sessions(args.sessions, args.turns, g))
    base = bare_handoff(args.sessions, args.turns, g)
    lat = out["latencies"]
    over = [x - g for x in lat]
    print(f"sessions {args.sessions} x {args.turns} requests, stand-in generation {args.generate_ms:.0f} ms: "
          f"{out['requests']:.0f} requests in {out['wall_s']:.2f} s, errors {out['errors']} {out['example_error']}")
    print(f"gateway overhead per request (latency - generation): p50 {1e3 * pct(over, 0.5):.1f} ms, "
          f"p99 {1e3 * pct(over, 0.99):.1f} ms, mean {1e3 * statistics.fmean(over):.1f} ms")
    print(f"bare hand-off (no HTTP) overhead: p50 {1e3 * (pct(base, 0.5) - g):.2f} ms, "
          f"p99 {1e3 * (pct(base, 0.99) - g):.2f} ms; gateway/bare mean latency "
          f"{statistics.fmean(lat) / max(statistics.fmean(base), 1e-9):.2f}x")


if __name__ == "__main__":
    main()
