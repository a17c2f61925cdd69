"""The driver's run: ``trainer.Trainer`` and the parts it is built from.

``trainer`` wires the run; ``collect`` a step's rollout and scoring; ``partial_buffer`` and ``partial_rollout``
partial rollouts across weight syncs; ``batching`` completions into learner
batches and rank shards (with their row indices); ``warm_start`` the supervised warm start and the lr
schedules; ``evaluation`` greedy accuracy and pass@k; ``guard`` the health guard's policy (rollbacks, the
stop); ``scaling`` ``control.yaml``; ``step_metrics`` and ``length_slices`` a step's metrics; ``progress`` the
loop's display and summary; ``checkpoint`` atomic checkpoint folders and ``resume`` the driver's state in
them; ``audit_dump`` the ratio audit's saved steps; ``tracking`` metrics.jsonl, wandb and curves. Imports Ray
only through ``cluster.runtime``.
"""
