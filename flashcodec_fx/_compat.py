"""Version gates: the oldest torch / transformers / triton flashcodec_fx runs with, and every private API it uses.

Floors are what the code was run with (torch 2.11 .. 2.13, transformers 5.17 .. 5.25, triton 3.6 .. 3.9); an older
install fails on import with the version found and the pip command that fixes it. transformers also has a newest
tested release (``TRANSFORMERS_TESTED``, the "tested newest" policy: no upper pin, a warning past it). Every private
torch API of the package is reached through this module (``PRIVATE``: name -> module, imported on first use), so a
release that moves one breaks here, in one place. Private transformers attributes the integration relies on (all
present in 5.17 .. 5.25) are named here too, with the one behaviour that differs by version: the cache keyword of
``generate()`` (``past_key_values=`` until 5.23, ``cache=`` from 5.24, which deprecates the old name).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch

TORCH_FLOOR = (2, 11)
TRANSFORMERS_TESTED = ((5, 17), (5, 25))
"""The oldest and the newest transformers minor releases the test suite passes on (CI runs both ends). Policy, "tested
newest": pyproject sets the floor only (an upper pin lags behind every release and blocks its fixes); a newer release
installs, and the integration warns (:class:`UntestedTransformersWarning`, once per process) and ``flashcodec info``
prints a WARNING line until the suite has passed on it and this range is moved up. Older than the floor: ImportError
(``require_transformers``)."""
TRANSFORMERS_FLOOR = TRANSFORMERS_TESTED[0]
TRITON_FLOOR = (3, 6)
CACHE_KEYWORD_SINCE = (5, 24)  # transformers: generate(cache=...); past_key_values= warns (FutureWarning)


def version_tuple(text: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``."""
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        raise ValueError(f"not a version string: {text!r}")
    return int(found.group(1)), int(found.group(2))


def installed(dist: str) -> tuple[int, int] | None:
    """``(major, minor)`` of an installed distribution (read from its metadata, not imported), None when absent."""
    try:
        return version_tuple(importlib.metadata.version(dist))
    except importlib.metadata.PackageNotFoundError:
        return None


def _floor_text(floor: tuple[int, int]) -> str:
    return ".".join(map(str, floor))


def require(dist: str, have: tuple[int, int] | None, floor: tuple[int, int]) -> None:
    """ImportError when ``dist`` is installed below ``floor`` (None: absent, nothing to check)."""
    if have is not None and have < floor:
        raise ImportError(f"flashcodec_fx needs {dist} >= {_floor_text(floor)}, found {_floor_text(have)}: "
                          f"pip install '{dist}>={_floor_text(floor)}'")


TORCH = version_tuple(torch.__version__)
TRANSFORMERS = installed("transformers")
TRITON = installed("triton")
require("torch", TORCH, TORCH_FLOOR)

GENERATE_CACHE_KWARG = "cache" if TRANSFORMERS is not None and TRANSFORMERS >= CACHE_KEYWORD_SINCE else \
    "past_key_values"
"""The keyword ``model.generate`` / ``model(...)`` take the cache by on the installed transformers."""


def require_transformers() -> None:
    """Called by :mod:`flashcodec_fx.hf` before it imports transformers."""
    require("transformers", TRANSFORMERS, TRANSFORMERS_FLOOR)


class UntestedTransformersWarning(UserWarning):
    """The installed transformers is outside the releases flashcodec_fx is tested with (``TRANSFORMERS_TESTED``)."""


def transformers_untested(have: tuple[int, int] | None) -> str | None:
    """What is wrong when transformers ``have`` (major, minor) is outside ``TRANSFORMERS_TESTED`` (None: inside, or
    not installed): the version, the tested range and the pip command back into it."""
    oldest, newest = TRANSFORMERS_TESTED
    if have is None or oldest <= have <= newest:
        return None
    tested = f"tested {_floor_text(oldest)} .. {_floor_text(newest)}"
    if have < oldest:
        return (f"transformers {_floor_text(have)} is older than flashcodec_fx supports ({tested}): "
                f"pip install 'transformers>={_floor_text(oldest)}'")
    return (f"transformers {_floor_text(have)} is newer than the newest release flashcodec_fx is tested with ({tested}); "
            f"the cache API changes between releases, so it may fail: pip install "
            f"'transformers>={_floor_text(oldest)},<{newest[0]}.{newest[1] + 1}' for a tested one")


_warned_untested: set[tuple[int, int]] = set()


def warn_untested_transformers(stacklevel: int = 3) -> None:
    """Warn (:class:`UntestedTransformersWarning`, once per process) when the installed transformers is untested;
    called where the integration is first used (``FlashCodecCache``, ``apply_flash_codec``, ``compress_kv``), not on
    import. ``stacklevel`` 3: the caller of the function that calls this."""
    message = transformers_untested(TRANSFORMERS)
    if message is not None and TRANSFORMERS not in _warned_untested:
        _warned_untested.add(TRANSFORMERS)
        warnings.warn(message, UntestedTransformersWarning, stacklevel=stacklevel)


