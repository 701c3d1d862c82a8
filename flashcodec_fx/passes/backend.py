"""The ``flashcodec`` torch.compile backend: Inductor with the SDPA-over-cache pass installed.

``torch.compile(model, backend="flashcodec")`` works after ``pip install`` with no import (entry point
``torch_dynamo_backends``); ``torch.compile(model, backend=flashcodec_fx.backend(strict=True))`` configures it.
``mode`` ("reduce-overhead": CUDA graphs, "max-autotune", ...) and ``options`` are honoured as with Inductor;
``options`` may also carry this backend's own keys ``strict`` and ``debug`` (handy from transformers'
``CompileConfig(backend="flashcodec", options={"strict": True})``; torch.compile takes a ``mode`` or ``options``, not
both: with a mode, configure the backend instead, ``CompileConfig(backend=flashcodec_fx.backend(strict=True),
mode="reduce-overhead")``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from .. import _compat
from .chain import post_grad_pre_pass
from .fuse_append import AppendAttentionFusion
from .sdpa_over_cache import SDPAOverCachePass

OWN_OPTIONS = ("strict", "debug", "inductor")


class FlashCodecBackend:
    """A configured backend (callable as a torch.compile backend). ``pass_`` is the installed
    :class:`SDPAOverCachePass`; its ``reports`` say what each compiled graph got. ``fusion``, the
    :class:`AppendAttentionFusion` that runs after it (a decode step's appends and attention as one op)."""

    def __init__(self, strict: bool = False, debug: bool | str | os.PathLike | None = None, inductor: bool = True,
                 mode: str | None = None, options: dict | None = None):
        if options is not None and not isinstance(options, dict):
            raise TypeError(f"options must be a dict of Inductor config values, got {type(options).__name__}")
        if mode is not None and not isinstance(mode, str):
            raise TypeError(f"mode must be a torch.compile mode string, got {type(mode).__name__}")
        if not isinstance(inductor, bool):
            raise TypeError(f"inductor must be a bool, got {type(inductor).__name__}")
        self.pass_ = SDPAOverCachePass(strict=strict, debug=debug)
        self.fusion = AppendAttentionFusion()
        self.inductor = inductor
        self.mode, self.options = mode, dict(options or {})
        self.__name__ = "flashcodec"

    def config_patches(self, mode: str | None = None, options: dict | None = None) -> dict:
        """Inductor config for one compile: the mode's options, then ``options``, then this backend's passes prepended
        to any ``post_grad_custom_pre_pass`` already configured."""
        mode = mode or self.mode
        patches = dict(_compat.list_mode_options(mode)) if mode and mode != "default" else {}
        patches.update(self.options)
        patches.update(options or {})
        user = patches.get("post_grad_custom_pre_pass", _compat.inductor_config.post_grad_custom_pre_pass)
        user = [] if user is None else list(user) if isinstance(user, (list, tuple)) else [user]
        own = (self.pass_, self.fusion)
        patches["post_grad_custom_pre_pass"] = post_grad_pre_pass([*own, *(p for p in user if p not in own)])
        return patches

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], mode: str | None = None,
                 options: dict | None = None) -> Callable:
        options = dict(options or {})
        own = {key: options.pop(key) for key in OWN_OPTIONS if key in options}
        mine = {"strict": self.pass_.strict, "debug": self.pass_.debug, "inductor": self.inductor}
        target = self if not own else FlashCodecBackend(**{**mine, **own}, mode=self.mode, options=self.options)
        if not target.inductor:
            return target._pass_only(gm, example_inputs)
        return _compat.compile_fx(gm, example_inputs, config_patches=target.config_patches(mode, options))

    def _pass_only(self, gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> Callable:
        """AOTAutograd with Inductor's decompositions, this pass on the functionalized graph, then eager execution:
        the same graph the Inductor path rewrites, without code generation (fast; for checks and debugging)."""
        def run_pass(graph_module: torch.fx.GraphModule, _inputs) -> Callable:
            self.pass_(graph_module.graph)
            self.fusion(graph_module.graph)
            graph_module.graph.lint()
            graph_module.recompile()
            return graph_module

        return _compat.aot_autograd(fw_compiler=run_pass, decompositions=_compat.select_decomp_table())(gm, example_inputs)

    def __deepcopy__(self, memo: dict) -> FlashCodecBackend:
        """Shared, not copied (transformers deep-copies generation configs): ``pass_.reports`` stay observable."""
        return self


def backend(strict: bool = False, debug: bool | str | os.PathLike | None = None, inductor: bool = True,
            mode: str | None = None, options: dict | None = None) -> FlashCodecBackend:
    """A configured ``flashcodec`` backend: ``torch.compile(model, backend=flashcodec_fx.backend(strict=True))``.

    ``strict``: raise if any decoded KV view remains in a compiled graph (materialization-free guarantee).
    ``debug``: dump each graph before/after the pass (True: log; a path: files there).
    ``inductor=False``: run the pass on the AOT (functionalized, Inductor-decomposed) graph and execute it eagerly,
    without code generation (quick checks). ``mode``/``options``:
    Inductor's, as for ``torch.compile(backend="inductor")``.
    """
    return FlashCodecBackend(strict=strict, debug=debug, inductor=inductor, mode=mode, options=options)


flashcodec_backend = FlashCodecBackend()
"""The default backend, registered as ``"flashcodec"`` (entry point and ``register_backend``)."""
