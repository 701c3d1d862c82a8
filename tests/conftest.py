"""Shared fixtures: tiny random-init transformers models (offline, seeded, < 1 s per generate on CPU).

``tiny_config(family)`` builds the config, ``tiny_model(family)`` returns a module-cached eval model, and the
``tiny_llama`` / ``tiny_qwen3`` / ``tiny_mistral`` / ``tiny_hybrid`` / ``tiny_gemma3`` fixtures wrap it.
Families: ``llama``, ``qwen3``, ``mistral`` (full attention only), ``hybrid`` (Qwen3.5-style: linear attention +
full attention), ``gemma3`` (sliding + full attention). Every model: hidden 64, 4 layers or fewer, vocab 256, fp32.
Tests that mutate a model (patching, attention implementation) must undo it; use ``fresh_tiny_model`` to get an
unshared copy instead.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

FAMILIES = ("llama", "qwen3", "mistral", "hybrid", "gemma3")

SLOW = (
    # Triton kernels on the CPU interpreter (tests/ops/test_triton_gate.py runs them in the quick subset)
    "tests/ops/test_triton_raw_rows.py", "tests/ops/test_triton_append.py", "tests/ops/test_triton_read.py",
    "tests/ops/test_triton_long.py", "tests/ops/test_triton_attention.py", "tests/ops/test_triton_blocks.py",
    "tests/ops/test_normalize.py::test_triton_kernels_follow_the_reference", "tests/vllm/test_triton_kernels.py",
    "tests/ops/test_triton_append_attention.py",
    # torch.compile (tests/passes/test_match_variants.py and test_new_codec_compiled.py stay)
    "tests/passes/test_compile_presets.py", "tests/passes/test_hf_compile.py", "tests/passes/test_compiled_toy.py",
    "tests/passes/test_wrapper_warning.py", "tests/passes/test_backend_registry.py::test_entry_point_loads_without_import",
    "tests/hf/test_hf_view_exact.py::test_a_compiled_update_returns_the_same_views",
    "tests/demo/test_side_by_side.py::test_compiled_turn_decodes_the_same_tokens_as_eager",
    # fuzzing, real models, long runs, many generate() calls, fresh interpreters
    "tests/hf/test_cache_contract_fuzz.py", "tests/hf/test_hf_lossless_real.py", "tests/hf/test_hf_assisted.py",
    "tests/hf/test_hf_long_run.py", "tests/demo/test_app.py::test_out_of_memory_is_a_message_in_the_page",
    "tests/test_lazy_imports.py",
    # every transformers CausalLM architecture (test_core_conformance's few stay)
    "tests/conformance/test_architectures.py::test_conformance",
    "tests/conformance/test_architectures.py::test_enough_architectures_run_and_every_skip_says_why",
)
"""Tests marked ``slow`` (node-id prefixes: a module, a test, or one case): about 80% of the full suite's CPU time, left
out of the quick subset ``-m "not slow"`` (docs/testing.md, with the timings that chose them). Every test folder keeps
quick tests (tests/test_quick_subset.py checks that, and that each entry names a test that exists)."""


def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`SLOW` ``slow``."""
    for item in items:
        if any(item.nodeid == entry or item.nodeid.startswith((f"{entry}::", f"{entry}[")) for entry in SLOW):
            item.add_marker(pytest.mark.slow)
VOCAB = 256

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=None,
               tie_word_embeddings=False)


def pytest_configure(config):
    """Under pytest-xdist (``-n N``) each worker's torch takes its share of the cores (at least one): N workers of
    the machine's default thread count each would oversubscribe it, and PyTorch's OpenMP threads collapse beside
    another busy process (DESIGN.md)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, torch.get_num_threads() // int(workers)))


@pytest.fixture(autouse=True)
def _torch_threads():
    """Each test starts with the thread count the session started with (tests that pin threads need not undo it)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_config(family: str):
    """The config of a tiny model of ``family`` (see module docstring)."""
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        return transformers.LlamaConfig(num_hidden_layers=2, **_COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(num_hidden_layers=2, **_COMMON)
    if family == "mistral":
        return transformers.MistralConfig(num_hidden_layers=2, sliding_window=None, **_COMMON)
    if family == "hybrid":
        if not hasattr(transformers, "Qwen3_5TextConfig"):
            pytest.skip("this transformers has no Qwen3.5 (linear + full attention hybrid)")
        return transformers.Qwen3_5TextConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            **_COMMON)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(
            num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=12,
            query_pre_attn_scalar=16, **_COMMON)
    raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")


