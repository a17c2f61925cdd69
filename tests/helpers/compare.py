"""The equal-budget comparison (cluster/compare/runs.py): settings per algorithm, the report's figures on hand-made
histories, and (slow) two real 2-step runs that share one warm start and end in a report and a plot."""

from __future__ import annotations

from tests.helpers import REPO_ROOT

CONFIG = str(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml")
