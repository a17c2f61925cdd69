"""Elastic learner threads (learner.elastic_threads): the /proc/stat arithmetic on hand-made files, and the
thread decisions on a scripted machine (another process busy, then idle, then busy again)."""

from __future__ import annotations

import pytest
import torch

from learner import elastic_threads as et
from learner.config import LearnerConfig


def test_busy_seconds_sums_the_cores_asked_for_without_idle_and_iowait(tmp_path):
    stat = tmp_path / "stat"
    # fields: user nice system idle iowait irq softirq steal (clock ticks)
    stat.write_text("cpu  999 0 0 0 0 0 0 0\n"
                    "cpu0 100 5 20 1000 7 1 2 3 0 0\n"
                    "cpu1 50 0 10 2000 0 0 0 0 0 0\n"
                    "cpu10 4000 0 0 0 0 0 0 0 0 0\n"
                    "intr 12345\n")
    ticks = et._TICKS
    assert et.busy_seconds({0}, str(stat)) == pytest.approx((100 + 5 + 20 + 1 + 2 + 3) / ticks)
    assert et.busy_seconds({0, 1}, str(stat)) == pytest.approx((131 + 60) / ticks)
    assert et.busy_seconds({10}, str(stat)) == pytest.approx(4000 / ticks)  # cpu10 is not cpu1
    assert et.busy_seconds({5}, str(stat)) == 0.0


@pytest.mark.parametrize("idle,want", [(0.0, 1), (0.74, 1), (1.2, 1), (1.75, 2), (2.0, 2), (3.9, 3), (8.0, 3)])
def test_threads_for_counts_a_core_idle_at_75_percent_within_bounds(idle, want):
    assert et.threads_for(idle, 1, 3) == want


class _Machine:
    """Two cores; ``others`` = cores' worth of CPU other processes use, ``mine`` = this process's."""

    def __init__(self):
        self.t = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, mine: float) -> None:
        self.t += seconds
        self.busy += seconds * (others + mine)
        self.own += seconds * mine


@pytest.fixture
def machine(monkeypatch):
    """A scripted two-core ``_Machine`` behind the module's clock and /proc readings; torch's thread count is
    restored afterwards."""
    m = _Machine()
    monkeypatch.setattr(et.time, "monotonic", lambda: m.t)
    monkeypatch.setattr(et, "busy_seconds", lambda cores: m.busy)
    monkeypatch.setattr(et, "own_seconds", lambda: m.own)
    monkeypatch.setattr(et.os, "sched_getaffinity", lambda _: {0, 1})
    before = torch.get_num_threads()
    yield m
    torch.set_num_threads(before)


def _decide(e: et.ElasticThreads) -> int:
    """Close the window (the watcher's tick) and decide, as before a forward."""
    e.tick()
    return e.adjust()


def test_elastic_threads_take_idle_cores_and_give_them_back(machine):
    m = machine
    e = et.ElasticThreads(1, 2, watch=False)
    e.start()
    assert torch.get_num_threads() == 1
    m.run(0.5, others=1.0, mine=1.0)  # the engine generates on the other core
    assert _decide(e) == 1
    m.run(0.5, others=0.05, mine=1.0)  # it is done: the core is idle (the driver uses 5%)
    assert _decide(e) == 2 and torch.get_num_threads() == 2
    m.run(0.5, others=0.05, mine=2.0)  # our two threads busy: still the same idle core to us
    assert _decide(e) == 2
    m.run(0.01, others=1.0, mine=2.0)  # too short an interval to judge: no change, interval kept
    assert _decide(e) == 2
    m.run(0.5, others=1.0, mine=1.0)  # the engine starts again
    assert _decide(e) == 1 and torch.get_num_threads() == 1
    m.run(0.5, others=0.0, mine=1.0)
    assert _decide(e) == 2
    e.start()  # a new update starts at the floor
    assert e.threads == 1 and torch.get_num_threads() == 1 and e.changes == 4


def test_elastic_threads_decide_on_the_latest_window_not_the_whole_interval(machine):
    """The engine busy for 1.5 s of a 1.7 s micro-batch, idle for the last 0.2 s: averaged over the interval the
    other core looks 88% busy (one thread), but the latest window (the watcher's tick) sees it idle: two
    threads at once."""
    m = machine
    e = et.ElasticThreads(1, 2, period=0.2, watch=False)
    e.start()
    assert e.adjust() == 1 and e.recent_idle is None  # no complete window yet: the floor
    m.run(1.5, others=1.0, mine=1.0)
    e.tick()
    assert e.adjust() == 1 and e.recent_idle == pytest.approx(1.0)
    m.run(0.2, others=0.0, mine=1.0)
    e.tick()
    assert e.recent_idle == pytest.approx(2.0) and e.adjust() == 2 and torch.get_num_threads() == 2
    m.run(0.2, others=1.0, mine=2.0)  # the engine is back: the next window drops the rank to one thread
    e.tick()
    assert e.adjust() == 1


