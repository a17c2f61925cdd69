"""Generation speed on the real chat model: the vLLM rollout engine against transformers ``generate``, same
prompts, same greedy decoding, same thread count, one invocation, each in its own fresh process (vLLM's
in-process engine pins the process's torch threads).

    python bench/real_model.py [--model models/smollm2-135m-instruct] [--prompts 32] [--max-tokens 64] [--threads 2]
                               [--repeats 2]

Prompts: the first ``--prompts`` questions of ``models/arith_words/test.jsonl`` through the model's chat template
(``make real-model`` writes both). Prints per side the generated tokens, seconds, tokens/s and the process's peak
RSS (``ru_maxrss``), ``--repeats`` rounds alternating the sides, then the best tokens/s of each and ``ratio`` =
engine / transformers of those bests (on a shared machine other jobs' load moves single figures by 5x).
Figures: docs/real_model.md.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import time


def _prompts(model: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(model), "arith_words", "test.jsonl"))]
    ask = " Put the final answer in \\boxed{}."
    return [tok.apply_chat_template([{"role": "user", "content": r["question"] + ask}], add_generation_prompt=True,
                                    tokenize=True, return_dict=False) for r in rows[:count]]


def _engine(model: str, count: int, max_tokens: int, threads: int, out: mp.Queue) -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from rollout.config import RolloutConfig
    from rollout.contracts import PromptRow
    from rollout.engine import RolloutEngine

    ids = _prompts(model, count)
    engine = RolloutEngine(model, RolloutConfig(max_model_len=256, max_response_tokens=max_tokens, kv_cache_gb=0.5,
                                                threads_per_engine=threads), cache_dir="/tmp/gspo-bench-real-model")
    rows = [PromptRow(f"p{i}", "", p, "") for i, p in enumerate(ids)]
    engine.generate_greedy(rows[:2])  # warm-up
    t0 = time.perf_counter()
    done = engine.generate_greedy(rows)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.response_token_ids) for c in done)
    out.put({"side": "vllm_engine", "tokens": tokens, "seconds": seconds,
             "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})
    engine.shutdown()


def _transformers(model: str, count: int, max_tokens: int, threads: int, out: mp.Queue) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model)
    tok.padding_side = "left"
    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    ids = _prompts(model, count)
    batch = tok.pad({"input_ids": ids}, return_tensors="pt")
    with torch.no_grad():
        lm.generate(**{k: v[:2] for k, v in batch.items()}, max_new_tokens=4, do_sample=False)  # warm-up
        t0 = time.perf_counter()
        gen = lm.generate(**batch, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        seconds = time.perf_counter() - t0
    new = gen[:, batch["input_ids"].shape[1]:]
    eos = set(lm.generation_config.eos_token_id if isinstance(lm.generation_config.eos_token_id, list)
              else [lm.generation_config.eos_token_id])
    tokens = 0
    for row in new.tolist():  # count up to and including the first EOS, as the engine does
        ends = [i for i, t in enumerate(row) if t in eos]
        tokens += ends[0] + 1 if ends else len(row)
    out.put({"side": "transformers_generate", "tokens": tokens, "seconds": seconds,
             "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20})


def main() -> None:
    """Run both sides, one fresh process each, and print their figures and the ratio."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="models/smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of (engine, transformers); best of each")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    best: dict[str, float] = {}
    for rep in range(args.repeats):  # alternating sides, so that load from other jobs hits both alike
        for target in (_engine, _transformers):
            queue = ctx.Queue()
            proc = ctx.Process(target=target, args=(args.model, args.prompts, args.max_tokens, args.threads, queue))
            proc.start()
            r = queue.get()
            proc.join()
            r["tokens_per_s"] = r["tokens"] / r["seconds"]
            r["repeat"] = rep
            best[r["side"]] = max(best.get(r["side"], 0.0), r["tokens_per_s"])
            print(json.dumps(r))
    ratio = best["vllm_engine"] / best["transformers_generate"]
    print(json.dumps({"best_tokens_per_s": best, "ratio_engine_to_transformers": ratio, "prompts": args.prompts,
                      "threads": args.threads, "repeats": args.repeats}))


if __name__ == "__main__":
    main()
