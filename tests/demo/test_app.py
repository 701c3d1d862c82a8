"""demo/app.py without a browser: start-up errors, the formatting of what the panels show, import isolation."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "demo"))

import app  # noqa: E402


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=240, cwd=ROOT)


def test_importing_the_package_never_imports_gradio_or_matplotlib():
    code = ("import sys, flashcodec_fx, flashcodec_fx.evaluate, flashcodec_fx.pretrained; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'gradio', 'matplotlib', 'playwright'}))")
    done = _run("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_bad_model_path_is_one_line_and_exit_code_2(tmp_path):
    missing = tmp_path / "no_such_model"
    done = _run(str(ROOT / "demo" / "app.py"), "--model", str(missing))
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    ours = [line for line in done.stderr.splitlines() if line.startswith("flashcodec demo:")]
    assert len(ours) == 1 and ours == done.stderr.strip().splitlines()[-1:]
    assert str(missing) in ours[0] and "--model" in ours[0]  # what was looked for, and how to point at a model


@pytest.mark.parametrize("device, says", [("mps", "the demo runs on cpu or cuda"), ("nonsense", "use cpu, cuda or cuda:N")])
def test_a_bad_device_is_one_line_and_exit_code_2(device, says):
    done = _run(str(ROOT / "demo" / "app.py"), "--device", device)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert says in done.stderr.strip().splitlines()[-1]


def test_stats_row_shows_every_measure_and_the_match_with_the_left_panel():
    stats = {"tier": "jpeg r=8 K=8 int8", "tokens": 32, "prompt_tokens": 20, "prefill_s": 0.05, "kept": 3 * 1024,
             "archive": 2 * 1024, "tail": 1024, "view": 8192, "held": 12288, "bits_per_value": 10.42, "peak_held": 12288,
             "steady_held": 12288, "ms_per_token": 45.25, "tok_s": 22.1, "first_step_s": None, "match": 0.75,
             "match_over": 32, "match_prefix": 20}
    html = app.format_stats(stats)
    for text in ("kept <b>3.00 KiB</b>", "archive 2.00 KiB", "view 8.00 KiB", "10.42 bits/value", "45.2 ms/token",
                 "peak 12.00 KiB", "<b>24/32</b> tokens identical", "first 20 the same"):
        assert text in html
    assert "CUDA" not in html and "compiled" not in html
    cuda = app.format_stats(stats | {"cuda_peak": 2**21, "cuda_steady": 2**20, "first_step_s": 12.5, "tok_s": math.nan})
    assert "CUDA allocator peak 2.00 MiB" in cuda and "first compiled step 12.50 s" in cuda and "(- tok/s)" in cuda
    assert "no turn yet" in app.format_stats(None)


def test_comparison_table_leaves_out_columns_no_row_has():
    rows = [{"tier": "raw", "kept": 2048, "kv_ratio": 1.0, "bits_per_value": 32.0, "nll": 0.5, "kl": 0.0},
            {"tier": "int8", "kept": 640, "kv_ratio": 0.3125, "bits_per_value": 10.0, "nll": 0.51, "kl": 1e-3}]
    headers, cells = app.compare_table(rows)
    assert headers == ["tier", "KV kept", "vs native", "bits/value", "NLL", "KL vs native"]
    assert cells[1] == ["int8", "640 B", "0.312", "10.00", "0.5100", "1.00e-03"]
    assert app.compare_table([rows[0] | {"kl": -1.4e-8}])[1][0][-1] == "~0"  # rounding noise of a lossless tier


class _FailingEngine:
    """Just enough of side_by_side.Engine for build_app; every run raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error

    def describe(self) -> str:
        return "stub"

    def tiers(self) -> dict:
        from side_by_side import codec_tiers

        return {tier.name: tier for tier in codec_tiers()}

    def encode(self, messages):
        return messages

    def turn(self, *args, **kwargs):
        raise self.error
        yield

    def compare(self, *args, **kwargs):
        raise self.error
        yield


def _handler(app_blocks, name: str):
    return next(f.fn for f in app_blocks.fns.values() if getattr(f.fn, "__name__", "") == name)


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried "
                                                                "to allocate 1099511627776 bytes")])
def test_out_of_memory_is_a_message_in_the_page(error):
    pytest.importorskip("gradio")
    pytest.importorskip("matplotlib")
    blocks = app.build_app(_FailingEngine(error))
    *_, status, _ = list(_handler(blocks, "chat")("hello", [], [], app.DEFAULT_TIER, False, False, 8))[-1]
    assert "**failed:** out of memory" in status and "fewer new tokens" in status
    *_, status = list(_handler(blocks, "compare")("hello", 8, False))[-1]
    assert "**failed:** out of memory" in status


def test_port_and_host_come_from_gradio_variables_unless_given(monkeypatch):
    monkeypatch.delenv("GRADIO_SERVER_PORT", raising=False)
    monkeypatch.delenv("GRADIO_SERVER_NAME", raising=False)
    default = app.parse_args([])
    assert (default.port, default.host) == (7860, "127.0.0.1")
    monkeypatch.setenv("GRADIO_SERVER_PORT", "8123")
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    from_env = app.parse_args([])
    assert (from_env.port, from_env.host) == (8123, "0.0.0.0")
    given = app.parse_args(["--port", "9000", "--host", "::1"])
    assert (given.port, given.host) == (9000, "::1")
    monkeypatch.setenv("GRADIO_SERVER_PORT", "http")
    with pytest.raises(SystemExit):
        app.parse_args([])
