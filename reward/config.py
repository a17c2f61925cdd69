"""Config section ``reward``: verifier workers."""

from pydantic import Field

from cluster.schema_base import Section


class RewardConfig(Section):
    """Which verifiers score completions and how the workers run them."""

    num_workers: int = Field(1, ge=1, description="reward worker actors; free to change on resume")
    num_cpus_per_worker: float = Field(0.25, gt=0, description="Ray CPUs reserved per reward worker")
    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of one verifier call, seconds")
