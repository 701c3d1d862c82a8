"""Pattern matching for the SDPA-over-cache pass on post-grad (functionalized ATen) FX graphs.

A match is ``sdpa(q, heads(read(k_state)), heads(read(v_state)), mask, scale)`` where ``sdpa`` is any ATen
scaled-dot-product-attention variant (the composite op, CPU flash, CUDA flash / efficient / cuDNN, the
overrideable fused op) and ``heads`` is a chain of value-preserving ops (clone, alias, no-op view / expand /
slice) and GQA head repetitions (``repeat_kv``: unsqueeze(2) -> expand -> reshape, or repeat_interleave on dim 1).
Only what is provably the same attention matches: no dropout, ``is_causal=False``, query head ``i`` reading
kv head ``i // (Hq // H_kv)`` exactly as ``flashcodec::codec_attention`` does.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from .. import ops  # noqa: F401  (defines torch.ops.flashcodec)

aten = torch.ops.aten

SDPA_OPS = {
    aten.scaled_dot_product_attention.default: "attn_mask",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "attn_mask",
    aten._scaled_dot_product_flash_attention.default: None,
    aten._scaled_dot_product_efficient_attention.default: "attn_bias",
    aten._scaled_dot_product_cudnn_attention.default: "attn_bias",
    aten._scaled_dot_product_fused_attention_overrideable.default: "attn_bias",
}
"""Every SDPA variant the pass understands -> the name of its mask argument (None: the op takes no mask)."""

READ = torch.ops.flashcodec.read.default
DECODE = torch.ops.flashcodec.decode.default
APPEND = torch.ops.flashcodec.append.default
PASSTHROUGH = {aten.clone.default, aten.alias.default, aten.contiguous.default, aten.lift_fresh_copy.default}
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}


@dataclass
class SDPACall:
    """One SDPA node with its arguments bound by name; ``output`` is the node carrying the attention result."""

    node: Node
    output: Node
    unused_outputs: list[Node]
    query: Node
    key: Node
    value: Node
    mask: Node | None
    dropout_p: float
    is_causal: bool
    scale: float | None


@dataclass
class KVSource:
    """Where an SDPA key/value comes from: the ``flashcodec::read`` node and the head repetition on the way."""

    read: Node
    repeat: int
    chain: list[Node]


class NoMatch(Exception):
    """Raised inside the matcher with the reason a site is left alone."""


class NotCodec(NoMatch):
    """The attention site does not read a codec cache at all (nothing to rewrite, nothing to report)."""


def _shape(node: Node) -> tuple[int, ...]:
    val = node.meta.get("val") if isinstance(node, Node) else None
    if not isinstance(val, torch.Tensor):
        raise NoMatch(f"{node} has no tensor metadata")
    return tuple(val.shape)


def bind_sdpa(node: Node) -> SDPACall | None:
    """Bind an SDPA node's arguments by name; None when ``node`` is not an SDPA variant."""
    if node.op != "call_function" or node.target not in SDPA_OPS:
        return None
    schema = node.target._schema
    bound = {arg.name: arg.default_value if arg.has_default_value() else None for arg in schema.arguments}
    for arg, value in zip(schema.arguments, node.args, strict=False):
        bound[arg.name] = value
    bound.update(node.kwargs)
    output, unused = node, []
    if len(schema.returns) > 1:
        firsts = [u for u in node.users if u.target is operator.getitem and u.args[1] == 0]
        unused = [u for u in node.users if u not in firsts]
        if len(firsts) != 1 or any(u.target is not operator.getitem or u.users for u in unused):
            raise NoMatch(f"{node.name}: outputs other than the attention result are used")
        output = firsts[0]
    mask_name = SDPA_OPS[node.target]
    return SDPACall(node, output, unused, bound["query"], bound["key"], bound["value"],
                    bound.get(mask_name) if mask_name else None, float(bound.get("dropout_p") or 0.0),
                    bool(bound.get("is_causal")), bound.get("scale"))


