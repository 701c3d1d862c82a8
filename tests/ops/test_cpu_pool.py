"""The CPU kernels' fork-join (ops/cpu/pool.h): results do not depend on which thread ran which work item, and
callers on several Python threads at once (the pool busy: a caller runs its items itself) get the same answer."""

from __future__ import annotations

import threading

import torch
from _cpu_cases import filled

from flashcodec_fx import presets
from flashcodec_fx.ops.cpu.launch import cpu_append
from flashcodec_fx.ops.cpu.plan import codec_plan

CALLERS = 4
CALLS = 5


def test_concurrent_callers_get_the_serial_answer(cpu_kernels):
    """A stream long enough for two threads to split it (4bit at SmolLM2's shape): four Python threads call the
    kernel at once, repeatedly; every output is bitwise the single-caller one (the splits are fixed by the shapes
    and the thread count, each is computed the same way on any thread, and they are combined in order)."""
    ck, cv = presets.preset_codecs("4bit")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 7000, 64, generator=gen)
    ks, vs = filled(ck, x, [7000], appender=cpu_append), filled(cv, x, [7000], appender=cpu_append)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    plans = codec_plan(ck.spec, 64), codec_plan(cv.spec, 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def call():
            return cpu_kernels.codec_attention(q, ks, vs, *plans, None, None, None, 0.125, True)

        want = call()
        outs: list[torch.Tensor] = []
        lock = threading.Lock()

        def caller():
            for _ in range(CALLS):
                out = call()
                with lock:
                    outs.append(out)

        workers = [threading.Thread(target=caller) for _ in range(CALLERS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(threads)
    assert len(outs) == CALLERS * CALLS
    assert all(torch.equal(out, want) for out in outs)
