"""The vLLM rollout engine on the tiny Qwen3-MoE, run for real inside Ray actors and compared with a
transformers float32 forward of the same tokens.

One in-process engine (a Ray actor, so vLLM's process-wide settings stay out of the pytest process) is shared
by the module; the tests that update its weights record the reference model it now holds in ``_current``.
"""

from __future__ import annotations

import pytest
import torch

from rollout.weight_sync import ObjectRefUpdateInfo, bucket_tensors, flat_views
from tests.helpers.rollout import checkpoint_state
from tests.helpers.rollout import base_model  # noqa: F401 - fixtures


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


def test_llm_kwargs_executor_and_kv_by_device():
    """TP > 1 runs vLLM's mp executor inside the one-bundle actor (the ray executor refuses multi-GPU bundles);
    on a GPU the KV cache is left to gpu_memory_utilization, on the CPU it is kv_cache_gb bytes."""
    import pytest

    from rollout.config import RolloutConfig
    from rollout.vllm_setup import llm_kwargs

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
    from rollout.vllm_setup import _IPC_NAME_BYTES, _short_tmp

    short = tmp_path / "t"
    assert _short_tmp(short) == short and short.is_dir()
    deep = tmp_path / ("x" * 80) / "tmp"
    got = _short_tmp(deep)
    assert got != deep and got.is_dir() and len(str(got)) + _IPC_NAME_BYTES <= 107
