"""The ``flashcodec`` command: --help everywhere, ``run`` end to end on a tiny saved model, argument errors on one
line with exit status 2, ``bench`` / ``demo`` / ``info``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashcodec_fx import cli
from flashcodec_fx.cli import bench, demo

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = ["run", "bench", "demo", "info"]


def git_status() -> str | None:
    done = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"], capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


@pytest.mark.parametrize("argv", [["--help"], *([c, "--help"] for c in COMMANDS)])
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flashcodec")
    if argv == ["--help"]:
        assert all(command in out for command in COMMANDS)


def test_run_help_lists_the_tiers(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = capsys.readouterr().out
    for option in ("--model", "--tiers", "--preset", "--prompt", "--new-tokens", "--device", "--dtype", "--threads",
                   "--out"):
        assert option in out
    assert "tiers: raw, png, jpeg, jpeg-int8, jpeg-k4-int8" in out and "(default: raw" in out


def test_console_script_is_declared():
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"flashcodec": "flashcodec_fx.cli:main"}


def test_python_dash_m_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "flashcodec_fx.cli", "--version"], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 0 and done.stdout.startswith("flashcodec_fx ")


@pytest.mark.parametrize(("argv", "message"), [
    (["run", "--model", "nope"], "--model 'nope': no folder or .gguf file of that name here, and no hub model 'nope'"),
    (["run", "--model", "./no/such/folder"], "--model './no/such/folder': no such model folder or .gguf file"),
    (["run", "--tiers", "raw,gif"], "--tiers / --preset: unknown tier(s) ['gif']; choose from"),
    (["run", "--new-tokens", "1"], "--new-tokens must be >= 2, got 1"),
    (["run", "--threads", "0"], "--threads must be 'auto' or an integer >= 1, got 0"),
    (["run", "--threads", "two"], "--threads must be 'auto' or an integer >= 1, got 'two'"),
    (["run", "--device", "tpu9"], "--device 'tpu9' is not a torch device"),
    (["bench", "nope"], "no benchmark 'nope'; choose from ["),
    (["run", "--out", "."], "--out '.' is a folder; give a file name"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    before = git_status()
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    line = captured.err.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith(f"flashcodec {argv[0]}: ") and message in line, line
    assert git_status() == before


def test_model_not_found_says_how_to_point_at_a_local_model(capsys):
    assert cli.main(["run", "--model", "nope"]) == 2
    err = capsys.readouterr().err
    assert "nothing is downloaded" in err and "save_pretrained" in err and ".gguf" in err and "bundled" in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--dtype", "int4"])
    assert exit_.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def run_lines(capsys, argv):
    assert cli.main(argv) == 0
    captured = capsys.readouterr()
    return captured.out.splitlines(), captured.err


def test_run_on_a_tiny_saved_model_prints_in_order_and_writes_only_out(tiny_model_folder, tmp_path, capsys, threads):
    pytest.importorskip("tqdm")
    out = tmp_path / "results" / "run.json"
    before = git_status()
    lines, err = run_lines(capsys, ["run", "--model", str(tiny_model_folder), "--prompt", "hello world",
                                    "--new-tokens", "10", "--tiers", "png,jpeg-k2-int8", "--threads", "1", "--out", str(out)])
    assert git_status() == before  # nothing written into the repository
    assert lines[0].startswith(f"flashcodec run: {tiny_model_folder} (2 layers, float32, cpu, 1 CPU threads, "
                               "--threads 1: asked for)")
    assert lines[1].startswith("CPU kernels: ")  # built or loaded before the first tier is timed
    assert lines[2].startswith("| tier | KV bytes vs raw |") and lines[3].startswith("|---|")
    assert [line.split(" | ")[0] for line in lines[4:7]] == ["| raw DynamicCache", "| png keep=1.0", "| jpeg r=8 K=2 int8"]
    assert lines[4].rsplit(" | ", 1)[1].strip(" |") not in ("0", "0.0")  # the raw tier's time is measured
    assert lines[-1].endswith(f"full results: {out}")
    for name in ("raw DynamicCache", "png keep=1.0", "jpeg r=8 K=2 int8"):
        assert f"{name}: 100%" in err  # a progress bar per tier, on stderr
    result = json.loads(out.read_text())
    assert result["benchmark"] == "main_job" and result["threads"] == 1 and result["new_tokens"] == 10
    assert result["versions"]["git_commit"] is not None or git_status() is None
    assert [row["tier"] for row in result["rows"]] == ["raw DynamicCache", "png keep=1.0", "jpeg r=8 K=2 int8"]
    assert all(row["kl"] >= 0 and row["seconds"] > 0 and row["threads"] == 1 for row in result["rows"])
    assert result["thread_policy"] == {"setting": "1", "choices": [{"threads": 1, "setting": "1",
                                                                     "other_busy_cores": None, "reason": "asked for"}]}
    assert result["kernel_build_s"] >= 0


def test_run_without_out_says_how_to_keep_the_json(tiny_model_folder, capsys, threads):
    lines, _ = run_lines(capsys, ["run", "--model", str(tiny_model_folder), "--prompt", "abc", "--new-tokens", "3",
                                  "--preset", "png", "--dtype", "bfloat16"])
    assert "bfloat16" in lines[0] and lines[-1].endswith("run with --out FILE to keep the JSON (every column, tokens, "
                                                         "provenance)")
    assert "CPU threads, --threads auto: " in lines[0]  # the default: the thread policy, and why it chose
    assert [line.split(" | ")[0] for line in lines[4:6]] == ["| raw DynamicCache", "| png keep=1.0"]


def test_auto_threads_look_at_the_machine_again_before_each_tier(tiny_model_folder, tmp_path, capsys, threads,
                                                                  monkeypatch):
    """Quiet at the start (2 threads), then another process takes both cores: the next tiers run on one thread."""
    from flashcodec_fx import threads as policy

    busy = iter([0.0, 2.0, 2.0])
    monkeypatch.setattr(policy, "_default", 2)
    monkeypatch.setattr(policy, "other_busy_cores", lambda: next(busy))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    out = tmp_path / "run.json"
    lines, err = run_lines(capsys, ["run", "--model", str(tiny_model_folder), "--prompt", "abc", "--new-tokens", "3",
                                    "--tiers", "png,jpeg-k2-int8", "--out", str(out)])
    assert "2 CPU threads, --threads auto: other processes keep 0.0 cores busy: torch's default" in lines[0]
    assert "1 CPU threads from the next tier on (other processes keep 2.0 cores busy: 1 of 2)" in err
    result = json.loads(out.read_text())
    assert [row["threads"] for row in result["rows"]] == [2, 1, 1]
    assert [c["threads"] for c in result["thread_policy"]["choices"]] == [2, 1, 1]


def test_bench_lists_the_benchmarks(capsys):
    assert cli.main(["bench"]) == 0
    out = capsys.readouterr().out
    names = [line.split()[0] for line in out.splitlines() if line.strip() and not line.startswith("flashcodec")]
    assert names == sorted(p.stem[len("bench_"):] for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert "ppl  " in out


def test_bench_runs_a_script_with_its_arguments(tmp_path, monkeypatch, capsys):
    script = tmp_path / "bench_echo.py"
    script.write_text('"""Echo."""\nimport sys\nprint(sys.argv[1:])\nsys.exit(3)\n')
    monkeypatch.setattr(bench, "BENCHMARKS", tmp_path)
    done = subprocess.run([sys.executable, "-c", "import sys; from flashcodec_fx.cli import bench, main; "
                           f"bench.BENCHMARKS = __import__('pathlib').Path({str(tmp_path)!r}); "
                           "sys.exit(main(['bench', 'echo', '--quick', '--out', 'x.json']))"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 3 and done.stdout.strip() == "['--quick', '--out', 'x.json']"
    assert cli.main(["bench"]) == 0 and capsys.readouterr().out.startswith("echo  Echo.")


def test_bench_without_a_checkout_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "BENCHMARKS", tmp_path / "missing")
    assert cli.main(["bench"]) == 2
    assert "come with a source checkout" in capsys.readouterr().err


def test_demo_without_gradio_is_a_one_line_hint(monkeypatch, capsys):
    real = demo.importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None if name == "gradio" else real(name))
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err.strip() == ("flashcodec demo: the demo needs gradio: pip install -e '.[demo]' "
                                               "(from a source checkout)")


def test_demo_calls_the_apps_main_with_the_arguments(tmp_path, monkeypatch):
    app = tmp_path / "app.py"
    app.write_text("CALLS = []\n\ndef main(argv):\n    CALLS.append(argv)\n    import builtins\n"
                   "    builtins._flashcodec_demo_argv = argv\n")
    monkeypatch.setattr(demo, "APP", app)
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: object())
    assert cli.main(["demo", "--share", "--port", "7861"]) == 0
    import builtins

    assert builtins.__dict__.pop("_flashcodec_demo_argv") == ["--share", "--port", "7861"]


def test_info_reports_versions_device_and_kernels(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"torch          {torch.__version__} (needs >= 2.11)" in out
    assert "flashcodec::read             flashcodec_fx.ops.reference.read.read" in out  # the reference on every device
    assert "\n  cpu: " in out and "\n  cuda: " in out
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kernels"]["ops"]["flashcodec::read"]["cpu"]["kind"] == "reference"
    assert report["device"]["cuda"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


@pytest.mark.parametrize(("argv", "ours", "theirs"), [
    (["bench", "ppl", "--help"], ["bench", "ppl"], ["--help"]),
    (["bench", "ppl", "--quick", "--out", "f.json"], ["bench", "ppl"], ["--quick", "--out", "f.json"]),
    (["bench", "--help"], ["bench", "--help"], []),
    (["bench"], ["bench"], []),
    (["demo", "--help"], ["demo", "--help"], []),
    (["demo", "--", "--help"], ["demo"], ["--help"]),
    (["demo", "--share"], ["demo"], ["--share"]),
    (["run", "--tiers", "png"], ["run", "--tiers", "png"], []),
])
def test_arguments_of_benchmarks_and_the_app_pass_through(argv, ours, theirs):
    assert cli.split_passthrough(argv) == (ours, theirs)


def test_output_into_a_closed_pipe_is_not_a_traceback():
    """``flashcodec info | head -1``: the reader is gone before the output is written."""
    read, write = os.pipe()
    os.close(read)
    done = subprocess.run([sys.executable, "-m", "flashcodec_fx.cli", "info"], stdout=write, stderr=subprocess.PIPE,
                          text=True, cwd=ROOT)
    os.close(write)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
