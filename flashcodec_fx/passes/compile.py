"""``compile_model``: torch.compile with the ``flashcodec`` backend and the options decode wants."""

from __future__ import annotations

import os

import torch

from .backend import backend


def compile_model(model: torch.nn.Module, *, strict: bool = False, debug: bool | str | os.PathLike | None = None,
                  mode: str | None = None, options: dict | None = None, fullgraph: bool = True,
                  dynamic: bool | None = None) -> torch.nn.Module:
    """``torch.compile(model, backend=flashcodec_fx.backend(strict, debug), mode, options, fullgraph, dynamic)``.

    The model must use a codec cache with the static layout and ``memoize=False`` for attention to run on the
    stored state (``strict=True`` turns anything else into an error at compile time). Returns the compiled module.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return torch.compile(model, backend=backend(strict=strict, debug=debug, options=options), mode=mode,
                         fullgraph=fullgraph, dynamic=dynamic)
