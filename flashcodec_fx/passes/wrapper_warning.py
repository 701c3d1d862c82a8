"""A warning when ``torch.compile(model, backend="flashcodec")`` wraps a transformers model: its ``generate()``
would run the uncompiled model (the wrapper compiles only calls of the wrapper itself; ``generate`` calls the
original module, on the model and on the wrapper alike, so nothing is compiled and nothing says so).

Installed with the backend (importing :mod:`flashcodec_fx.passes`, which the ``torch_dynamo_backends`` entry point
does on the first ``torch.compile(..., backend="flashcodec")``): a module-registration hook sees the wrapper adopt
the model, and warns once per model, saying what to do instead.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import Any

import torch

from .. import _compat

ADVICE = ("torch.compile(model, backend='flashcodec') compiles calls of the returned wrapper only: model.generate() "
          "(on the model or on the wrapper) runs the uncompiled forward. To decode compiled, use "
          "flashcodec_fx.apply_flash_codec(model, ..., compile=True), or compile the forward in place: "
          "model.forward = torch.compile(model.forward, backend='flashcodec') with a static, unmemoized "
          "FlashCodecCache (see docs/compile.md)")


class CompiledGenerateWarning(UserWarning):
    """``generate()`` of a model wrapped by ``torch.compile(model, backend="flashcodec")`` would not be compiled."""


_warned: weakref.WeakSet = weakref.WeakSet()
_handle: Any = None


def _is_generative(module: Any) -> bool:
    return isinstance(module, torch.nn.Module) and callable(getattr(module, "generate", None)) \
        and hasattr(module, _compat.PREPARE_CACHE_METHOD)


def _stacklevel_of_caller() -> int:
    """``stacklevel`` pointing at the first frame outside torch and this module: the ``torch.compile`` call."""
    internal = (os.path.dirname(torch.__file__), __file__)
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(internal):
        frame, level = frame.f_back, level + 1
    return level


def _on_register(module: torch.nn.Module, name: str, submodule: Any) -> None:
    if name != "_orig_mod" or not isinstance(module, _compat.OptimizedModule) or not _is_generative(submodule) \
            or submodule in _warned:
        return
    from .backend import FlashCodecBackend

    if isinstance(_compat.compiled_wrapper_backend(module), FlashCodecBackend):
        _warned.add(submodule)
        warnings.warn(ADVICE, CompiledGenerateWarning, stacklevel=_stacklevel_of_caller())


def install() -> None:
    """Register the hook once (idempotent)."""
    global _handle
    if _handle is None:
        _handle = torch.nn.modules.module.register_module_module_registration_hook(_on_register)
