"""``import flashcodec_fx`` and the command's ``--help`` / ``--version`` load torch and nothing heavy (PEP 562 lazy
names, issue 32); the public names still resolve, and ``import flashcodec_fx`` defines every custom op (issue 40)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import flashcodec_fx

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch._dynamo", "torch._inductor", "transformers", "triton", "gguf", "safetensors", "accelerate", "sympy",
         "torch.utils.cpp_extension", "flashcodec_fx.ops.triton.gate", "flashcodec_fx.hf", "flashcodec_fx.passes")
"""Modules the import and the CLI's quick answers must not load (the Triton gate imports Triton)."""
OPS = ["read", "append", "codec_attention", "encode", "decode", "append_attention"]


def loaded_after(code: str) -> dict:
    """Run ``code`` in a fresh interpreter; ``{"heavy": [the HEAVY modules it loaded], "ops": [torch.ops.flashcodec
    ops that resolve]}``."""
    probe = (f"import sys, io, contextlib\n{code}\n"
             "import json, torch\n"
             f"heavy = [m for m in {HEAVY!r} if m in sys.modules]\n"
             f"ops = [n for n in {OPS!r} if hasattr(torch.ops.flashcodec, n)]\n"
             "print(json.dumps({'heavy': heavy, 'ops': ops}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


CLI = "from flashcodec_fx.cli import main\nwith contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main({argv!r})\n" \
      "    except SystemExit as exit_:\n        assert exit_.code == 0, exit_.code\n"


@pytest.mark.parametrize("code", [
    "import flashcodec_fx",
    "import flashcodec_fx; flashcodec_fx.PRESETS; flashcodec_fx.make_codec; flashcodec_fx.cache_config",
    CLI.format(argv=["--version"]),
    CLI.format(argv=["--help"]),
    CLI.format(argv=["run", "--help"]),
], ids=["import", "presets-and-codecs", "--version", "--help", "run --help"])
def test_nothing_heavy_is_imported(code):
    assert loaded_after(code)["heavy"] == []


@pytest.mark.parametrize("code", [
    "import flashcodec_fx",
    "import flashcodec_fx; flashcodec_fx.CodecKVCache",
    "import flashcodec_fx.passes.match",
    "import flashcodec_fx.kernel_report",
], ids=["import", "CodecKVCache", "compile-pass-match", "kernels"])
def test_the_ops_are_defined_on_import(code):
    """``import flashcodec_fx`` (so any path into the package) defines every ``torch.ops.flashcodec`` op."""
    assert loaded_after(code)["ops"] == OPS


def test_the_cuda_kernels_are_registered_without_importing_triton():
    """Where Triton is installed, each op has a CUDA kernel right after the import, and Triton is still not loaded."""
    pytest.importorskip("triton")
    code = ("import flashcodec_fx, torch\n"
            f"assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f'flashcodec::{{n}}', 'CUDA') for n in {OPS!r})")
    assert loaded_after(code)["heavy"] == []


def test_every_public_name_resolves_and_dir_lists_it():
    pytest.importorskip("transformers")  # the names of the transformers integration
    for name in [*flashcodec_fx.__all__, *flashcodec_fx._LAZY]:
        assert getattr(flashcodec_fx, name) is not None, name
        assert name in dir(flashcodec_fx), name
    assert flashcodec_fx.CodecKVCache is flashcodec_fx.cache.CodecKVCache
    assert flashcodec_fx.FlashCodecCache is flashcodec_fx.hf.FlashCodecCache


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        flashcodec_fx.no_such_name  # noqa: B018
