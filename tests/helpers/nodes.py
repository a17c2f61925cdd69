"""Nodes of a local ``ray.cluster_utils.Cluster`` in the node-loss tests."""

from __future__ import annotations


def remove_node(cluster, node) -> None:
    """Remove ``node`` (its raylet and workers end) and wait until the GCS has marked it dead (its health
    checks fail first), so that what follows sees a lost node, not one that is still going down."""
    import time

    import ray

    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 120
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)
