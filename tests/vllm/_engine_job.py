"""One vLLM engine (offline ``LLM``) on SmolLM2 running the engine tests' workloads; prints one JSON line.

    python _engine_job.py '{"model": "...", "kv_blocks": 24, "greedy": [...], "prefix": [a, b], "preempt": {...}}'

Run in a subprocess by tests/vllm/test_engine.py (the environment carries the plugin's configuration; vLLM spawns
its engine and worker processes, hence the ``__main__`` guard).
"""

from __future__ import annotations

import json
import sys


def greedy(llm, prompts: list[str | list[int]], tokens: int) -> list[dict]:
    """Greedy continuations of text or token-id prompts, with each step's top-two logprobs."""
    from vllm import SamplingParams

    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=2, ignore_eos=True),
                        use_tqdm=False)
    return [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text, "cached": o.num_cached_tokens,
             "top2": [[x.logprob for x in sorted(lp.values(), key=lambda x: x.rank)[:2]] for lp in o.outputs[0].logprobs]}
            for o in outs]


def preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def main(job: dict) -> dict:
    from vllm import LLM

    llm = LLM(model=job["model"], max_model_len=job.get("max_model_len", 2048), enforce_eager=True,
              block_size=job.get("block_size"), num_gpu_blocks_override=job.get("kv_blocks"), disable_log_stats=False,
              max_num_batched_tokens=job.get("chunk"), max_num_seqs=job.get("max_seqs"), seed=0)
    config = llm.llm_engine.vllm_config.cache_config
    out = {"blocks": config.num_gpu_blocks, "block_size": config.block_size}
    if "greedy" in job:
        out["greedy"] = greedy(llm, job["greedy"], job.get("tokens", 32))
    if "prefix" in job:  # a, then b sharing a's prefix (a hit), then b again on an empty prefix cache (no hit)
        first = greedy(llm, job["prefix"][:1], job.get("tokens", 32))[0]
        shared = greedy(llm, job["prefix"][1:], job.get("tokens", 32))[0]
        llm.reset_prefix_cache()
        fresh = greedy(llm, job["prefix"][1:], job.get("tokens", 32))[0]
        out["prefix"] = {"first": first, "shared": shared, "fresh": fresh}
    if "preempt" in job:  # solo runs, then all at once in a cache too small for all of them
        spec = job["preempt"]
        solo = [greedy(llm, [p], spec["tokens"])[0] for p in spec["prompts"]]
        before = preemptions(llm)
        together = greedy(llm, spec["prompts"], spec["tokens"])
        out["preempt"] = {"solo": solo, "together": together, "preemptions": preemptions(llm) - before}
    return out


if __name__ == "__main__":
    print("ENGINE_JOB " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
