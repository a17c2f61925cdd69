"""The vLLM rollout engine on the tiny Qwen3-MoE, run for real inside Ray actors and compared with a
transformers float32 forward of the same tokens.

One in-process engine (a Ray actor, so vLLM's process-wide settings stay out of the pytest process) is shared
by the module; the tests that update its weights record the reference model it now holds in ``_current``.
Engines start with the environment the trainer gives its engines (``engine_options``).
"""

from __future__ import annotations

import pytest
import torch

from learner.weight_sync import to_checkpoint_format
from rollout.config import RolloutConfig
from rollout.contracts import PromptRow
from rollout.engine import RolloutEngine

TEMPERATURE = 0.7


def engine_options(cfg: RolloutConfig, num_cpus: float = 1) -> dict:
    """Ray actor options of a test's ``RolloutEngine`` with settings ``cfg``: the environment the trainer starts
    its engines with (``cluster.runtime.services.engine_env``; on the CPU in eager mode ``TORCH_COMPILE_DISABLE=1``,
    without which vLLM's sampler g++-builds a small kernel at every engine start, tens of seconds)."""
    from cluster.runtime.services import engine_env

    return {"num_cpus": num_cpus, "runtime_env": {"env_vars": engine_env(cfg)}}


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
    """An engine in vLLM's multi-process mode (its one test is a matrix case)."""
    cfg = RolloutConfig(in_process=False, max_model_len=64, max_response_tokens=6, seed=5)
    actor = ray_cluster.remote(RolloutEngine).options(**engine_options(cfg)).remote(
        str(tiny_moe), cfg, cache_dir=str(tmp_path_factory.mktemp("vllm_cache_mp"))
    )
    yield actor
    ray_cluster.get(actor.shutdown.remote())
    ray_cluster.kill(actor)


@pytest.fixture(scope="module")
def engine(ray_cluster, tiny_moe, base_model, tmp_path_factory):
    cfg = RolloutConfig(max_model_len=256, max_response_tokens=12, temperature=TEMPERATURE, seed=7)
    actor = ray_cluster.remote(RolloutEngine).options(**engine_options(cfg)).remote(
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
