"""Copy-on-append sharing of a prefix: forks of a cache continue from the same stored tokens without copying them.

:func:`fork` deep-copies a cache object except the archive tensors of its dynamic codec streams, which the original
and the fork then share. Each sharing stream copies its archive (``CodecStream.shared``) before the first append that
would write an archive group into it; the raw tail, sinks, mean and lengths are the fork's own from the start (small),
as is a memo. Tokens a stream holds raw (its raw prefix, never written in place) are shared until either appends. So
N requests continued from one loaded prompt hold the prompt's archive once, plus what each of them writes. Static
layouts preallocate and write their buffers in place (stable addresses for compiled steps): their streams are copied
whole.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, TypeVar

from ..cache import CodecKVCache, CodecStream

T = TypeVar("T")


def fork(obj: T, streams: Iterable[CodecStream], memo: dict[int, Any] | None = None) -> T:
    """A deep copy of ``obj`` sharing the archives of ``streams`` (the codec streams ``obj`` holds) with it;
    ``memo``: more objects to share (``{id(x): x}``, as :func:`copy.deepcopy` takes)."""
    memo = {} if memo is None else dict(memo)
    for stream in streams:
        held = stream.held_raw()
        if held is not None:
            memo[id(held[0])] = held[0]
        if stream.state is None or stream.layout != "dynamic":
            continue
        stream.shared = True
        for t in stream.state[:4]:
            memo[id(t)] = t
    return copy.deepcopy(obj, memo)


def fork_kv_cache(cache: CodecKVCache) -> CodecKVCache:
    """:func:`fork` of one layer's engine cache (no transformers)."""
    return fork(cache, (cache.keys, cache.values))
