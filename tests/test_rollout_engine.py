"""The vLLM rollout engine on the tiny Qwen3-MoE, run for real inside Ray actors and compared with a
transformers float32 forward of the same tokens.

One in-process engine (a Ray actor, so vLLM's process-wide settings stay out of the pytest process) is shared
by the module; the tests that update its weights record the reference model it now holds in ``_current``.
"""

import pytest
import torch

from rollout.contracts import PromptRow
from rollout.config import RolloutConfig
from learner.weight_sync import to_checkpoint_format
from rollout.engine import RolloutEngine
from rollout.weight_sync import ObjectRefUpdateInfo, bucket_tensors, flat_views

TOL = 1e-4
TEMPERATURE = 0.7
# CPU KV blocks hold 128 tokens: only a prompt longer than one block leaves a reusable prefix-cache entry.
LONG_PROMPT = "".join(f"{i} + {i + 3} = {2 * i + 3}\n" for i in range(12))[:150]


@pytest.fixture(scope="module")
def tokenizer(tiny_moe):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_moe)


@pytest.fixture(scope="module")
def base_model(tiny_moe):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()


_current: dict = {}  # "model": the transformers model whose weights the shared engine holds; "version"


@pytest.fixture(scope="module")
def mp_engine(ray_cluster, tiny_moe, tmp_path_factory):
    """An engine in vLLM's multi-process mode; created before ``engine`` so the two start in parallel."""
    cfg = RolloutConfig(in_process=False, max_model_len=64, max_response_tokens=6, seed=5)
    actor = ray_cluster.remote(RolloutEngine).options(num_cpus=1).remote(
        str(tiny_moe), cfg, cache_dir=str(tmp_path_factory.mktemp("vllm_cache_mp"))
    )
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_moe, base_model, tmp_path_factory, mp_engine):
    cfg = RolloutConfig(max_model_len=256, max_response_tokens=12, temperature=TEMPERATURE, seed=7)
    actor = ray_cluster.remote(RolloutEngine).options(num_cpus=1).remote(
        str(tiny_moe), cfg, engine_index=0, cache_dir=str(tmp_path_factory.mktemp("vllm_cache"))
    )
    _current.update(model=base_model, version=0)
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


def rows(tokenizer, texts):
    return [
        PromptRow(uid=f"p{i}", prompt=t, prompt_token_ids=tokenizer(t)["input_ids"], answer="")
        for i, t in enumerate(texts)
    ]


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


def perturbed(model, seed, scale=0.05):
    """A copy of ``model`` with Gaussian noise added to every parameter (seeded)."""
    import copy

    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return out


def checkpoint_state(model):
    """The model's weights in checkpoint names (one tensor per expert), as the learner sends them."""
    return to_checkpoint_format(model, model.state_dict())


