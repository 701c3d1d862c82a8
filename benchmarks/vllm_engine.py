"""One vLLM engine (offline ``LLM``) running a list of workloads; prints one ``ENGINE_JOB {json}`` line.

    python benchmarks/vllm_engine.py '{"model": "...", "llm": {...LLM kwargs}, "greedy": [...], "ppl": {...}}'

The environment carries the plugin's configuration (``FLASHCODEC_VLLM_*``), so each configuration runs in a
process of its own; vLLM spawns its engine and worker processes (hence the ``__main__`` guard). Used by
``bench_vllm.py`` and tests/vllm/test_engine.py. Workloads (each optional):

- ``greedy``: prompts (text or token ids), ``tokens`` greedy tokens each (EOS ignored), with every step's top-two
  logprobs and the prompt's cached (prefix-hit) tokens;
- ``prefix``: ``[a, b]``: a, then b (hits a's shared pages), then b again after ``reset_prefix_cache`` (no hit),
  ``prefix_tokens`` greedy tokens each (default ``tokens``);
- ``preempt``: ``{"prompts", "tokens"}``: each prompt alone, then all at once, and the preemptions vLLM counted;
- ``ppl``: ``{"windows": [[ids]], "score_from": k}``: each window's prompt logprobs at positions >= k, and their
  sums;
- ``throughput``: ``{"prompts": [[ids]], "tokens": n, "warmup": [ids]}``: one offline batch (after the untimed
  warm-up request, when given), its wall time, the engine processes' CPU time and token counts;
- ``load``: ``{"prompts": [[ids]], "tokens": n}``: the same, every request's time to first token and time per
  output token (vLLM's own per-request stats), the most requests running in one step and the preemptions.

``"eager": false`` starts the engine in vLLM's default mode (its torch.compile of the model; default: eager).
The result also holds the engine's start-up time and each workload's seconds (``seconds``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def greedy(llm: Any, prompts: list[str | list[int]], tokens: int) -> list[dict]:
    """Greedy continuations of text or token-id prompts, with each step's top-two logprobs."""
    from vllm import SamplingParams

    prompts = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=2, ignore_eos=True),
                        use_tqdm=False)
    return [{"ids": list(o.outputs[0].token_ids), "text": o.outputs[0].text, "cached": o.num_cached_tokens,
             "top2": [[x.logprob for x in sorted(lp.values(), key=lambda x: x.rank)[:2]] for lp in o.outputs[0].logprobs]}
            for o in outs]


def preemptions(llm: Any) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def prefix_hits(llm: Any, prompts: list[list[int]], tokens: int) -> dict:
    """``a``, then ``b`` (hitting a's shared pages), then ``b`` again on an empty prefix cache."""
    first = greedy(llm, prompts[:1], tokens)[0]
    shared = greedy(llm, prompts[1:], tokens)[0]
    llm.reset_prefix_cache()
    fresh = greedy(llm, prompts[1:], tokens)[0]
    return {"first": first, "shared": shared, "fresh": fresh}


def preempt(llm: Any, prompts: list[str], tokens: int) -> dict:
    """Each prompt alone, then all at once, and the preemptions vLLM counted in the batch."""
    solo = [greedy(llm, [p], tokens)[0] for p in prompts]
    before = preemptions(llm)
    together = greedy(llm, prompts, tokens)
    return {"solo": solo, "together": together, "preemptions": preemptions(llm) - before}


