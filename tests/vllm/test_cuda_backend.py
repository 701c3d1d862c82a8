"""The CUDA backend (``flashcodec_fx/vllm/cuda_backend.py``) without a GPU: registered and selected as ``CUSTOM`` on a
faked CUDA platform, the CPU backend's pages, vLLM's CUDA checks of a selected backend, and the impl storing and
attending on a paged batch through the Triton kernels on CPU tensors (``TRITON_INTERPRET=1``). With a GPU and
vLLM's CUDA build: SmolLM2 in vLLM's engine on ``CUSTOM`` against stock vLLM (skipped here, and in the GPU image,
which has no vLLM)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

# vllm.version, not vllm: pytest puts tests/ on sys.path, where this folder is a namespace package named vllm
pytest.importorskip("vllm.version", reason="needs vLLM: run it in the vLLM venv (docs/vllm.md)")

import torch  # noqa: E402
from vllm.config import CUDAGraphMode  # noqa: E402
from vllm.forward_context import ForwardContext, override_forward_context  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backend import AttentionCGSupport, CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheLayout, SlidingWindowSpec  # noqa: E402

import flashcodec_fx.vllm as plugin  # noqa: E402
from flashcodec_fx.vllm import kernels  # noqa: E402
from flashcodec_fx.vllm.backend_base import check_engine, plugin_config  # noqa: E402
from flashcodec_fx.vllm.config import ENV_NAMES, ENV_PRESET  # noqa: E402
from flashcodec_fx.vllm.cpu_backend import FlashCodecCPUBackend  # noqa: E402
from flashcodec_fx.vllm.cuda_backend import (  # noqa: E402
    FlashCodecCUDABackend,
    FlashCodecCUDAImpl,
    FlashCodecCUDAMetadataBuilder,
)

FULL = AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=None)
SM90 = DeviceCapability(9, 0)


@pytest.fixture
def preset(monkeypatch):
    """``FLASHCODEC_VLLM_PRESET=4bit`` in this process, its configuration read afresh."""
    monkeypatch.setenv(ENV_PRESET, "4bit")
    plugin_config.cache_clear()
    yield "4bit"
    plugin_config.cache_clear()


@pytest.fixture
def cuda_platform(monkeypatch, preset):
    """vLLM's platform object claiming CUDA, its backend choice recorded (the backend it was asked for, returned as
    that backend's class path); the plugin unregistered before, ``CUSTOM`` cleared after."""
    asked = []

    def get_attn_backend_cls(selected_backend, attn_selector_config, num_heads=None):
        asked.append(selected_backend)
        return None if selected_backend is None else selected_backend.get_path()

    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "get_attn_backend_cls", get_attn_backend_cls)
    monkeypatch.setattr(plugin, "_registered", False)
    yield asked
    AttentionBackendEnum.CUSTOM.clear_override()


def test_register_on_cuda_makes_the_backend_custom_and_selects_it(cuda_platform):
    plugin.register()
    plugin.register()  # idempotent: one registration, the selection wrapped once
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.CUDA_BACKEND_PATH
    backend = AttentionBackendEnum.CUSTOM.get_class()
    assert backend is FlashCodecCUDABackend
    assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM  # how vLLM maps a layer back

    custom, triton = AttentionBackendEnum.CUSTOM, AttentionBackendEnum.TRITON_ATTN
    assert current_platform.get_attn_backend_cls(None, FULL) == plugin.CUDA_BACKEND_PATH  # chosen by the plugin
    assert current_platform.get_attn_backend_cls(custom, FULL) == plugin.CUDA_BACKEND_PATH  # chosen by the user
    assert cuda_platform == [custom, custom]
    with pytest.raises(ValueError, match="attention_backend=TRITON_ATTN: flashcodec pages need the CUSTOM backend"):
        current_platform.get_attn_backend_cls(triton, FULL)
    sliding = FULL._replace(has_sliding_window=True)  # a layer the pages do not serve: the user's choice stands
    assert current_platform.get_attn_backend_cls(triton, sliding) == triton.get_path()
    assert current_platform.get_attn_backend_cls(None, FULL._replace(use_mla=True)) is None  # MLA: vLLM's own pick
    assert cuda_platform == [custom, custom, triton, None]