def _model_class(family: str):
    import transformers

    return {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM,
            "mistral": transformers.MistralForCausalLM, "hybrid": getattr(transformers, "Qwen3_5ForCausalLM", None),
            "gemma3": transformers.Gemma3ForCausalLM}[family]


def fresh_tiny_model(family: str, seed: int = 0, attn_implementation: str = "sdpa"):
    """A new eval-mode fp32 model of ``family`` with seeded random weights (not shared between tests)."""
    config = tiny_config(family)
    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = _model_class(family)(config)
    return model.eval()


@functools.cache
def tiny_model(family: str):
    """A shared, module-lifetime tiny model of ``family``. Do not leave it patched."""
    return fresh_tiny_model(family)


def tiny_prompt(batch: int = 1, length: int = 12, seed: int = 1) -> torch.Tensor:
    """Random prompt ids ``(batch, length)`` int64 avoiding the pad / bos / eos ids."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=gen)


@pytest.fixture(params=FAMILIES)
def tiny_family(request) -> str:
    return request.param


@pytest.fixture
def tiny_llama():
    return tiny_model("llama")


@pytest.fixture
def tiny_qwen3():
    return tiny_model("qwen3")


@pytest.fixture
def tiny_mistral():
    return tiny_model("mistral")


@pytest.fixture
def tiny_hybrid():
    return tiny_model("hybrid")


@pytest.fixture
def tiny_gemma3():
    return tiny_model("gemma3")


def cache_kwargs(cache) -> dict:
    """``{name: cache}`` for ``generate`` / ``forward``: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    import transformers

    name = "cache" if "cache" in inspect.signature(transformers.LlamaForCausalLM.forward).parameters else "past_key_values"
    return {name: cache}


def output_cache(output):
    """The cache of a ``generate(..., return_dict_in_generate=True)`` / ``forward`` output, across 5.x versions."""
    return output.cache if hasattr(output, "cache") else output.past_key_values


def char_tokenizer(vocab_size: int = VOCAB):
    """An offline character tokenizer for the tiny models: one printable character per id above the pad / bos / unk
    ids, so any generated id shows as text. Another ``vocab_size`` gives another vocabulary over the same characters
    (in the opposite id order), for assistants with a different tokenizer."""
    tok = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in map(chr, range(0x20, 0x250)) if c.isprintable()][: vocab_size - 3]
    if vocab_size != VOCAB:
        chars = chars[::-1]
    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    backend = tok.Tokenizer(tok.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tok.pre_tokenizers.Split("", "isolated")
    backend.decoder = tok.decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", bos_token="<s>")


def save_tiny_model(folder, family: str = "llama") -> None:
    """Save ``fresh_tiny_model(family)`` with :func:`char_tokenizer` to ``folder``, loadable by
    ``flashcodec_fx.pretrained.load_pretrained(folder)``."""
    fresh_tiny_model(family).save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)


@pytest.fixture(scope="session")
def cpu_kernels():
    """The compiled C++ CPU kernels (``flashcodec_fx.ops.cpu``), built once per machine (about 30 s the first time,
    then loaded from the user cache). Skips only where no C++ compiler exists; a failed build with one is an error."""
    import os
    import shutil

    from flashcodec_fx.ops.cpu import EXTENSION

    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the CPU kernels fall back to the reference ops (tests/ops/test_cpu_build.py)")
    module = EXTENSION.module()
    assert module is not None, f"the CPU kernels failed to build: {EXTENSION.error}"
    return module
@pytest.fixture
def tiny_model_folder(tmp_path):
    """``save_tiny_model`` into a fresh folder (what ``load_pretrained`` / ``flashcodec run --model`` read)."""
    folder = tmp_path / "tiny-model"
    save_tiny_model(folder)
    return folder
