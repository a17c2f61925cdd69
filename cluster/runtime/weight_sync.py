"""The weight sync on the driver: one object that streams the learner's weights into rollout engines.

``WeightSync`` holds the learner's ranks and the run's ``sync`` settings; ``push(engines, version)`` has every
rank take part (ZeRO-3 gathers) while rank 0 sends (``learner.weight_sync.sync_weights``: object store or
collective) and returns rank 0's typed ``SyncReport``. The engine fleet (``cluster.runtime.services.EngineFleet``)
is built with it: every sync of the run and the current weights for a replacement engine go through it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from learner.contracts import SyncReport

if TYPE_CHECKING:
    from cluster.config_sections import SyncConfig
    from cluster.runtime.learner_group import LearnerGroup


class WeightSync:
    """The learner group's weights, streamed into engines with the run's sync settings.

    Args:
        learners: the learner's ranks (``LearnerGroup``).
        settings: the run's ``sync`` section (bucket size, buckets in flight, engine timeout, transport).
    """

    def __init__(self, learners: LearnerGroup, settings: SyncConfig):
        self.learners = learners
        self.settings = settings
        self.last: SyncReport | None = None  # the report of the latest push

    def push(self, engines: list[Any], version: int | None, defer: bool = False) -> SyncReport:
        """Stream the current weights into ``engines`` (Ray handles of ``rollout.engine.RolloutEngine``) as
        weight version ``version`` (None: the learner's own count when the sync runs, ``report.version``). An
        engine that fails is listed in the report's ``failed_engines``, not raised (the fleet replaces it).
        ``defer``: return once the learner has put every bucket; the engines' remaining calls are in the report's
        ``pending`` (``sync.load_beside_learner``).

        Raises:
            RuntimeError: rank 0 returned no report (a learner rank is not rank 0 of its group).
            ray.exceptions.RayActorError: a learner rank died (the run stops; see ``LearnerGroup``).
        """
        s = self.settings
        report = self.learners.sync_weights(engines, version, s.bucket_mb, s.max_buckets_in_flight,
                                            s.engine_timeout_s, s.transport, defer)
        if not isinstance(report, SyncReport):
            raise RuntimeError(f"weight sync: learner rank 0 returned {type(report).__name__}, not a SyncReport")
        self.last = report
        return report
