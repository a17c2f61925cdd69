"""The driver's run: ``trainer.Trainer`` and the parts it is built from.

``trainer`` the step loop; ``collect`` a step's rollout and scoring; ``batching`` completions into learner
batches and rank shards; ``checkpoint`` atomic checkpoint folders; ``audit_dump`` the ratio audit's saved steps;
``eval_metrics`` pass@k; ``length_slices`` metrics by response length; ``tracking`` metrics.jsonl, wandb and
curves. Imports Ray only through ``cluster.runtime``.
"""