def put_buckets(ray, state, parts=3):
    """``(meta, object ref)`` per bucket, ``parts`` buckets in reverse order (so layers arrive out of order and
    a layer's tensors may land in two buckets), each a list of uint8 numpy arrays in the object store."""
    names = list(state)[::-1]
    size = -(-len(names) // parts)
    out = []
    for i in range(0, len(names), size):
        chunk = names[i : i + size]
        meta = {"names": chunk, "dtype_names": [str(state[n].dtype).removeprefix("torch.") for n in chunk],
                "shapes": [list(state[n].shape) for n in chunk]}
        out.append((meta, ray.put([state[n].contiguous().reshape(-1).view(torch.uint8).numpy() for n in chunk])))
    return out


def sync(ray, engine, state, version, parts=3):
    """One weight-sync session through the engine's actor calls (what the learner's sync_weights does)."""
    ray.get(engine.start_weight_update.remote())
    for meta, ref in put_buckets(ray, state, parts):
        ray.get(engine.update_weights.remote(meta, ref))
    return ray.get(engine.finish_weight_update.remote(version))


# ---------------------------------------------------------------------------------------------- fast, no vLLM


def test_fused_experts_split_into_checkpoint_names(base_model, tiny_moe):
    from safetensors.torch import load_file

    on_disk = load_file(tiny_moe / "model.safetensors")
    converted = checkpoint_state(base_model)
    assert converted.keys() == on_disk.keys()
    assert all(torch.equal(converted[k], on_disk[k]) for k in on_disk)


def test_bucket_tensors_are_views_of_arrays_and_bytes():
    a, b = torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    info = ObjectRefUpdateInfo(names=["a", "b"], dtype_names=["float32", "bfloat16"], shapes=[[2, 3], [4]],
                               buffers=[a.reshape(-1).view(torch.uint8).numpy(), bytes(b.view(torch.uint8).numpy())])
    (na, ta), (nb, tb) = bucket_tensors(info)
    assert (na, nb) == ("a", "b") and torch.equal(ta, a) and torch.equal(tb, b) and tb.dtype == torch.bfloat16
    assert ta.data_ptr() == info.buffers[0].ctypes.data  # no copy of the array
    bad = ObjectRefUpdateInfo(names=["a"], dtype_names=["float32"], shapes=[[3, 3]], buffers=info.buffers[:1])
    with pytest.raises(ValueError, match="'a' has 24 bytes"):
        bucket_tensors(bad)


def test_flat_bucket_round_trip_and_size_check():
    """A broadcast bucket (``sync.transport=collective``): the learner packs the tensors in one uint8 buffer,
    each at a multiple of 16 bytes (a view as float32 needs an offset divisible by 4: an odd-sized bfloat16
    tensor must not shift the next), and sends the offsets; the engine cuts views there. By hand: 3 bfloat16
    (6 bytes) at 0, 2x3 float32 (24 bytes) at 16, one int64 (8 bytes) at 48; 56 bytes in all."""
    from learner.weight_sync import flat_layout, pack_flat

    assert flat_layout([]) == ([], 0) and flat_layout([16, 1, 1]) == ([0, 16, 32], 33)
    a, b, c = torch.ones(3, dtype=torch.bfloat16), torch.arange(6.0).reshape(2, 3), torch.tensor(7)
    meta, flat = pack_flat({"a": a, "b": b.t().contiguous().t(), "c": c}, 3)
    assert meta == {"names": ["a", "b", "c"], "dtype_names": ["bfloat16", "float32", "int64"],
                    "shapes": [[3], [2, 3], []], "bucket": 3, "offsets": [0, 16, 48], "flat_bytes": 56}
    assert flat.dtype == torch.uint8 and flat.shape == (56,)
    info = ObjectRefUpdateInfo(**meta)
    views = flat_views(info, flat)
    assert [v.numel() for v in views] == [6, 24, 8] and views[1].data_ptr() == flat.data_ptr() + 16  # no copy
    info.buffers = views
    (_, ta), (_, tb), (_, tc) = bucket_tensors(info)
    assert torch.equal(ta, a) and torch.equal(tb, b) and tc.item() == 7 and tc.shape == ()
    with pytest.raises(ValueError, match="flat buffer of 55 bytes .* says 56"):
        flat_views(info, flat[:55])
    with pytest.raises(ValueError, match=r"'b' \(float32, 24 bytes\) at offset 6 of 56"):
        flat_views(ObjectRefUpdateInfo(**{**meta, "offsets": [0, 6, 48]}), flat)
    with pytest.raises(ValueError, match="2 offsets for 3 tensors"):
        flat_views(ObjectRefUpdateInfo(**{**meta, "offsets": [0, 16]}), flat)


# ---------------------------------------------------------------------------------------------- real vLLM


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_multiprocess_mode_update_through_byte_blobs(ray_cluster, mp_engine, base_model, tokenizer):
    """vLLM's default mode (EngineCore and Worker subprocesses): numpy arrays do not survive the msgpack hop
    to the engine core, so each tensor's bytes travel as ``bytes``; the reloaded engine must match."""
    new = perturbed(base_model, seed=3)
    sync(ray_cluster, mp_engine, checkpoint_state(new), 1)
    out = ray_cluster.get(mp_engine.generate.remote(rows(tokenizer, ["1 + 1 = "]), 2, temperature=1.0, seed=1))
    assert [c.weight_version for c in out] == [1, 1]
    assert max_diff(new, out, 1.0) < TOL


def test_llm_kwargs_executor_and_kv_by_device():
    """TP > 1 runs vLLM's mp executor inside the one-bundle actor (the ray executor refuses multi-GPU bundles);
    on a GPU the KV cache is left to gpu_memory_utilization, on the CPU it is kv_cache_gb bytes."""
    import pytest

    from rollout.config import RolloutConfig
    from rollout.engine import llm_kwargs

    cpu = llm_kwargs(RolloutConfig(kv_cache_gb=0.25), seed=3)
    assert cpu["kv_cache_memory_bytes"] == 2**28 and cpu["distributed_executor_backend"] == "uni" and cpu["seed"] == 3
    gpu = llm_kwargs(RolloutConfig(num_gpus_per_engine=1, tensor_parallel_size=2, gpu_memory_utilization=0.7), seed=0)
    assert "kv_cache_memory_bytes" not in gpu and gpu["gpu_memory_utilization"] == 0.7
    assert gpu["distributed_executor_backend"] == "mp" and gpu["tensor_parallel_size"] == 2
    with pytest.raises(ValueError, match="rollout.kv_cache_gb=2.0 with rollout.num_gpus_per_engine=1.0"):
        RolloutConfig(num_gpus_per_engine=1, kv_cache_gb=2)
    # routing capture reads the step's input tokens: no async scheduling (vLLM's GPU default) under it
    assert "async_scheduling" not in gpu
    r3 = llm_kwargs(RolloutConfig(num_gpus_per_engine=1, return_routed_experts=True), seed=0)
    assert r3["async_scheduling"] is False and r3["enforce_eager"] is True


def test_engine_tmp_folder_keeps_ipc_socket_paths_short(tmp_path):
    """vLLM's multiprocess engine names ZMQ sockets ``ipc://<TMPDIR>/<uuid4>``; Unix allows 107 bytes."""
    from rollout.engine import _IPC_NAME_BYTES, _short_tmp

    short = tmp_path / "t"
    assert _short_tmp(short) == short and short.is_dir()
    deep = tmp_path / ("x" * 80) / "tmp"
    got = _short_tmp(deep)
    assert got != deep and got.is_dir() and len(str(got)) + _IPC_NAME_BYTES <= 107