def test_other_platforms_are_refused(cuda_platform, monkeypatch):
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)
    with pytest.raises(ValueError, match="serves vLLM's CPU and CUDA platforms only"):
        plugin.register()


def test_cuda_accepts_the_backend_for_a_plain_decoder_at_sm90():
    """What vLLM's CUDA platform checks of a selected backend (``validate_configuration`` with the layer's selector
    config): nothing to refuse for SmolLM2's layers; refused: quantized KV dtypes, pages over the Triton kernels'
    128 tokens, non-causal and multimodal-prefix attention. Pages head-major; no full CUDA graphs."""
    assert FlashCodecCUDABackend.validate_configuration(device_capability=SM90, **FULL._asdict()) == []
    assert FlashCodecCUDABackend.validate_configuration(device_capability=SM90, **FULL._replace(
        block_size=128, has_sink=True)._asdict()) == []
    refused = {"kv_cache_dtype not supported": FULL._replace(kv_cache_dtype="fp8"),
               "block_size not supported": FULL._replace(block_size=256),
               "non-causal attention not supported": FULL._replace(use_non_causal=True),
               "partial multimodal token full attention not supported": FULL._replace(use_mm_prefix=True)}
    for reason, config in refused.items():
        assert reason in FlashCodecCUDABackend.validate_configuration(device_capability=SM90, **config._asdict())
    assert FlashCodecCUDABackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert FlashCodecCUDAMetadataBuilder.get_cudagraph_support(None, None) == AttentionCGSupport.NEVER


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_same_pages_as_the_cpu_backend(preset, dtype, block_size):
    full = FullAttentionSpec(block_size=block_size, num_kv_heads=3, head_size=64, dtype=dtype)
    pages = FlashCodecCUDABackend.customize_spec(full)
    assert pages == FlashCodecCPUBackend.customize_spec(full)
    assert pages.dtype == torch.uint8 and pages.state_content_bytes == plugin_config().state_content_bytes(
        64, dtype, block_size)
    sliding = SlidingWindowSpec(block_size=block_size, num_kv_heads=3, head_size=64, dtype=dtype, sliding_window=512)
    assert FlashCodecCUDABackend.customize_spec(sliding) is sliding


def _impl(heads: int = 2, group: int = 2, head_dim: int = 16, **kwargs) -> FlashCodecCUDAImpl:
    args = {"alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto", **kwargs}
    return FlashCodecCUDAImpl(heads * group, head_dim, head_dim**-0.5, heads, **args)


def _builder(spec: FullAttentionSpec, query_heads: int) -> FlashCodecCUDAMetadataBuilder:
    """vLLM's Triton metadata builder (our subclass) on the little of a VllmConfig it reads."""
    model = SimpleNamespace(get_num_attention_heads=lambda parallel: query_heads,
                            get_num_kv_heads=lambda parallel: spec.num_kv_heads, get_head_size=lambda: spec.head_size,
                            rswa_window=None)
    config = SimpleNamespace(model_config=model, parallel_config=None, scheduler_config=None,
                             compilation_config=SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE,
                                                                static_forward_context={}))
    return FlashCodecCUDAMetadataBuilder(spec, ["model.layers.5.self_attn.attn"], config, torch.device("cpu"))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels run on CPU tensors under TRITON_INTERPRET=1 only")
