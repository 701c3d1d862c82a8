"""torch.compile support: the SDPA-over-cache graph pass and the ``flashcodec`` backend.

Importing registers the backend name ``"flashcodec"`` with Dynamo (the ``torch_dynamo_backends`` entry point
does the same for installed packages without an import), and the :class:`CompiledGenerateWarning` hook
(``torch.compile(hf_model, backend="flashcodec")`` would not compile ``generate()``: see ``wrapper_warning``).
"""

from __future__ import annotations

from importlib.metadata import entry_points

from .. import _compat
from .backend import FlashCodecBackend, backend, flashcodec_backend
from .compile import compile_model
from .sdpa_over_cache import MaterializationError, PassReport, SDPAOverCachePass
from .wrapper_warning import CompiledGenerateWarning, install

if "flashcodec" not in _compat.COMPILER_FNS and "flashcodec" not in entry_points(group="torch_dynamo_backends").names:
    _compat.register_backend(flashcodec_backend, name="flashcodec")  # not installed: the entry point cannot do it
install()

__all__ = ["CompiledGenerateWarning", "FlashCodecBackend", "MaterializationError", "PassReport", "SDPAOverCachePass", "backend",
           "compile_model", "flashcodec_backend"]
