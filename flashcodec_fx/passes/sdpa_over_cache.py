"""The SDPA-over-cache pass: attention over ``flashcodec::read`` views becomes ``flashcodec::codec_attention``.

Runs on Inductor's post-grad graph (functionalized ATen: the cache's ``append`` is an ``auto_functionalized``
node whose outputs are the updated state, so the rewritten attention reads exactly the state SDPA read).

Semantics. ``codec_attention`` over the stored state equals SDPA over ``read()`` whenever the positions
``>= length`` (``read`` returns zeros there: capacity padding of the static layout) are masked out, which is
the static-cache contract (transformers' causal masks over a static cache do it). The rewritten graph always
excludes them. Rewritten only when provably the same attention: ``dropout_p == 0``, ``is_causal=False``
(``is_causal=True`` is top-left aligned, which a cache read never wants), GQA by head grouping, equal batch, kv heads
and head dims, the call's new tokens read by both reads or neither. K and V are assumed to be one layer's pair of
streams (appended together, as ``CodecKVCache`` does), so their lengths agree.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.fx import Graph, Node

from .. import ops  # noqa: F401  (registers torch.ops.flashcodec)
from .._compat import CustomGraphPass, detect_fake_mode, get_hash_for_files
from . import match
from .match import DECODE, READ, NoMatch, NotCodec, SDPACall, bind_sdpa, trace_kv

log = logging.getLogger(__name__)
CODEC_ATTENTION = torch.ops.flashcodec.codec_attention.default
DEBUG_ENV = "FLASHCODEC_FX_DEBUG_DIR"


class MaterializationError(RuntimeError):
    """The user asked for materialization-free attention (``strict=True``) and a decoded view remains."""


@dataclass
class PassReport:
    """What one run of the pass did: rewritten sites, attention sites not over a codec read (``not_codec``), codec
    sites left alone (``skipped``, with reasons), views still in the graph, and the graphs when debugging."""

    rewritten: int = 0
    not_codec: int = 0
    skipped: list[str] = field(default_factory=list)
    remaining_views: list[str] = field(default_factory=list)
    graph_before: str | None = None
    graph_after: str | None = None


class SDPAOverCachePass(CustomGraphPass):
    """Inductor post-grad pass. ``strict``: raise :class:`MaterializationError` if any ``flashcodec::read`` /
    ``flashcodec::decode`` view (or the append's memo) still feeds the graph after the rewrite.
    ``debug``: True logs the graph before and after (logger ``flashcodec_fx.passes``), a path writes
    ``<path>/graph_<n>_{before,after}.txt``; the environment variable ``FLASHCODEC_FX_DEBUG_DIR`` does the same.
    Each inserted ``codec_attention`` stays a custom op: its fast kernel (Triton on CUDA, C++ on CPU) runs.
    Debugging disables Inductor's FX graph cache for the graphs this pass sees (``uuid() is None``), so every
    compile dumps. ``reports`` keeps a :class:`PassReport` per run (not on FX graph cache hits)."""

    def __init__(self, strict: bool = False, debug: bool | str | os.PathLike | None = None):
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
        if debug is None:
            debug = os.environ.get(DEBUG_ENV) or False
        if not isinstance(debug, (bool, str, os.PathLike)):
            raise TypeError(f"debug must be a bool or a directory path, got {type(debug).__name__}")
        self.strict, self.debug = strict, debug
        self.reports: list[PassReport] = []

    def uuid(self) -> bytes | None:
        if self.debug:
            return None
        return get_hash_for_files((__file__, match.__file__), extra=f"strict={self.strict}")

    def __call__(self, graph: Graph) -> None:
        report = PassReport()
        if self.debug:
            report.graph_before = str(graph)
        for node in list(graph.nodes):
            try:
                call = bind_sdpa(node)
                if call is not None:
                    _rewrite(graph, call)
                    report.rewritten += 1
            except NotCodec:
                report.not_codec += 1
            except NoMatch as why:
                report.skipped.append(f"{node.name}: {why}")
        report.remaining_views = _remaining_views(graph, report.skipped)
        if self.debug:
            report.graph_after = str(graph)
            self._dump(report)
        self.reports.append(report)
        if self.strict and report.remaining_views:
            raise MaterializationError(
                "flashcodec strict mode: the compiled graph still materializes the decoded KV view:\n  "
                + "\n  ".join(report.remaining_views)
                + "\nattention sites left alone:\n  " + ("\n  ".join(report.skipped) or "(none)"))

    def _dump(self, report: PassReport) -> None:
        n = len(self.reports)
        if isinstance(self.debug, bool):
            log.warning("flashcodec pass graph %d before:\n%s\nafter (%d rewritten, skipped %s):\n%s", n,
                        report.graph_before, report.rewritten, report.skipped, report.graph_after)
            return
        folder = Path(self.debug)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"graph_{n}_before.txt").write_text(report.graph_before)
        (folder / f"graph_{n}_after.txt").write_text(report.graph_after)


def _remaining_views(graph: Graph, skipped: list[str]) -> list[str]:
    views = [f"{n.name} = {n.target}" for n in graph.nodes if n.op == "call_function" and n.target in (READ, DECODE)]
    views += [s for s in skipped if "memoized view" in s]
    return views


def _rewrite(graph: Graph, call: SDPACall) -> None:
    """Replace one matched SDPA node; raises NoMatch (graph untouched) when the site is not provably equivalent."""
    k_src, v_src = trace_kv(call.key), trace_kv(call.value)
    if call.dropout_p != 0.0:
        raise NoMatch(f"dropout_p={call.dropout_p} (codec_attention has no dropout)")
    if call.is_causal:
        raise NoMatch("is_causal=True (top-left aligned causal mask) differs from attention over a cache")
    k_read, v_read = k_src.read, v_src.read
    b, hq, t, d = match._shape(call.query)
    kb, hkv, length_cap, kd = match._shape(k_read)
    vb, vh, _, vd = match._shape(v_read)
    if (kb, kd) != (b, d) or (vb, vh, vd) != (kb, hkv, kd):
        raise NoMatch(f"shapes q {(b, hq, t, d)}, k {match._shape(k_read)}, v {match._shape(v_read)} differ in B, H_kv or D")
    if k_src.repeat != v_src.repeat or hq % (hkv * k_src.repeat):
        raise NoMatch(f"GQA: query heads {hq}, kv heads {hkv}, repeats k={k_src.repeat} v={v_src.repeat}")
    (k_state, spec_k, k_new), (v_state, spec_v, v_new) = match.read_args(k_read), match.read_args(v_read)
    if (k_new is None) != (v_new is None):
        raise NoMatch("only one of the key / value reads carries the call's new tokens")
    fake_mode = detect_fake_mode([n.meta["val"] for n in (call.query, k_read, v_read)])
    if fake_mode is None:
        raise NoMatch("the graph carries no fake-tensor metadata (run the pass on a traced / post-grad graph)")
    with graph.inserting_before(call.node):
        mask = _mask_4d(graph, call.mask, fake_mode)
        args = (call.query, list(k_state), list(v_state), spec_k, spec_v, k_new, v_new, mask, call.scale)
        new = graph.call_function(CODEC_ATTENTION, args)
        with fake_mode:
            new.meta["val"] = CODEC_ATTENTION(*(_meta(a) for a in args))
    new.meta["stack_trace"] = call.node.meta.get("stack_trace")
    call.output.replace_all_uses_with(new)
    dead = [call.output, *call.unused_outputs, call.node] if call.output is not call.node else [call.node]
    erased: set[Node] = set()
    for node in dead + k_src.chain + v_src.chain + [k_read, v_read]:
        if node not in erased and not node.users:
            graph.erase_node(node)
            erased.add(node)


def _mask_4d(graph: Graph, mask: Node | None, fake_mode) -> Node | None:
    """SDPA broadcasts masks of any rank <= 4 from the right; codec_attention takes ``(1|B, 1|Hq, 1|T, L)``."""
    if mask is None:
        return None
    shape = match._shape(mask)
    if len(shape) == 4:
        return mask
    if len(shape) > 4:
        raise NoMatch(f"mask of rank {len(shape)}")
    full = [1] * (4 - len(shape)) + list(shape)
    node = graph.call_function(torch.ops.aten.reshape.default, (mask, full))
    with fake_mode:
        node.meta["val"] = mask.meta["val"].reshape(full)
    return node


def _meta(arg):
    if isinstance(arg, Node):
        return arg.meta["val"]
    if isinstance(arg, list):
        return [_meta(a) for a in arg]
    return arg
