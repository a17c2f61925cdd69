"""The vLLM rollout engine on the tiny Qwen3-MoE, run for real inside Ray actors and compared with a
transformers float32 forward of the same tokens.

One in-process engine (a Ray actor, so vLLM's process-wide settings stay out of the pytest process) is shared
by the module; the tests that update its weights record the reference model it now holds in ``_current``.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.rollout import LONG_PROMPT, TEMPERATURE, _current, checkpoint_state, perturbed, rows, sync
from tests.helpers.rollout import base_model, engine, mp_engine, tokenizer  # noqa: F401 - fixtures

TOL = 1e-4


def hf_logprobs(model, prompt_ids, response_ids, temperature):
    """log softmax(logits / temperature) of each response token, from a transformers forward."""
    ids = torch.tensor([list(prompt_ids) + list(response_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    start = len(prompt_ids) - 1
    return torch.stack([logp[start + j, t] for j, t in enumerate(response_ids)])


def max_diff(model, completions, temperature):
    return max(
        (hf_logprobs(model, c.prompt_token_ids, c.response_token_ids, temperature) - torch.tensor(c.response_logprobs))
        .abs()
        .max()
        .item()
        for c in completions
    )


def test_generate_groups_with_post_temperature_logprobs(ray_cluster, engine, tokenizer):
    prompts = rows(tokenizer, ["12 + 7 = ", "3 * 4 =", "hello\n"])
    n = 4
    out = ray_cluster.get(engine.generate.remote(prompts, n, seed=11))
    assert len(out) == len(prompts) * n
    for i, row in enumerate(prompts):
        group = out[i * n : (i + 1) * n]
        assert [c.prompt_uid for c in group] == [row.uid] * n
        assert [c.sample_index for c in group] == list(range(n))
        assert len({tuple(c.response_token_ids) for c in group}) > 1  # samples of a group differ
    for c in out:
        assert c.prompt_token_ids == tokenizer(prompts[int(c.prompt_uid[1:])].prompt)["input_ids"]
        assert 1 <= len(c.response_token_ids) == len(c.response_logprobs) <= 12
        assert c.finish_reason in ("stop", "length") and c.weight_version == _current["version"]
        if c.finish_reason == "length":
            assert len(c.response_token_ids) == 12
        else:
            assert c.response_token_ids[-1] == tokenizer.eos_token_id
        assert c.response_text == tokenizer.decode(c.response_token_ids, skip_special_tokens=True)
    model = _current["model"]
    assert max_diff(model, out, TEMPERATURE) < TOL
    assert max_diff(model, out, 1.0) > 1e-2  # the log-probs are post-temperature ones, not raw
    again = ray_cluster.get(engine.generate.remote(prompts, n, seed=11))
    assert [c.response_token_ids for c in again] == [c.response_token_ids for c in out]


def test_greedy_and_sequence_logprobs_match_transformers(ray_cluster, engine, tokenizer):
    prompts = rows(tokenizer, ["2 + 2 = ", "abc"])
    greedy = ray_cluster.get(engine.generate_greedy.remote(prompts, max_tokens=8))
    model = _current["model"]
    assert [(c.prompt_uid, c.sample_index) for c in greedy] == [("p0", 0), ("p1", 0)]
    for c in greedy:
        ids = torch.tensor([c.prompt_token_ids + c.response_token_ids])
        with torch.no_grad():
            logits = model(ids).logits[0]
        p = len(c.prompt_token_ids)
        expected = logits[p - 1 : p - 1 + len(c.response_token_ids)].argmax(-1).tolist()
        assert c.response_token_ids == expected
    seq = greedy[0].prompt_token_ids + greedy[0].response_token_ids
    start = len(greedy[0].prompt_token_ids)
    got = torch.tensor(ray_cluster.get(engine.sequence_logprobs.remote(seq, start)))
    want = hf_logprobs(model, seq[:start], seq[start:], 1.0)
    assert got.shape == want.shape and (got - want).abs().max().item() < TOL


def test_update_weights_moe_reload_and_prefix_cache_reset(ray_cluster, engine, tokenizer):
    """Perturbed weights (transformers' fused expert tensors, split over buckets) must give the perturbed
    model's log-probs: fails without the MoE repack fix (stale expert packing) and without the prefix-cache
    reset (the long prompt's KV from the old weights would be reused)."""
    long_rows = rows(tokenizer, [LONG_PROMPT])
    assert len(long_rows[0].prompt_token_ids) > 128
    old = _current["model"]
    before = ray_cluster.get(engine.generate.remote(long_rows, 2, max_tokens=6, seed=3))
    assert max_diff(old, before, TEMPERATURE) < TOL

    new = perturbed(old, seed=1)
    loaded = sync(ray_cluster, engine, checkpoint_state(new), 1)
    _current.update(model=new, version=1)
    assert loaded == len(checkpoint_state(new))
    assert ray_cluster.get(engine.weight_version.remote()) == 1

    after = ray_cluster.get(engine.generate.remote(long_rows, 2, max_tokens=6, seed=3))
    assert all(c.weight_version == 1 for c in after)
    assert max_diff(new, after, TEMPERATURE) < TOL
    assert max_diff(old, after, TEMPERATURE) > 1e-2  # the update changed the model
    seq = after[0].prompt_token_ids + after[0].response_token_ids
    got = torch.tensor(ray_cluster.get(engine.sequence_logprobs.remote(seq, 5)))
    assert (got - hf_logprobs(new, seq[:5], seq[5:], 1.0)).abs().max().item() < TOL


def test_update_weights_from_object_refs_and_bad_buckets(ray_cluster, engine, tokenizer):
    new = perturbed(_current["model"], seed=2)
    state = checkpoint_state(new)
    with pytest.raises(ValueError, match="unloaded"):  # a sync that leaves tensors out is refused at finish
        sync(ray_cluster, engine, {k: v for k, v in state.items() if "norm" not in k}, 9)
    with pytest.raises(RuntimeError, match="between weight versions"):  # and the engine samples nothing
        ray_cluster.get(engine.generate.remote(rows(tokenizer, ["7 - 5 = "]), 2, seed=4))
    with pytest.raises(ValueError, match="not in its checkpoint"):
        sync(ray_cluster, engine, {**state, "model.extra.weight": torch.zeros(1)}, 9)
    with pytest.raises(ValueError, match="in place of fused"):  # transformers' in-memory names are refused
        sync(ray_cluster, engine, new.state_dict(), 9)
    assert ray_cluster.get(engine.weight_version.remote()) == _current["version"]

    sync(ray_cluster, engine, state, 2, parts=2)
    _current.update(model=new, version=2)
    out = ray_cluster.get(engine.generate.remote(rows(tokenizer, ["7 - 5 = "]), 3, seed=4))
    assert all(c.weight_version == 2 for c in out)
    assert max_diff(new, out, TEMPERATURE) < TOL
    assert ray_cluster.get(engine.pid.remote()) != __import__("os").getpid()


@pytest.mark.matrix  # wide case: make test samples and syncs the in-process engine every CPU config runs; vLLM's
# multi-process mode (the GPU configs' rollout.in_process=false) starts its own engine, about 25 s on 2 cores; the
# matrix's TP engine (tests/matrix/test_tp_engine.py) also syncs byte blobs into multi-process workers
def test_multiprocess_mode_update_through_byte_blobs(ray_cluster, mp_engine, base_model, tokenizer):
    """vLLM's default mode (EngineCore and Worker subprocesses): numpy arrays do not survive the msgpack hop
    to the engine core, so each tensor's bytes travel as ``bytes``; the reloaded engine must match."""
    new = perturbed(base_model, seed=3)
    sync(ray_cluster, mp_engine, checkpoint_state(new), 1)
    out = ray_cluster.get(mp_engine.generate.remote(rows(tokenizer, ["1 + 1 = "]), 2, temperature=1.0, seed=1))
    assert [c.weight_version for c in out] == [1, 1]
    assert max_diff(new, out, 1.0) < TOL


def test_seeded_prompts_beyond_the_step_token_budget(ray_cluster, engine, tokenizer):
    """Seeded groups whose prompt tokens exceed the engine's per-step token budget: vLLM 0.32 with chunked prefill
    died here ("CPU Generator does not use offset"); now each sample is the same whether the prompts come in one
    call, again, or in two pieces (other batches, other scheduling). Prompts stay under one 128-token KV block:
    a longer prompt's samples share its cached first block in the same step and need few new tokens each."""
    prompts = rows(tokenizer, [f"{k}: " + LONG_PROMPT[:96] for k in range(6)])
    assert all(len(r.prompt_token_ids) < 128 for r in prompts)
    n = 8
    budget, chunked = ray_cluster.get(engine.batched_token_budget.remote())
    assert sum(len(r.prompt_token_ids) for r in prompts) * n > budget and not chunked
    out = ray_cluster.get(engine.generate.remote(prompts, n, max_tokens=4, seed=21))
    again = ray_cluster.get(engine.generate.remote(prompts, n, max_tokens=4, seed=21))
    pieces = ray_cluster.get(engine.generate.remote(prompts[:2], n, max_tokens=4, seed=21))
    pieces += ray_cluster.get(engine.generate.remote(prompts[2:], n, max_tokens=4, seed=21, prompt_offset=2))
    samples = [c.response_token_ids for c in out]
    assert len(out) == len(prompts) * n and len({tuple(s) for s in samples}) > n
    assert samples == [c.response_token_ids for c in again] == [c.response_token_ids for c in pieces]


def test_turns_continue_the_exact_ids_with_stop_strings(ray_cluster, engine, tokenizer):
    """An episode's two turns: the first stops right after a stop string (kept in its text and ids), the second
    continues from the first's sampled ids plus an environment reply's ids, never from re-tokenized text; its
    log-probs are a transformers forward's of exactly that sequence."""
    from rollout.contracts import TurnRequest

    ray_cluster.get(engine.take_token_records.remote())  # earlier tests' turns
    prompt = tokenizer("12+34=")["input_ids"]
    stops = list("0123456789abcdefghij")  # a random tiny model writes one of these within a few tokens
    first = TurnRequest("p#0", prompt, max_tokens=12, stop=stops, seed=3)
    (t1,) = ray_cluster.get(engine.sample_turns.remote([first]))
    assert t1.episode_id == "p#0" and len(t1.token_ids) == len(t1.logprobs) >= 1
    assert t1.weight_version == _current["version"] and t1.finish_reason in ("stop", "length")
    if isinstance(t1.stop_reason, str):
        assert t1.stop_reason in stops and t1.text.endswith(t1.stop_reason)
    reply = tokenizer("<result>46</result>", add_special_tokens=False)["input_ids"]
    context = prompt + t1.token_ids + reply
    (t2,) = ray_cluster.get(engine.sample_turns.remote([TurnRequest("p#0", context, max_tokens=12, seed=4)]))
    assert t2.stop_reason in (None, tokenizer.eos_token_id) or t2.finish_reason == "length"
    want = hf_logprobs(_current["model"], context, t2.token_ids, TEMPERATURE)
    assert (want - torch.tensor(t2.logprobs)).abs().max().item() < TOL
    (again,) = ray_cluster.get(engine.sample_turns.remote([first]))
    assert again.token_ids == t1.token_ids  # seeded: the same turn
    with pytest.raises(Exception, match="max_model_len"):
        ray_cluster.get(engine.sample_turns.remote([TurnRequest("p#1", prompt, max_tokens=400)]))
    from rollout.token_records import turn_digest  # the token check's records: each turn's context and ids, digested

    records, lost = ray_cluster.get(engine.take_token_records.remote())
    assert lost == 0 and records == [("p#0", 0, len(c), len(t.token_ids), turn_digest(c, t.token_ids))
                                     for c, t in ((prompt, t1), (context, t2), (prompt, again))]


def test_advance_turns_batches_continuously_and_matches_sample_turns(ray_cluster, engine, tokenizer):
    """Turns opened on the engine at different times (continuous batching) end as the same seeded turns that
    ``sample_turns`` gives in one batch: same ids, log-probs within float noise; while turns are open, generate
    and a weight sync are refused; abort_turns closes them."""
    from rollout.contracts import TurnRequest

    reqs = [TurnRequest(f"e#{i}", tokenizer(f"{10 + i}+{i}=")["input_ids"], max_tokens=10, seed=20 + i)
            for i in range(6)]
    want = {t.episode_id: t for t in ray_cluster.get(engine.sample_turns.remote(reqs))}
    got, pending, busy = {}, list(reqs), 0.0
    while pending or len(got) < len(reqs):  # two turns join per call, the others run on
        ended, b = ray_cluster.get(engine.advance_turns.remote(pending[:2], None, 0.0))
        pending, busy = pending[2:], busy + b
        got.update({t.episode_id: t for t in ended})
    assert busy > 0.0 and set(got) == set(want)
    for k, t in got.items():
        assert t.token_ids == want[k].token_ids and t.finish_reason == want[k].finish_reason
        assert max(abs(a - b) for a, b in zip(t.logprobs, want[k].logprobs)) < TOL
    ended, _ = ray_cluster.get(engine.advance_turns.remote([reqs[0]], None, 0.0))
    with pytest.raises(Exception, match="already open"):
        ray_cluster.get(engine.advance_turns.remote([reqs[0]], None, 0.0))
    with pytest.raises(Exception, match="still open"):
        ray_cluster.get(engine.generate.remote(rows(tokenizer, ["1+1="]), 1, seed=1))
    assert ray_cluster.get(engine.abort_turns.remote()) == (0 if ended else 1)
    assert ray_cluster.get(engine.advance_turns.remote([], None, 0.0)) == ([], 0.0)
