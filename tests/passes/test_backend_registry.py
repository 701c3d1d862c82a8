"""The backend name: registered on import when not installed, and loadable through the torch_dynamo_backends entry
point (pyproject.toml) with no import at all, without a duplicate registration."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import flashcodec_fx
from flashcodec_fx.passes import FlashCodecBackend, flashcodec_backend

ROOT = Path(__file__).resolve().parents[2]


def test_entry_point_target_matches_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'flashcodec = "flashcodec_fx.passes.backend:flashcodec_backend"' in text
    assert isinstance(flashcodec_backend, FlashCodecBackend)


def test_name_resolves_after_import():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("flashcodec") is flashcodec_backend
    assert isinstance(flashcodec_fx.backend(strict=True), FlashCodecBackend)


def test_entry_point_loads_without_import():
    script = textwrap.dedent("""
        import importlib.metadata as md
        real = md.entry_points
        ep = md.EntryPoint("flashcodec", "flashcodec_fx.passes.backend:flashcodec_backend", "torch_dynamo_backends")
        md.entry_points = lambda **kw: md.EntryPoints([ep]) if kw.get("group") == "torch_dynamo_backends" else real(**kw)
        import sys
        assert "flashcodec_fx" not in sys.modules
        from torch._dynamo.backends.registry import lookup_backend
        fn = lookup_backend("flashcodec")
        from flashcodec_fx.passes import FlashCodecBackend
        assert isinstance(fn, FlashCodecBackend), fn
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert out.stdout.strip() == "ok", out.stderr[-3000:]


def test_mode_and_options_reach_inductor_config():
    be = flashcodec_fx.backend(options={"max_autotune": False})
    patches = be.config_patches(mode="reduce-overhead", options={"epilogue_fusion": False})
    assert patches["triton.cudagraphs"] is True and patches["epilogue_fusion"] is False
    assert patches["max_autotune"] is False and patches["post_grad_custom_pre_pass"][0] is be.pass_
    with torch._inductor.config.patch(post_grad_custom_pre_pass=print):
        assert be.config_patches()["post_grad_custom_pre_pass"] == [be.pass_, be.fusion, print]


def test_one_pass_where_inductor_takes_one(monkeypatch):
    """torch 2.11's Inductor calls ``post_grad_custom_pre_pass`` itself (a list fails there): the backend then hands
    its passes chained (the SDPA rewrite, then the append fusion), before the user's, and the compile runs them all, in
    order."""
    from flashcodec_fx import _compat
    from flashcodec_fx.passes.chain import ChainedPass

    monkeypatch.setattr(_compat, "inductor_takes_pass_lists", lambda: False)
    be = flashcodec_fx.backend()
    own = be.config_patches()["post_grad_custom_pre_pass"]
    assert isinstance(own, ChainedPass) and own.passes == (be.pass_, be.fusion) and own.uuid() is not None
    seen = []

    def user_pass(graph):
        seen.append(len(be.pass_.reports))

    with torch._inductor.config.patch(post_grad_custom_pre_pass=user_pass):
        chained = be.config_patches()["post_grad_custom_pre_pass"]
        assert isinstance(chained, ChainedPass) and chained.passes == (be.pass_, be.fusion, user_pass)
        assert chained.uuid() is None  # the user's pass has no uuid: not cacheable
        torch._dynamo.reset()
        out = torch.compile(lambda x: x.sin() + 1, backend=be)(torch.ones(3))
    assert torch.equal(out, torch.ones(3).sin() + 1)
    assert seen == [1] and len(be.pass_.reports) == 1 and be.fusion.fused == [0]  # ours ran first, then the user's
