"""The append-attention fusion: a layer's two cache appends and its codec attention become one
``flashcodec::append_attention`` call.

Runs on Inductor's post-grad graph after the SDPA-over-cache pass. There a decode step of a codec layer is

    k' = auto_functionalized_v2(flashcodec.append, new=k_new, spec=spec_k, _all_bases=[k_state...])
    v' = auto_functionalized_v2(flashcodec.append, new=v_new, spec=spec_v, _all_bases=[v_state...])
    o  = flashcodec.codec_attention(q, [k'[1], ...], [v'[1], ...], spec_k, spec_v, k_new, v_new, mask, scale)

which is, by its definition, ``o = append_attention(q, k_state, v_state, spec_k, spec_v, k_new, v_new, mask,
scale)``: one custom-op call per layer and step instead of three (the decode step's fixed cost, issue 41). The
fused node is the same ``auto_functionalized_v2`` form, its bases the two appends' bases in order, so Inductor
re-inplaces it as it did the appends. Fused only where that is exactly the same computation: the attention reads
every updated state tensor of both appends in their order and nothing else of the stored form, its new tokens are
the appends' own, no memo, and every other reader of the updated states comes after the attention (the fused call
sits where the attention was).
"""

from __future__ import annotations

import operator
import re

import torch
from torch.fx import Graph, Node

from .. import ops  # noqa: F401  (registers torch.ops.flashcodec)
from .._compat import CustomGraphPass, get_hash_for_files

APPEND = torch.ops.flashcodec.append.default
CODEC_ATTENTION = torch.ops.flashcodec.codec_attention.default
APPEND_ATTENTION = torch.ops.flashcodec.append_attention.default
AUTO_FUNCTIONALIZED_V2 = torch.ops.higher_order.auto_functionalized_v2
STATE_KEY = re.compile(r"^_state_(\d+)_(.+)$")  # an append's per-state-tensor view information


class AppendAttentionFusion(CustomGraphPass):
    """Inductor post-grad pass fusing each decode step's appends into its ``codec_attention`` (see the module
    docstring). ``fused``: the number of sites each run fused."""

    def __init__(self):
        self.fused: list[int] = []

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))

    def __call__(self, graph: Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        fused = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is CODEC_ATTENTION and _fuse(graph, node, order):
                fused += 1
        self.fused.append(fused)


def _state_reads(append: Node) -> list[Node] | None:
    """The ``getitem`` nodes of an ``auto_functionalized_v2(flashcodec.append)`` node's updated state tensors, in
    state order (outputs ``1..n``: output 0 is the op's own, None), or None when it is not such a node."""
    if append.op != "call_function" or append.target is not AUTO_FUNCTIONALIZED_V2 or append.args[:1] != (APPEND,):
        return None
    if append.kwargs.get("_memo_base_index") is not None:
        return None
    n = append.kwargs.get("_state_length")
    reads: dict[int, Node] = {}
    for user in append.users:
        if user.target is not operator.getitem or not isinstance(user.args[1], int) or user.args[1] in reads:
            return None
        reads[user.args[1]] = user
    if not n or sorted(reads) != list(range(1, n + 1)):
        return None
    return [reads[i] for i in range(1, n + 1)]


def _fuse(graph: Graph, attention: Node, order: dict[Node, int]) -> bool:
    """Replace ``attention`` and the two appends it reads by one fused node; False (graph untouched) where the site
    is not exactly that pattern."""
    q, k_state, v_state, spec_k, spec_v, k_new, v_new, *variants = (*attention.args, *[None] * 12)[:12]
    if attention.kwargs or not isinstance(k_state, list) or not isinstance(v_state, list) or k_new is None:
        return False
    appends = [getattr(s[0], "args", (None,))[0] if s else None for s in (k_state, v_state)]
    if not all(isinstance(a, Node) for a in appends) or appends[0] is appends[1]:
        return False
    reads = [_state_reads(a) for a in appends]
    if reads[0] != k_state or reads[1] != v_state:
        return False
    for append, new, spec in zip(appends, (k_new, v_new), (spec_k, spec_v), strict=True):
        if append.kwargs.get("new") is not new or append.kwargs.get("spec") != spec:
            return False
    at = order[attention]
    if any(order[user] < at for read in k_state + v_state for user in read.users if user is not attention):
        return False
    kwargs = _fused_kwargs(appends, q, spec_k, spec_v, k_new, v_new, variants)
    with graph.inserting_before(attention):
        node = graph.call_function(AUTO_FUNCTIONALIZED_V2, (APPEND_ATTENTION,), kwargs)
        outputs = [graph.call_function(operator.getitem, (node, i)) for i in range(1 + len(k_state) + len(v_state))]
    node.meta["val"] = (attention.meta["val"], *(r.meta["val"] for r in k_state + v_state))
    node.meta["stack_trace"] = attention.meta.get("stack_trace")
    for out, old in zip(outputs, [attention, *k_state, *v_state], strict=True):
        out.meta["val"] = old.meta["val"]
        old.replace_all_uses_with(out)
    for old in [attention, *k_state, *v_state, *appends]:
        graph.erase_node(old)
    return True


def _fused_kwargs(appends: list[Node], q: Node, spec_k: str, spec_v: str, k_new: Node, v_new: Node,
                  variants: list) -> dict:
    """``auto_functionalized_v2`` keyword arguments of the fused op: the attention's own arguments (``variants``:
    mask, scale, softcap, sinks, alibi), and each append's view information renamed to ``k_state`` / ``v_state`` with
    its base indices moved into the joint base list."""
    mask, scale, softcap, sinks, alibi = variants
    kwargs = dict(q=q, spec_k=spec_k, spec_v=spec_v, k_new=k_new, v_new=v_new, mask=mask, scale=scale,
                  softcap=softcap, sinks=sinks, alibi=alibi)
    bases: list[Node] = []
    for name, append in zip(("k_state", "v_state"), appends, strict=True):
        offset = len(bases)
        kwargs[f"_{name}_length"] = append.kwargs["_state_length"]
        for key, value in append.kwargs.items():
            found = STATE_KEY.match(key)
            if found is None:
                continue
            if found.group(2) == "base_index" and value is not None:
                value += offset
            kwargs[f"_{name}_{found.group(1)}_{found.group(2)}"] = value
        bases += append.kwargs["_all_bases"]
    kwargs["_all_bases"] = bases
    return kwargs