def test_impl_stores_and_attends_through_the_triton_kernels(preset, monkeypatch):
    """Two requests in one call, GQA (2 KV heads, 4 query heads), sinks, q/k/v strided views of one qkv buffer and
    padding rows as vLLM passes them: a decode step after 37 tokens and a 9-token prefill chunk after 20. The
    metadata from vLLM's Triton builder, read by the store from vLLM's forward context; the impl's store leaves the
    reference's bytes; its attention (through the block table) matches ``attention_reference`` within
    test_triton_kernels.py's tolerance, then its ring phase leaves the reference's bytes again; rows past the call's
    tokens untouched. All through the Triton kernels (counted), none other."""
    from _paged_cases import make_batch
    from test_triton_kernels import TOLERANCE

    from flashcodec_fx.vllm import triton as paged_triton
    from flashcodec_fx.vllm.reference import attention_reference, store_reference

    monkeypatch.setattr(kernels, "TRITON_DEVICE", "cpu")
    monkeypatch.setenv("FLASHCODEC_KERNELS", "fast")  # the Triton kernels or an error, never the reference
    calls = []

    def counting(name: str):
        kernel = getattr(paged_triton, name)

        def counted(*args):
            calls.append(name)
            return kernel(*args)

        return counted

    for name in ("triton_paged_store", "triton_paged_attention"):
        monkeypatch.setattr(paged_triton, name, counting(name))

    heads, group, d, bs, seed, pad = 2, 2, 16, 16, 5, 2  # seed 5: layer 5's rotation (make_batch: seed % 30)
    batch = make_batch({"format": preset, "dtype": torch.float16, "heads": heads, "group": group, "head_dim": d,
                        "block_size": bs, "anchors": None, "contexts": [37, 20], "queries": [1, 9], "padding": pad,
                        "seed": seed})
    spec = FlashCodecCUDABackend.customize_spec(FullAttentionSpec(block_size=bs, num_kv_heads=heads, head_size=d,
                                                                  dtype=torch.float16))
    assert spec.state_content_bytes == batch.fmt.state_content_bytes(bs)
    n = batch.query.shape[0]
    starts, lens = batch.query_start_loc, batch.seq_lens
    metadata = _builder(spec, heads * group).build(0, CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=lens, num_reqs=2, num_actual_tokens=n,
        max_query_len=9, max_seq_len=int(lens.max()), block_table_tensor=batch.block_table,
        slot_mapping=batch.slot_mapping))

    query = torch.cat([batch.query, torch.randn(pad, heads * group, d).half()])
    qkv = torch.cat([query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
    q, k, v = (x.unflatten(1, (-1, d)) for x in qkv.split([heads * group * d, heads * d, heads * d], dim=1))
    sinks = torch.linspace(-1, 2, heads * group)
    impl = _impl(heads, group, d, sinks=sinks)
    cache = batch.empty_cache(seed)
    history = batch.history_call()
    for phase in ("store", "ring"):
        store_reference(batch.fmt, *batch.store_args(cache, history), phase)
    layer = SimpleNamespace(layer_name="model.layers.5.self_attn.attn", kv_cache=cache)
    context = ForwardContext(no_compile_layers={layer.layer_name: layer}, attn_metadata={layer.layer_name: metadata},
                             slot_mapping={layer.layer_name: metadata.slot_mapping})
    stored = batch.filled_cache(seed)
    ref = attention_reference(batch.fmt, *batch.attention_args(stored), impl.scale, sinks)
    store_reference(batch.fmt, *batch.store_args(stored), "ring")
    output = torch.full((n + pad, heads * group, d), float("nan"), dtype=torch.float16)
    with override_forward_context(context):
        impl.do_kv_cache_update(layer, k, v, cache, metadata.slot_mapping)
        assert impl._format == batch.fmt and torch.equal(cache, batch.filled_cache(seed))
        assert impl.forward(layer, q, k, v, cache, metadata, output) is output
    torch.testing.assert_close(output[:n].float(), ref.float(), **TOLERANCE[torch.float16])
    assert output[n:].isnan().all()
    assert torch.equal(cache, stored)  # and the call's newest tokens in their rings, after attention
    assert calls == ["triton_paged_store", "triton_paged_attention", "triton_paged_store"]


def test_speculative_decoding_is_refused_where_pages_keep_rings(preset, monkeypatch):
    """A ring written for draft tokens the verifier rejects would hold them: refused at the builder (both
    platforms'), unless the pages keep no raw rows."""
    model = SimpleNamespace(get_head_size=lambda: 64, dtype=torch.bfloat16)
    config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(block_size=128),
                             speculative_config=SimpleNamespace(method="ngram"))
    with pytest.raises(ValueError, match="speculative decoding"):
        check_engine(config)
    check_engine(SimpleNamespace(**{**vars(config), "speculative_config": None}))
    monkeypatch.setenv("FLASHCODEC_VLLM_ANCHORS", "0")
    plugin_config.cache_clear()
    check_engine(config)


def test_impl_refuses_what_the_pages_do_not_implement(preset):
    with pytest.raises(ValueError, match="ALiBi"):
        _impl(alibi_slopes=[0.5] * 4)
    with pytest.raises(ValueError, match="soft-caps"):
        _impl(logits_soft_cap=30.0)
    _impl(alibi_slopes=[0.5] * 4, sliding_window=64)  # a sliding-window layer runs vLLM's attention: no refusal
    impl = _impl()
    assert not impl.fused_output_quant_supported(None) and not impl.fused_rope_kvcache_supported()
    assert not impl.supports_quant_query_input
    cache = torch.zeros(4, 2, 16, plugin_config().state_content_bytes(16, torch.float16, 16), dtype=torch.uint8)
    x = torch.zeros(1, 4, 16, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(SimpleNamespace(layer_name="model.layers.0.self_attn.attn"), x, x[:, :2], x[:, :2], cache,
                     SimpleNamespace(), torch.empty_like(x), output_scale=torch.ones(1))


def test_stock_pages_and_the_profiling_run_go_to_vllms_triton_attention(preset, monkeypatch):
    """A layer on vLLM's own (fp16) pages: store and attention are the Triton impl's; vLLM's profiling run (no
    metadata) too, which zeroes the output."""
    seen = []
    monkeypatch.setattr(TritonAttentionImpl, "do_kv_cache_update", lambda self, *args: seen.append("store"))
    impl = _impl()
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn")
    x = torch.randn(3, 4, 16, dtype=torch.float16)
    stock_cache = torch.zeros(4, 2, 16, 32, dtype=torch.float16)
    impl.do_kv_cache_update(layer, x[:, :2], x[:, :2], stock_cache, torch.arange(3))
    output = torch.full_like(x, float("nan"))
    assert impl.forward(layer, x, x[:, :2], x[:, :2], stock_cache, None, output) is output
    assert seen == ["store"] and torch.equal(output, torch.zeros_like(x))
    monkeypatch.setattr(TritonAttentionImpl, "forward", lambda self, *args: seen.append("attention"))
    impl.forward(layer, x, x[:, :2], x[:, :2], stock_cache, SimpleNamespace(), output)
    assert seen == ["store", "attention"] and impl._format is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build (pip install vllm)")
def test_cuda_engine_int8_greedy_tokens_match_stock():
    """SmolLM2 in vLLM's offline engine on the GPU (eager): ``attention_backend="CUSTOM"`` with int8 pages (the
    Triton kernels, ``FLASHCODEC_KERNELS=fast``: no fallback) against stock vLLM's own backend choice: greedy tokens
    equal except after a near tie of stock's top two (as tests/vllm/test_engine.py on CPU), and vLLM allocated about
    256 / 132 as many KV tokens (int8's 132-byte slots against stock's 256 at D = 64, bf16: the pages are ours)."""
    from test_engine import PROMPTS, TOKENS, assert_same_until_a_near_tie
    from vllm_engine import run_job

    from flashcodec_fx.pretrained import model_folder

    env = {k: v for k, v in os.environ.items() if k not in (*ENV_NAMES, "TRITON_INTERPRET", "FLASHCODEC_KERNELS")}
    llm = {"block_size": 32, "max_model_len": 448, "gpu_memory_utilization": 0.3}
    job = {"model": str(model_folder()), "llm": llm, "greedy": PROMPTS, "tokens": TOKENS}
    stock = run_job(job, env, timeout=900)
    ours = run_job({**job, "llm": {**llm, "attention_backend": "CUSTOM"}},
                   {**env, ENV_PRESET: "int8", "FLASHCODEC_KERNELS": "fast"}, timeout=900)
    agree = [assert_same_until_a_near_tie(o, s) for o, s in zip(ours["greedy"], stock["greedy"], strict=True)]
    assert sum(agree) >= TOKENS
    assert ours["blocks"] > 1.8 * stock["blocks"]