def prompt_nll(llm: Any, windows: list[list[int]], score_from: int) -> dict:
    """Per window: the log-probability of each token ``score_from ..`` given the ones before (prompt logprobs),
    and their negated sum (the negative log-likelihood)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": w} for w in windows], SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    logprobs = [[out.prompt_logprobs[i][window[i]].logprob for i in range(score_from, len(window))]
                for window, out in zip(windows, outs, strict=True)]
    return {"nll_sums": [-sum(lp) for lp in logprobs], "scored": [len(w) - score_from for w in windows],
            "logprobs": logprobs}


def tree_cpu_seconds(root: int | None = None) -> float | None:
    """User + system CPU seconds of process ``root`` (default: this one) and every live descendant (vLLM's engine
    core and workers), from ``/proc``; None where there is no ``/proc``."""
    import os

    root = os.getpid() if root is None else root
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return None
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(name)] = int(fields[1])
        ticks[int(name)] = int(fields[11]) + int(fields[12])  # utime, stime
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent and pid not in tree]
        tree.update(children)
        frontier += children
    return sum(ticks.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def throughput(llm: Any, prompts: list[list[int]], tokens: int, warmup: list[int] | None = None) -> dict:
    """One offline batch (after an untimed ``warmup`` request, 2 tokens, when given): its wall time, the CPU time
    of the engine's processes meanwhile (``cpu_seconds``: steadier than wall time on a shared machine, where the
    engine waits for a core), and its tokens."""
    from vllm import SamplingParams

    if warmup:
        llm.generate([{"prompt_token_ids": warmup}], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    cpu = tree_cpu_seconds()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    cpu_after = tree_cpu_seconds()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"seconds": seconds, "cpu_seconds": None if cpu is None or cpu_after is None else cpu_after - cpu,
            "prompt_tokens": sum(len(p) for p in prompts), "generated_tokens": generated}


class SchedulerWatch:
    """A stat logger (the interface of vLLM's ``StatLoggerBase``) added to the engine's own: the most requests
    running after one step, the most KV cache in use (a fraction) and the preemptions, over the steps it sees."""

    def __init__(self) -> None:
        self.max_running = 0
        self.max_kv_usage = 0.0
        self.preemptions = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self.max_running = max(self.max_running, scheduler_stats.num_running_reqs)
            self.max_kv_usage = max(self.max_kv_usage, scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            self.preemptions += iteration_stats.num_preempted_reqs

    def log(self) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def load(llm: Any, prompts: list[list[int]], tokens: int) -> dict:
    """Every prompt submitted at once, ``tokens`` generated each (EOS ignored): the wall time and, per request (in
    order), its time to first token (from its arrival, queueing included) and time per output token after the
    first (vLLM's ``RequestStateStats``: preemption stalls included), as vLLM's serving benchmark defines them."""
    from vllm import SamplingParams

    watch = SchedulerWatch()
    llm.llm_engine.logger_manager.stat_loggers.append(watch)
    before = preemptions(llm)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), use_tqdm=False)
    seconds = time.perf_counter() - start
    requests = []
    for out in outs:
        stats, generated = out.metrics, len(out.outputs[0].token_ids)
        requests.append({"generated": generated, "ttft": stats.first_token_latency,
                         "tpot": (stats.last_token_ts - stats.first_token_ts) / max(generated - 1, 1),
                         "preemptions": stats.num_preemptions})
    return {"seconds": seconds, "prompt_tokens": sum(len(p) for p in prompts), "requests": requests,
            "max_running": watch.max_running, "max_kv_usage": watch.max_kv_usage,
            "preemptions": watch.preemptions, "preemptions_counted": preemptions(llm) - before}


def main(job: dict) -> dict:
    from vllm import LLM

    start = time.perf_counter()
    llm = LLM(model=job["model"], enforce_eager=job.get("eager", True), disable_log_stats=False, seed=0,
              **job.get("llm", {}))
    config = llm.llm_engine.vllm_config.cache_config
    out: dict[str, Any] = {"start_seconds": time.perf_counter() - start, "blocks": config.num_gpu_blocks,
                           "block_size": config.block_size, "seconds": {}}
    tokens = job.get("tokens", 32)

    def timed(name: str, fn) -> None:
        begin = time.perf_counter()
        out[name] = fn()
        out["seconds"][name] = time.perf_counter() - begin

    if "greedy" in job:
        timed("greedy", lambda: greedy(llm, job["greedy"], tokens))
    if "prefix" in job:
        timed("prefix", lambda: prefix_hits(llm, job["prefix"], job.get("prefix_tokens", tokens)))
    if "preempt" in job:
        timed("preempt", lambda: preempt(llm, job["preempt"]["prompts"], job["preempt"]["tokens"]))
    if "ppl" in job:
        timed("ppl", lambda: prompt_nll(llm, job["ppl"]["windows"], job["ppl"]["score_from"]))
    if "throughput" in job:
        timed("throughput", lambda: throughput(llm, job["throughput"]["prompts"], job["throughput"]["tokens"],
                                               job["throughput"].get("warmup")))
    if "load" in job:
        timed("load", lambda: load(llm, job["load"]["prompts"], job["load"]["tokens"]))
    return out


def run_job(job: dict, env: dict[str, str], python: str = sys.executable, timeout: float = 3600) -> dict:
    """Run ``job`` in a new process of ``python`` with environment ``env``; its result (RuntimeError with the
    log's tail when it fails)."""
    import subprocess

    done = subprocess.run([python, __file__, json.dumps(job)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENGINE_JOB ")]
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
        raise RuntimeError(f"vLLM engine job failed ({done.returncode}); error lines:\n" + "\n".join(errors[-20:])
                           + f"\n... log tail:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("ENGINE_JOB "))


if __name__ == "__main__":
    print("ENGINE_JOB " + json.dumps(main(json.loads(sys.argv[1]))), flush=True)
