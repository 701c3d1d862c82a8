"""``compile=`` for ``apply_flash_codec`` / ``compress_kv``: generate() decodes through the flashcodec backend.

``compile=True`` (or a dict of :func:`flashcodec_fx.backend` options plus ``mode`` / ``dynamic``) makes the codec
cache static and unmemoized (what a compiled decode step reads) and, on every ``generate()`` call that brings no
``compile_config`` of its own, compiles the decode step with ``backend=flashcodec_fx.backend(...)``,
``fullgraph=True``, ``dynamic=False`` (a static cache's decode step has fixed shapes; each codec compiles its own
static graph, and a recompile for another codec never turns sizes symbolic), on every device (transformers
auto-compiles only on accelerators otherwise).
"""

from __future__ import annotations

from typing import Any

from .._compat import compile_on_every_device

BACKEND_KEYS = ("strict", "debug", "inductor", "options")
COMPILE_KEYS = (*BACKEND_KEYS, "mode", "dynamic")


def check_compile(compile_option: Any, cache_options: dict[str, Any]) -> dict[str, Any] | None:
    """Validate ``compile`` against the cache options; returns the settings (the configured ``backend``, ``mode``,
    ``dynamic``; None when off). Adjusts
    ``cache_options`` in place: ``layout="static"`` and ``memoize=False`` unless given (other values raise)."""
    if compile_option is False or compile_option is None:
        return None
    if compile_option is True:
        settings: dict[str, Any] = {}
    elif isinstance(compile_option, dict):
        unknown = sorted(set(compile_option) - set(COMPILE_KEYS))
        if unknown:
            raise ValueError(f"compile: unknown option(s) {unknown}; allowed: {list(COMPILE_KEYS)}")
        settings = dict(compile_option)
    else:
        raise TypeError(f"compile must be a bool or a dict of options {list(COMPILE_KEYS)}, got "
                        f"{type(compile_option).__name__}")
    if cache_options.setdefault("layout", "static") != "static":
        raise ValueError(f"compile=True needs layout='static' (a compiled decode step has fixed shapes), got "
                         f"layout={cache_options['layout']!r}")
    if cache_options.setdefault("memoize", False):
        raise ValueError("compile=True needs memoize=False: compiled steps attend on the stored state and never read "
                         "the memo, which would only cost memory")
    backend_options = {k: v for k, v in settings.items() if k in BACKEND_KEYS}
    return {"backend": shared_backend(backend_options),
            "mode": settings.get("mode"), "dynamic": settings.get("dynamic", False)}


_backends: dict[str, Any] = {}


def shared_backend(options: dict[str, Any]) -> Any:
    """The one :func:`flashcodec_fx.backend` configured with ``options`` (validated on first use). Dynamo keys its
    compiled code by backend object: sharing it, a codec applied again (after ``remove_flash_codec`` or another
    preset) finds its compiled decode step instead of compiling a new entry toward the recompile limit."""
    from ..passes.backend import backend

    key = repr(sorted(options.items()))
    if key not in _backends:
        _backends[key] = backend(**options)
    return _backends[key]


def install_compile_config(generation_config: Any, settings: dict[str, Any] | None) -> None:
    """Give this generate() call a compile config with the flashcodec backend, unless the caller brought one."""
    if settings is None or generation_config is None or getattr(generation_config, "compile_config", None) is not None:
        return
    from transformers import CompileConfig

    config = CompileConfig(backend=settings["backend"], fullgraph=True, mode=settings["mode"],
                           dynamic=settings["dynamic"])
    compile_on_every_device(config)
    generation_config.compile_config = config


def forget_compiled_call(model: Any) -> None:
    """Drop the compiled ``__call__`` that transformers keeps on ``model`` when it was compiled with a flashcodec
    backend (``remove_flash_codec``): the model holds no compiled wrapper of the codec afterwards."""
    from ..passes.backend import FlashCodecBackend

    config = vars(model).get("_last_compile_config")
    if isinstance(getattr(config, "backend", None), FlashCodecBackend):
        for name in ("_compiled_call", "_last_compile_config"):
            vars(model).pop(name, None)
