"""The learner's rendezvous port: a port taken between the driver's probe and rank 0's bind (EADDRINUSE, seen
once in CI) starts the ranks again at a fresh port instead of failing the run; a single rank binds any free port
itself (port 0), so nothing can take it first."""

from __future__ import annotations

import socket

import pytest

from cluster.common import REPO_ROOT


def _config(world_size: int):
    from cluster.config import load_config

    return load_config(REPO_ROOT / "configs" / "tiny_moe_zero2.yaml", [
        f"learner.world_size={world_size}", "learner.num_cpus_per_rank=0.5", "wandb.mode=disabled",
    ])


@pytest.mark.matrix  # wide case: the default set starts ranks once (test_a_single_rank_binds_its_own_port)
def test_a_taken_port_starts_the_ranks_again(ray_cluster, model_path, monkeypatch):
    import cluster.runtime.learner_group as lg

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()  # a listener: torch's SO_REUSEADDR bind cannot share it
    ports = iter([taken.getsockname()[1]])
    real = lg.free_port
    monkeypatch.setattr(lg, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    group = lg.LearnerGroup(_config(2), model_path)
    try:
        group.wait_ready()
        assert group.rendezvous_retries == 1
        assert len(set(group.call("pid"))) == 2  # both ranks of the second start answer
    finally:
        group.shutdown()
        taken.close()


@pytest.mark.matrix  # wide case: the default set starts ranks once (test_a_single_rank_binds_its_own_port)
def test_every_attempt_taken_raises_the_ranks_error(ray_cluster, model_path, monkeypatch):
    import ray

    import cluster.runtime.learner_group as lg

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    monkeypatch.setattr(lg, "free_port", lambda host="127.0.0.1": taken.getsockname()[1])
    group = lg.LearnerGroup(_config(2), model_path)
    try:
        try:
            group.wait_ready()
        except ray.exceptions.RayActorError as e:
            assert "EADDRINUSE" in str(e)
        else:
            raise AssertionError("wait_ready returned with every rendezvous port taken")
        assert group.rendezvous_retries == lg.RENDEZVOUS_ATTEMPTS - 1
    finally:
        group.shutdown()
        taken.close()


def test_a_single_rank_binds_its_own_port(ray_cluster, model_path):
    import cluster.runtime.learner_group as lg

    group = lg.LearnerGroup(_config(1), model_path)
    try:
        assert group._rendezvous(group._cfg)[1] == 0
        group.wait_ready()
        assert group.rendezvous_retries == 0
    finally:
        group.shutdown()
