"""The original system's README (its API, import name ``flashcodec``) runs unchanged against ``flashcodec_fx``.

``seed/readme_quickstart.txt`` holds that README's code verbatim. It is executed chunk by chunk (a chunk starts at
each comment line in column 0) with only these edits, each asserted to apply:
- the import name: ``from flashcodec import`` -> ``from flashcodec_fx import``;
- ``SUBSTITUTIONS``: the lines that load Qwen3.5-0.8B from the hub onto a GPU load a tiny random-init model instead.
The names the snippets expect from their surroundings (``model``, ``input_ids``, ``k_seq``, ...) are given to them.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from conftest import fresh_tiny_model, tiny_prompt  # noqa: E402

import flashcodec_fx  # noqa: E402
from flashcodec_fx._compat import GENERATE_CACHE_KWARG  # noqa: E402

SEED = Path(__file__).resolve().parent / "seed" / "readme_quickstart.txt"
IMPORT = ("from flashcodec import", "from flashcodec_fx import")
SUBSTITUTIONS = {
    'model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3.5-0.8B",\n'
    '                                             torch_dtype="bfloat16").cuda()':
        'model = fresh_tiny_model("hybrid")',
    'tok = AutoTokenizer.from_pretrained("Qwen/Qwen3.5-0.8B")': "tok = None",
    'ids = tok("A quiet lake at dawn", return_tensors="pt").input_ids.cuda()': "ids = tiny_prompt()",
}
# Verbatim from the seed README's prose: its frozen public API and the per-layer option.
STABLE_API = ("apply_flash_codec / remove_flash_codec, apply_codec_attention / remove_codec_attention, FlashCodecCache, "
              "FlashCodecLayer, CodecKVCache, JPEGCodec, PNGCodec, codec_decode_attention, make_codec")
PER_LAYER = 'per_layer={idx: {"keep_freqs": ...}}'
B, H, S, D = 1, 2, 21, 16


def seed_sections() -> dict[str, list[str]]:
    """``{"quick start": chunks, "transformers integration": chunks}``: each chunk a code string, edits applied."""
    text = SEED.read_text()
    assert text.count(IMPORT[0]) == 4
    text = text.replace(*IMPORT)
    for old, new in SUBSTITUTIONS.items():
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    sections: dict[str, list[str]] = {}
    for part in re.split(r"^# ---- ", text, flags=re.M)[1:]:
        name, _, body = part.partition("\n")
        chunks = re.split(r"^(?=# )", body, flags=re.M)
        sections[name] = [c for c in chunks if c.strip()]
    return sections


def run(chunk: str, namespace: dict) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(chunk, str(SEED), "exec"), namespace)
    return caught


def only_expected_warnings(caught: list[warnings.WarningMessage]) -> bool:
    """The seed passes ``past_key_values=``; transformers >= 5.24 deprecates that name (FutureWarning). And it hands
    a FlashCodecCache to a model it never patched: attention on the stored form needs the ``"kvcodec"`` attention
    function, so the cache says once per layer that it attends on the decoded view instead (the seed's own
    behaviour), and how to get the memory saving. Nothing else."""
    keyword = [w for w in caught if issubclass(w.category, FutureWarning) and "past_key_values" in str(w.message)]
    fallback = [w for w in caught if issubclass(w.category, flashcodec_fx.MaterializationFreeFallback)
                and "apply_flash_codec(model)" in str(w.message)]
    return len(keyword) + len(fallback) == len(caught) and len(fallback) > 0 \
        and (len(keyword) > 0) == (GENERATE_CACHE_KWARG == "cache")


def test_quick_start_runs_unchanged(capsys):
    chunks = seed_sections()["quick start"]
    model = fresh_tiny_model("llama")
    input_ids = tiny_prompt()
    reference = model.generate(input_ids, max_new_tokens=64, do_sample=False)
    gen = torch.Generator().manual_seed(0)
    k_seq, v_seq = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    new_k, new_v = (torch.randn(B, H, 1, D, generator=gen) for _ in range(2))
    ns = {"model": model, "input_ids": input_ids, "k_seq": k_seq, "v_seq": v_seq, "new_k": new_k, "new_v": new_v}
    heads = [c.splitlines()[0] for c in chunks]
    assert heads == ["import torch", "# 1) Native: a first-class transformers 5.x Cache backend (any CausalLM)",
                     "#    int8 coefficients: same shape, 15× smaller archive (quant_bits=8)",
                     "# 2) One-line hot patch: every generate() defaults to the codec cache",
                     "# PNG lossless tier reproduces the unpatched model's tokens EXACTLY",
                     "# Materialization-free decode (coefficient-domain attention, no KV view):",
                     "# 3) Standalone (no transformers needed): direct cache manager"]
    imports, jpeg, jpeg_int8, hot_patch, remove, mat_free, standalone = chunks
    try:
        assert run(imports, ns) == []
        assert run(jpeg, ns) == []
        assert isinstance(ns["cache"], flashcodec_fx.FlashCodecCache)

        assert only_expected_warnings(run(jpeg_int8, ns))
        cache = ns["cache"]
        assert cache.get_seq_length() == input_ids.shape[1] + 63 and ns["out"].shape == reference.shape
        assert type(cache.storage_bytes()) is int and 0 < cache.storage_bytes()
        assert capsys.readouterr().out.split() == [str(input_ids.shape[1] + 63), str(cache.storage_bytes())]
        layer = cache.layers[0]
        assert (layer.keys_stream.codec.keep_freqs, layer.keys_stream.codec.quant_bits) == (2, 8)

        assert run(hot_patch, ns) == []
        assert torch.equal(ns["out"], reference)  # the claim of the next chunk's comment
        assert run(remove, ns) == []
        assert not hasattr(model, "_flashcodec_patch")
        assert torch.equal(model.generate(input_ids, max_new_tokens=64, do_sample=False), reference)

        assert run(mat_free, ns) == []
        assert model.config._attn_implementation == "kvcodec"
        out = model.generate(input_ids, max_new_tokens=8, do_sample=False)
        assert out.shape == (1, input_ids.shape[1] + 8)
    finally:
        if hasattr(model, "_flashcodec_patch"):
            flashcodec_fx.remove_flash_codec(model)
    assert model.config._attn_implementation == "sdpa"

    assert run(standalone, ns) == []
    k, v = ns["k"], ns["v"]
    assert k.shape == v.shape == (B, H, S + 1, D)
    archived = (S + 1) // 8 * 8
    assert torch.equal(k[:, :, archived:], torch.cat([k_seq, new_k], 2)[:, :, archived:])  # the open block stays raw
    assert torch.equal(v[:, :, archived:], torch.cat([v_seq, new_v], 2)[:, :, archived:])
    assert type(ns["cache"].storage_bytes()) is int


def test_transformers_integration_runs_unchanged():
    chunks = seed_sections()["transformers integration"]
    ns: dict = {"fresh_tiny_model": fresh_tiny_model, "tiny_prompt": tiny_prompt}
    load, patch = chunks
    assert run(load, ns) == []
    model = ns["model"]
    try:
        assert run(patch, ns) == []
        assert ns["out"].shape == (1, ns["ids"].shape[1] + 48)
    finally:
        flashcodec_fx.remove_flash_codec(model)
    # "FlashCodecCache.from_config(model.config) attaches codec layers only to full_attention layers"
    cache = flashcodec_fx.FlashCodecCache.from_config(model.config)
    full = [i for i, kind in enumerate(model.config.layer_types) if kind == "full_attention"]
    assert cache.codec_layers == full and len(full) < len(model.config.layer_types)


def test_stable_api_names_are_exported():
    names = [n.strip() for part in STABLE_API.split(",") for n in part.split("/")]
    assert len(names) == 11
    for name in names:
        assert callable(getattr(flashcodec_fx, name)), name


def test_per_layer_keep_freqs_and_quant_bits_options():
    model = fresh_tiny_model("llama")
    assert PER_LAYER.startswith("per_layer={idx: {\"keep_freqs\"")
    cache = flashcodec_fx.FlashCodecCache.from_config(model.config, mode="jpeg", quant_bits=8, per_layer={1: {"keep_freqs": 4}})
    codecs = [cache.layers[i].keys_stream.codec for i in range(2)]
    assert [(c.keep_freqs, c.quant_bits) for c in codecs] == [(8, 8), (4, 8)]
    out = model.generate(tiny_prompt(), max_new_tokens=4, do_sample=False, **{GENERATE_CACHE_KWARG: cache})
    assert out.shape[1] == tiny_prompt().shape[1] + 4 and cache.get_seq_length() == out.shape[1] - 1


def test_codec_decode_attention_on_streams_matches_the_materialized_view():
    from flashcodec_fx import CodecKVCache, JPEGCodec, PNGCodec, codec_decode_attention, make_codec

    gen = torch.Generator().manual_seed(3)
    k_seq, v_seq = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    q = torch.randn(B, 2 * H, 1, D, generator=gen)
    for codec in (JPEGCodec(block_size=8, keep_freqs=2), JPEGCodec(8, 2, quant_bits=8), PNGCodec(block_size=8),
                  make_codec("jpeg", block_size=8, keep_freqs=4)):
        cache = CodecKVCache(codec)
        k, v = cache.forward(k_seq, v_seq)
        key_stream, value_stream = cache.keys, cache.values
        out = codec_decode_attention(q, key_stream, value_stream)
        expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