def _skip_passthrough(node: Node, chain: list[Node]) -> Node:
    """Follow value-preserving ops (clones, aliases, no-op views / expands / slices) upstream."""
    while isinstance(node, Node) and node.op == "call_function":
        src = node.args[0] if node.args else None
        if node.target in PASSTHROUGH:
            pass
        elif node.target in VIEWS | {aten.expand.default} and _shape(node) == _shape(src):
            pass
        elif node.target == aten.slice.Tensor and _is_noop_slice(node):
            pass
        else:
            return node
        chain.append(node)
        node = src
    return node


def _is_noop_slice(node: Node) -> bool:
    src, _, start, _, step = (*node.args, *(0, None, None, 1)[len(node.args) - 1:])
    return start in (0, None) and step == 1 and _shape(node) == _shape(src)


def _unsqueezed_source(node: Node, chain: list[Node]) -> Node:
    """``node`` (B, H, 1, S, D) made from x (B, H, S, D) by unsqueeze(2) or a view: returns x."""
    if node.target == aten.unsqueeze.default and node.args[1] in (2, -3):
        chain.append(node)
        return node.args[0]
    if node.target in VIEWS:
        src = node.args[0]
        b, h, s, d = _shape(src)
        if _shape(node) == (b, h, 1, s, d):
            chain.append(node)
            return src
    raise NoMatch(f"{node.name}: a 5-d head expansion not made by unsqueeze(2)")


def trace_kv(node: Node) -> KVSource:
    """Walk from an SDPA key/value argument back to its ``flashcodec::read``; raises NoMatch with the reason."""
    chain: list[Node] = []
    repeat = 1
    while True:
        node = _skip_passthrough(node, chain)
        if not isinstance(node, Node) or node.op != "call_function":
            raise NotCodec(f"{node} is not produced by flashcodec::read")
        if node.target == READ:
            return KVSource(node, repeat, chain)
        if node.target == DECODE:
            raise NoMatch(f"{node.name}: flashcodec::decode of whole blocks (no length/tail): not a cache read")
        if node.target is operator.getitem and getattr(node.args[0], "target", None) is not None \
                and APPEND in getattr(node.args[0], "args", ()):
            raise NoMatch(f"{node.name}: key/value is the append's memoized view (use memoize=False for compile)")
        if node.target == aten.repeat_interleave.self_int and _repeat_interleave_heads(node):
            repeat *= int(node.args[1])
            chain.append(node)
            node = node.args[0]
            continue
        if node.target in VIEWS and len(_shape(node.args[0])) == 5:
            b, h, n, s, d = _shape(node.args[0])
            if _shape(node) != (b, h * n, s, d):
                raise NoMatch(f"{node.name}: reshape {(b, h, n, s, d)} -> {_shape(node)} does not merge kv heads")
            chain.append(node)
            expand = _skip_passthrough(node.args[0], chain)
            if expand.target != aten.expand.default or _shape(expand.args[0]) != (b, h, 1, s, d):
                raise NoMatch(f"{expand.name}: heads not repeated by expanding a singleton dim 2")
            chain.append(expand)
            node = _unsqueezed_source(_skip_passthrough(expand.args[0], chain), chain)
            repeat *= n
            continue
        if not _reads_codec(node):
            raise NotCodec(f"{node.name} ({node.target}): attention not over a codec cache read")
        raise NoMatch(f"{node.name} ({node.target}) between flashcodec::read and attention is not a known GQA/view op")


def read_args(read: Node) -> tuple[list, str, Node | None]:
    """``(state nodes, spec, new tokens node or None)`` of a ``flashcodec::read`` node."""
    args = list(read.args) + [None] * (3 - len(read.args))
    new = read.kwargs.get("new", args[2])
    return list(args[0]), read.kwargs.get("spec", args[1]), new


def _reads_codec(node: Node, budget: int = 64) -> bool:
    """Whether a ``flashcodec::read``/``decode`` is among the first ``budget`` ancestors of ``node``."""
    seen, todo = set(), [node]
    while todo and len(seen) < budget:
        cur = todo.pop()
        if cur in seen or not isinstance(cur, Node):
            continue
        seen.add(cur)
        if cur.target in (READ, DECODE):
            return True
        todo.extend(cur.all_input_nodes)
    return False


def _repeat_interleave_heads(node: Node) -> bool:
    args = list(node.args) + [None] * 3
    dim = node.kwargs.get("dim", args[2])
    return isinstance(args[1], int) and dim in (1, -3) and len(_shape(node)) == 4
