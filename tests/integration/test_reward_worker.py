"""The protected runner and the reward worker: timeouts kill whole process groups, failures become
statuses (0 or NaN, never an exception), composite rewards, overlong shaping, truncation masking, and real
rows (GSM8K answers in right and wrong forms; small code tasks with correct, wrong, hanging and hostile
solutions)."""

from __future__ import annotations

import pytest

from reward.config import RewardConfig, SandboxConfig
from reward.contracts import RewardRequest
from reward.sandbox_procs import ENV_RUN, find_run_processes
from reward.worker import RewardWorker
from tests.helpers.reward_worker import row_of
from tests.helpers.sandbox import sandbox_backend

CODE_TASK = {"tests": ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]}


STDIO_TASK = {"tests": [{"input": "2 3\n", "output": "5"}, {"input": "10 -4\n", "output": "6"}]}


@pytest.mark.timeout(180)
def test_code_tasks_correct_wrong_hanging_hostile(tmp_path):
    sbx = SandboxConfig(backend=sandbox_backend(), wall_s=3.0, cpu_s=2, memory_mb=256, max_procs=12)
    w = RewardWorker(RewardConfig(timeout_s=12.0, sandbox=sbx))
    sq, add = row_of("", "code", **CODE_TASK), row_of("", "code", **STDIO_TASK)
    marker = tmp_path / "escaped"
    hostile = [
        "import os\nfor _ in range(300):\n    os.fork()\ndef square(x): return x * x\n",    # fork storm
        f"open({str(marker)!r}, 'w').write('x')\ndef square(x): return x * x\n",        # write outside
        "import os\nprint(open('/proc/1/environ').read())\ndef square(x): return x*x\n",  # snooping
        "import os\nif os.fork() == 0:\n    import time; time.sleep(30)\ndef square(x): return x * x\n",
    ]
    try:
        reqs = [
            RewardRequest("```python\ndef square(x):\n    return x * x\n```", sq),          # correct
            RewardRequest("```python\ndef square(x):\n    return 2 * x\n```", sq),          # wrong: 1 of 3
            RewardRequest("def square(x):\n    while True:\n        pass\n", sq),          # hangs
            RewardRequest("a, b = map(int, input().split())\nprint(a + b)\n", add),      # stdio correct
            RewardRequest("print(5)\n", add),                                            # stdio half
        ] + [RewardRequest(h, sq) for h in hostile]
        res = w.score(reqs)
    finally:
        w.close()
    scores = [r.score for r in res]
    assert scores[:5] == [1.0, pytest.approx(1 / 3), 0.0, 1.0, 0.5]
    assert [r.correct for r in res[:5]] == [True, False, False, True, False]
    assert res[2].status == "ok" and res[2].detail["sandbox"] in ("timeout", "cpu_limit")
    assert all(r.status in ("ok", "error", "timeout") for r in res)
    assert not marker.exists()
    # hostile ones are contained and reported: the fork storm / snooping may or may not pass the tests, but
    # nothing they started is left (counting only this test's sandbox runs, not another run's on this machine),
    # and nothing was written outside
    runs = [run for r in res for run in r.detail.get("runs", [])]
    assert len(runs) >= len(reqs) and all(runs)
    assert [p for run in runs for p in find_run_processes(ENV_RUN, run)] == []