# Private torch APIs (present and unchanged in torch 2.11 .. 2.13): name -> (module, attribute).
PRIVATE = {
    "mark_static_address": ("torch._dynamo", "mark_static_address"),
    "mark_static": ("torch._dynamo", "mark_static"),
    "COMPILER_FNS": ("torch._dynamo.backends.registry", "_COMPILER_FNS"),
    "register_backend": ("torch._dynamo.backends.registry", "register_backend"),
    "aot_autograd": ("torch._dynamo.backends.common", "aot_autograd"),
    "detect_fake_mode": ("torch._guards", "detect_fake_mode"),
    "inductor_config": ("torch._inductor", "config"),
    "list_mode_options": ("torch._inductor", "list_mode_options"),
    "compile_fx": ("torch._inductor.compile_fx", "compile_fx"),
    "select_decomp_table": ("torch._inductor.decomposition", "select_decomp_table"),
    "CustomGraphPass": ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    "get_hash_for_files": ("torch._inductor.custom_graph_pass", "get_hash_for_files"),
    "OptimizedModule": ("torch._dynamo.eval_frame", "OptimizedModule"),
    "innermost_backend": ("torch._dynamo.eval_frame", "innermost_backend"),
    # torch.compiler.disable that imports Dynamo (seconds) on the first call, not when applied: what torch's own
    # lazily disabled functions (the custom ops' kernels among them) use
    "disable_dynamo": ("torch", "_disable_dynamo"),
}

# Private transformers names the integration uses (present in 5.17 .. 5.25).
PREPARE_CACHE_METHOD = "_prepare_cache_for_generation"  # GenerationMixin: builds the cache of one generate() call


def inductor_takes_pass_lists() -> bool:
    """Inductor's ``post_grad_custom_pre_pass`` takes a list of passes (torch 2.13's ``get_custom_graph_passes``);
    torch 2.11 takes one pass (``passes/chain.py`` chains ours with the user's there)."""
    return hasattr(importlib.import_module("torch._inductor.custom_graph_pass"), "get_custom_graph_passes")


def layer_types_and_kwargs(config: Any) -> tuple[list[str], list[dict]]:
    """Per layer of a transformers config's text decoder: its cache layer type and the kwargs its cache layer is built
    with (``get_layer_types_and_kwargs``: one kwargs dict shared by all layers before 5.2x, one per layer since)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types, kwargs = get_layer_types_and_kwargs(text)
    if isinstance(kwargs, dict):
        kwargs = [kwargs] * len(layer_types)
    return list(layer_types), list(kwargs)


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers config selects (``config._attn_implementation``)."""
    return getattr(config, "_attn_implementation", None)


def is_user_defined_cache(cache: Any) -> bool:
    """Whether generate() was handed this cache by its caller (``Cache._is_user_defined``)."""
    return bool(getattr(cache, "_is_user_defined", False))


def compile_on_every_device(compile_config: Any) -> None:
    """Let generate() compile on CPU too (``CompileConfig._compile_all_devices``; accelerators only otherwise)."""
    compile_config._compile_all_devices = True


def custom_op_kernels(qualname: str) -> dict[str | None, Callable]:
    """Kernels registered for the ``torch.library.custom_op`` ``qualname``, by device type (None: the default kernel),
    as their authors wrote them: torch keeps each one wrapped twice (``CustomOpDef._backend_fns``: a dynamo-disabling
    ``functools.wraps`` wrapper around a closure over ``fn``; torch 2.11 .. 2.13)."""
    opdef = importlib.import_module("torch._library.custom_ops").OPDEFS[qualname]
    kernels: dict[str | None, Callable] = {None: opdef._init_fn}
    for device, fn in opdef._backend_fns.items():
        fn = getattr(fn, "__wrapped__", fn)
        kernels[device] = inspect.getclosurevars(fn).nonlocals.get("fn", fn)
    return kernels


def compiled_wrapper_backend(wrapper: Any) -> Any:
    """The backend a ``torch.compile`` module wrapper (an ``OptimizedModule`` being built) compiles with: the
    ``_TorchCompileWrapper``'s ``compiler_fn`` (or the backend itself), found in ``OptimizedModule.__init__``'s
    ``dynamo_ctx`` argument on the call stack (the wrapper adopts the module before it stores that context); None
    when not found."""
    frame = inspect.currentframe()
    while frame is not None and not (frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is wrapper):
        frame = frame.f_back
    context = None if frame is None else frame.f_locals.get("dynamo_ctx")
    if context is None:
        return None
    backend = __getattr__("innermost_backend")(context.callback)
    return getattr(backend, "compiler_fn", backend)


def __getattr__(name: str) -> Any:
    if name in PRIVATE:
        module, attribute = PRIVATE[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'flashcodec_fx._compat' has no attribute {name!r}")
