"""LoRA on the rollout engine: vLLM's own LoRA serving (base + adapter) against merged weights, on this CPU.

For each tiny architecture (``--archs``, keys of ``cluster.models.tiny_archs.ARCHS``): a random peft adapter
(``--rank``, attention and MLP projections; B non-zero so the adapter changes the model) is made, then

* ``adapter``: an engine started with ``enable_lora=True`` samples with a ``LoRARequest`` of the adapter
  folder; a new ``LoRARequest`` (new id) per weight version is what a sync would be;
* ``merged``: an engine without LoRA gets ``W + scale B A`` through ``RolloutEngine.load_state_dict``
  (the weight-sync path); a weight version is that load.

It prints, per side: whether it ran (the error if not), the engine's sequence log-probs against a
transformers + peft forward (max |diff|, fp32), the generation throughput (tokens/s, the two sides alternated
``--repeats`` times, best of each) and the seconds and bytes of one weight version. Run as
``PYTHONPATH=. .venv/bin/python bench/lora_serving.py`` (starts vLLM in this process: wrap in /work/heavy).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository before bench/ (bench/learner.py)


def make_adapter(model_dir: Path, out: Path, rank: int, seed: int) -> tuple[object, dict]:
    """A peft model over ``model_dir`` with random A and B (seeded), saved to ``out``; returns it and the merged
    checkpoint-format state dict."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from learner.config import DEFAULT_TARGETS
    from learner.lora import merged_checkpoint_state

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(DEFAULT_TARGETS), lora_dropout=0.0)
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    model.eval()
    model.save_pretrained(out)
    return model, merged_checkpoint_state(model)


def peft_logprobs(model, seq: list[int], start: int) -> list[float]:
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[1:])[:, None])[:, 0]
    return lp[start - 1 :].tolist()


def run_side(side: str, model_dir: Path, adapter_dir: Path, merged: dict, args, prompts, seq, start, want) -> dict:
    """Start one engine (``side`` = adapter | merged) and measure it; returns figures or the error."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    kwargs = dict(model=str(model_dir), dtype="float32", max_model_len=64, enforce_eager=True, seed=0,
                  logprobs_mode="processed_logprobs", kv_cache_memory_bytes=1 << 28, enable_chunked_prefill=False,
                  max_num_batched_tokens=4096, disable_log_stats=True)
    if side == "adapter":
        kwargs.update(enable_lora=True, max_lora_rank=max(8, args.rank), max_loras=1)
    else:
        from vllm.config import WeightTransferConfig

        kwargs.update(worker_extension_cls="rollout.weight_sync.RolloutWorkerExtension",
                      weight_transfer_config=WeightTransferConfig(backend="ray_object"))
    out: dict = {"side": side}
    try:
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
        out["start_s"] = time.perf_counter() - t0
        if side == "merged":
            llm.init_weight_transfer_engine({"init_info": {}})
        version = [0]

        def new_version() -> tuple[float, object]:
            t = time.perf_counter()
            version[0] += 1
            if side == "adapter":
                req = LoRARequest(f"v{version[0]}", version[0], str(adapter_dir))
                llm.generate([TokensPrompt(prompt_token_ids=[1, 5])], SamplingParams(max_tokens=1),
                             lora_request=req, use_tqdm=False)  # the load happens at the first use
                llm.llm_engine.remove_lora(version[0] - 1) if version[0] > 1 else None
                return time.perf_counter() - t, req
            from rollout.engine import RolloutEngine

            RolloutEngine.load_state_dict(_Shim(llm), merged, version[0])
            return time.perf_counter() - t, None

        secs, req = new_version()
        secs2, req = new_version()
        out["version_s"] = min(secs, secs2)
        out["version_bytes"] = (sum(f.stat().st_size for f in adapter_dir.glob("adapter_model*"))
                                if side == "adapter" else sum(t.numel() * t.element_size() for t in merged.values()))
        p = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        (o,) = llm.generate([TokensPrompt(prompt_token_ids=seq)], p, lora_request=req, use_tqdm=False)
        got = [float(o.prompt_logprobs[t][seq[t]].logprob) for t in range(start, len(seq))]
        out["max_logprob_diff"] = max(abs(a - b) for a, b in zip(got, want))
        sp = SamplingParams(n=8, temperature=1.0, max_tokens=args.tokens, ignore_eos=True, logprobs=0, seed=1)
        best = 0.0
        for _ in range(args.repeats):
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p_) for p_ in prompts], sp, lora_request=req,
                               use_tqdm=False)
            n = sum(len(c.token_ids) for r in res for c in r.outputs)
            best = max(best, n / (time.perf_counter() - t))
        out["tokens_per_s"] = best
        del llm
    except Exception as err:  # noqa: BLE001 - a side that cannot run on this CPU is a result
        out["error"] = f"{type(err).__name__}: {(str(err).splitlines() or ['-'])[0][:300]}"
        out["trace_tail"] = traceback.format_exc().splitlines()[-4:]
    return out


class _Shim:
    """Just enough of ``RolloutEngine`` for its ``load_state_dict`` on a bare ``LLM`` (the weight-sync calls)."""

    def __init__(self, llm):
        self._llm = llm

    def start_weight_update(self):
        self._llm.start_weight_update()

    def update_weights(self, meta, buffers):
        self._llm.update_weights({"update_info": {**meta, "buffers": list(buffers)}})

    def finish_weight_update(self, version):
        self._llm.finish_weight_update()
        self._llm.reset_prefix_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--archs", default="qwen3_moe,llama")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sides", default="merged,adapter")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    import torch

    from cluster.models.tiny_archs import build_tiny_arch

    torch.set_num_threads(1)
    from vllm.config import WeightTransferConfig  # noqa: F401 - vLLM first, then our backend registers

    import rollout.weight_sync  # noqa: F401

    root = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    for arch in args.archs.split(","):
        model_dir = build_tiny_arch(root / arch, arch)
        model, merged = make_adapter(model_dir, root / f"{arch}-adapter", args.rank, seed=0)
        seq, start = [1] + [5 + (i * 7) % 50 for i in range(30)], 6
        want = peft_logprobs(model, seq, start)
        prompts = [[1] + [5 + (i * 3 + j) % 40 for j in range(10)] for i in range(args.prompts)]
        for side in args.sides.split(","):
            print(arch, run_side(side, model_dir, root / f"{arch}-adapter", merged, args, prompts, seq, start, want),
                  flush=True)


if __name__ == "__main__":
    main()
