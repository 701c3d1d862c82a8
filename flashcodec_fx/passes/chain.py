"""Several post-grad passes as one, for Inductor versions whose ``post_grad_custom_pre_pass`` takes a single pass.

torch 2.13's Inductor runs a list there (``custom_graph_pass.get_custom_graph_passes``); torch 2.11 calls the config
value itself, so a list fails with "'list' object is not callable" (seen on the GPU image). The backend hands a list
where lists are taken (:func:`flashcodec_fx._compat.inductor_takes_pass_lists`), else a :class:`ChainedPass`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch.fx import Graph

from .. import _compat


class ChainedPass(_compat.CustomGraphPass):
    """``passes`` run in order on the graph; cacheable when each is (its ``uuid`` is theirs, in order)."""

    def __init__(self, passes: Sequence[Callable[[Graph], None]]):
        self.passes = tuple(passes)

    def __call__(self, graph: Graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> tuple | None:
        uuids = tuple(getattr(p, "uuid", lambda: None)() for p in self.passes)
        return None if any(u is None for u in uuids) else uuids


def post_grad_pre_pass(passes: list[Callable[[Graph], None]]) -> list | Callable[[Graph], None]:
    """The ``post_grad_custom_pre_pass`` value running ``passes`` in order on this torch."""
    if _compat.inductor_takes_pass_lists():
        return passes
    return passes[0] if len(passes) == 1 else ChainedPass(passes)