def test_mean_threads_weighs_each_count_by_its_time(machine):
    """perf/learner_threads_mean: 1 thread for 1.5 s, then 2 threads for 0.5 s: (1.5 + 1.0) / 2.0 = 1.25; a new
    update starts the account again."""
    m = machine
    e = et.ElasticThreads(1, 2, watch=False)
    e.start()
    assert e.mean_threads() == 1.0  # no time yet
    m.run(1.5, others=0.0, mine=1.0)
    assert _decide(e) == 2
    m.run(0.5, others=0.0, mine=2.0)
    assert e.mean_threads() == pytest.approx(1.25)
    e.start()
    m.run(1.0, others=1.0, mine=1.0)
    assert e.mean_threads() == pytest.approx(1.0)


def test_elastic_threads_config_refusals():
    assert LearnerConfig(max_threads_per_rank=2).max_threads_per_rank == 2
    with pytest.raises(ValueError, match="max_threads_per_rank=1 is below learner.threads_per_rank=2"):
        LearnerConfig(threads_per_rank=2, max_threads_per_rank=1)
    with pytest.raises(ValueError, match="max_threads_per_rank=2 is a CPU setting"):
        LearnerConfig(max_threads_per_rank=2, num_gpus_per_rank=1)
    with pytest.raises(ValueError, match="threads_per_rank"):
        et.ElasticThreads(2, 1)


class _Seen(torch.autograd.Function):
    """Identity that records torch's thread count in its forward and in its backward."""

    @staticmethod
    def forward(ctx, x, log):
        ctx.log = log
        log.append(("forward", torch.get_num_threads()))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("backward", torch.get_num_threads()))
        return grad, None


class ToyDecoderLayer(torch.nn.Module):
    """A decoder layer by transformers' naming, logging the thread count it runs its forward and backward on."""

    def __init__(self, log):
        super().__init__()
        self.lin, self.log = torch.nn.Linear(4, 4), log

    def forward(self, x):
        return _Seen.apply(self.lin(x), self.log)


def test_layer_hooks_decide_before_every_decoder_layer_forward_and_backward(machine):
    """A core freed while the first layer runs is taken by the second layer's forward; one taken back while the
    forward ends is given back before the last layer's backward, not at the next micro-batch. Without the
    hooks the whole micro-batch stays at the count decided before it."""
    m = machine
    for hooked in (True, False):
        log: list = []
        model = torch.nn.Sequential(ToyDecoderLayer(log), ToyDecoderLayer(log))
        e = et.ElasticThreads(1, 2, watch=False)
        handles = et.attach_layer_hooks(model, e) if hooked else []
        assert len(handles) == (4 if hooked else 0)
        e.start()
        m.run(0.5, others=1.0, mine=1.0)
        e.tick()
        e.adjust()  # before the micro-batch: the engine busy, one thread

        def engine_done(*_):  # the engine finishes while layer 0 runs: the watcher's window sees its core idle
            m.run(0.2, others=0.0, mine=1.0)
            e.tick()

        model[0].register_forward_hook(engine_done)
        out = model(torch.ones(2, 4, requires_grad=True))
        m.run(0.2, others=1.0, mine=2.0)  # the engine starts again before the backward
        e.tick()
        out.sum().backward()
        want = ([("forward", 1), ("forward", 2), ("backward", 1), ("backward", 1)] if hooked
                else [("forward", 1), ("forward", 1), ("backward", 1), ("backward", 1)])
        assert log == want, (hooked, log)
        for h in handles:
            h.remove()


def test_layer_hooks_find_a_transformers_models_decoder_layers(tmp_path, monkeypatch):
    """On the embedded Qwen3-MoE (2 decoder layers): a forward pre-hook and an output hook per layer, and a
    forward+backward asks for a decision before each layer's forward and each layer's backward."""
    from transformers import AutoModelForCausalLM

    from cluster.models.tiny_model import build_tiny_moe

    model = AutoModelForCausalLM.from_pretrained(str(build_tiny_moe(tmp_path / "m")), dtype=torch.float32)
    e = et.ElasticThreads(1, 1, watch=False)
    calls: list[int] = []
    monkeypatch.setattr(e, "adjust", lambda: calls.append(1) or 1)
    handles = et.attach_layer_hooks(model, e)
    assert len(handles) == 2 * model.config.num_hidden_layers == 4
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]))
    assert len(calls) == 2  # no grad: forward decisions only
    calls.clear()
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    assert len(calls) == 4
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    calls.clear()
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()  # the recomputed forwards decide too
    # 2 forwards, 2 recomputed forwards, 2 backwards (without the backward hooks: 4)
    assert len(calls) == 6 and all(p.grad is not None for p in model.model.layers[0].parameters())
    for h in handles:
        h.remove()
    assert et.attach_layer_hooks(torch.nn.Linear(2, 2), e) == []
