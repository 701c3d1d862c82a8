"""benchmarks/bench_llamacpp.py without llama-cpp-python: the command line, the rounds and their order, the workers'
protocol and interleaving (fake workers), the summary rows, the JSON and the docs table from a small fake result."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import bench_llamacpp as bl
import pytest

FAKE_MS = {"eager_raw": 40.0, "eager_int8": 32.0, "eager_4bit": 36.0, "eager_3bit": 34.0, "llama_f16_fa": 50.0,
           "llama_f16": 20.0, "llama_q8_0": 25.0, "llama_q4_0": 30.0}


def test_defaults_quick_and_explicit_options():
    args = bl.parse_args([])
    assert args.contexts == [1024, 4096, 8000] and args.threads == [1, 2] and args.configs == list(bl.CONFIGS)
    assert (args.rounds, args.steps, args.warmup, args.kl_tokens, args.kl_prefill, args.kl_chunk) == (3, 12, 2, 1024, 128, 16)
    assert not args.experiment and args.worker is None
    quick = bl.parse_args(["--quick"])
    assert quick.experiment and quick.contexts == [512] and quick.rounds == 1 and quick.kl_tokens == 256
    mixed = bl.parse_args(["--quick", "--threads", "1,2", "--configs", "eager_raw,llama_q4_0,eager_raw"])
    assert mixed.threads == [1, 2] and mixed.contexts == [512] and mixed.configs == ["eager_raw", "llama_q4_0"]
    narrower = bl.parse_args(["--contexts", "8000,4096,8000", "--skip-kl"])
    assert narrower.experiment and narrower.skip_kl and not narrower.skip_speed and narrower.contexts == [4096, 8000]


@pytest.mark.parametrize("argv", [["--configs", "llama_q5_1"], ["--contexts", "0"], ["--threads", "a"],
                                  ["--steps", "0"], ["--warmup", "-1"], ["--kl-tokens", "128"],
                                  ["--skip-kl", "--skip-speed"]])
def test_bad_options_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        bl.parse_args(argv)
    assert "error" in capsys.readouterr().err


def test_rounds_rotate_the_order_and_every_configuration_takes_every_position():
    configs = ["a", "b", "c", "d"]
    assert bl.round_order(configs, 0) == configs and bl.round_order(configs, 1) == ["b", "c", "d", "a"]
    assert bl.round_order(configs, 5) == bl.round_order(configs, 1) and bl.round_order([], 3) == []
    plan = bl.schedule([1024, 4096], [1, 2], 4, configs)
    assert len(plan) == 2 * 2 * 4 * 4 and [p["context"] for p in plan] == sorted(p["context"] for p in plan)
    for context in (1024, 4096):
        for threads in (1, 2):
            runs = [p for p in plan if p["context"] == context and p["threads"] == threads]
            for r in range(4):
                assert sorted(p["config"] for p in runs if p["round"] == r) == configs  # each once per round
            for name in configs:
                assert sorted(p["position"] for p in runs if p["config"] == name) == [0, 1, 2, 3]
    # within a round the thread counts alternate, so both see the same stretch of the machine's load
    assert [p["threads"] for p in plan[:8]] == [1] * 4 + [2] * 4 and plan[8]["round"] == 1


def test_capacity_holds_the_context_and_every_run():
    assert bl.capacity(8000, [1, 2], 3, 2, 12) >= 8000 + 2 * 3 * 14


def test_amx_is_read_from_the_cpu_flags():
    assert bl.has_amx("processor : 0\nflags : fpu sse avx512f amx_bf16 amx_tile amx_int8\n")
    assert not bl.has_amx("processor : 0\nflags : fpu sse avx2\nmodel name : amx lookalike\n")
    assert isinstance(bl.has_amx(), bool)


def _runs(rounds=3):
    runs = []
    for run in bl.schedule([1024], [1], rounds, list(FAKE_MS)):
        scale = 1.0 + 0.5 * run["round"]  # the machine slows down round by round: the ratios must not move
        times = [FAKE_MS[run["config"]] * scale * f for f in (0.9, 1.0, 1.3)]
        runs.append({**run, "times_ms": times, "load_1m": 1.0 + run["round"]})
    return runs


def test_summary_rows_medians_and_ratios_within_rounds():
    rows = {r["config"]: r for r in bl.summarize(_runs())}
    assert list(rows) == list(bl.CONFIGS)
    int8 = rows["eager_int8"]
    steps = [32.0 * s * f for s in (1.0, 1.5, 2.0) for f in (0.9, 1.0, 1.3)]
    assert int8["steps"] == 9 and int8["step_ms_median"] == pytest.approx(statistics.median(steps), abs=1e-3)
    assert int8["step_ms_p90"] == pytest.approx(sorted(steps)[7], abs=1e-3) and int8["step_ms_min"] == pytest.approx(28.8)
    assert int8["round_medians_ms"] == [32.0, 48.0, 64.0]
    assert int8["speed_vs_raw_rounds"] == [1.25] * 3 and int8["speed_vs_raw"] == 1.25
    assert rows["eager_raw"]["speed_vs_raw"] == 1.0 and rows["llama_f16_fa"]["speed_vs_raw"] == 0.8
    assert (int8["load_1m_min"], int8["load_1m_max"]) == (1.0, 3.0)
    assert rows["llama_q4_0"]["engine"] == "llama.cpp" and rows["llama_q4_0"]["kv"] == "q4_0, flash attention"
    no_raw = bl.summarize([r for r in _runs() if r["config"] != "eager_raw"])
    assert all(r["speed_vs_raw"] is None and r["speed_vs_raw_rounds"] == [] for r in no_raw)


class FakeWorker:
    """Stands for a worker process: ready once started, a fill per context, then fake step times per configuration."""

    log: list[tuple[str, dict]] = []

    def __init__(self, cmd, what):
        self.kind = cmd[cmd.index("--worker") + 1]
        self.configs = cmd[cmd.index("--configs") + 1].split(",")
        self.capacity = int(cmd[cmd.index("--capacity") + 1])
        assert (cmd[0] == sys.executable) == (self.kind == "torch")
        extra = {"amx": True, "use_extra_bufts": False, "system_info": "CPU : AVX2 = 1"} if self.kind == "llamacpp" else {}
        self.pending = [{"ready": True, **extra}]
        self.context, self.closed = None, False

    def read(self):
        return self.pending.pop(0)

    def send(self, **request):
        assert request["cmd"] == "fill" and (self.context or 0) < request["context"] <= self.capacity
        self.context = request["context"]
        FakeWorker.log.append((self.kind, request))
        self.pending.append({"fill_s": 1.0, "fill_threads": 2})

    def call(self, **request):
        assert request["cmd"] == "run" and request["config"] in self.configs and not self.closed and not self.pending
        FakeWorker.log.append((self.kind, request))
        ms = FAKE_MS[request["config"]]
        return {"times_ms": [ms] * request["steps"], "cpu_ms": ms, "tokens": [1] * request["steps"],
                "start_position": self.context}

    def close(self):
        self.closed = True


def test_speed_runs_interleave_both_engines_in_rounds(monkeypatch, tmp_path):
    monkeypatch.setattr(bl, "Worker", FakeWorker)
    monkeypatch.setattr(bl.os, "getloadavg", lambda: (2.5, 2.0, 1.5))
    FakeWorker.log = []
    args = bl.parse_args(["--contexts", "1024,512", "--threads", "1,2", "--rounds", "2", "--steps", "3"])
    speed = bl.run_speed(args, Path("model.gguf"), list(range(1024)), tmp_path)
    plan = bl.schedule([512, 1024], [1, 2], 2, list(bl.CONFIGS))
    runs = [(k, r["config"], r["threads"]) for k, r in FakeWorker.log if r["cmd"] == "run"]
    assert runs == [("llamacpp" if p["config"] in bl.LLAMA_CONFIGS else "torch", p["config"], p["threads"]) for p in plan]
    assert all(r["steps"] == 3 and r["warmup"] == 2 for _, r in FakeWorker.log if r["cmd"] == "run")
    fills = [i for i, (_, r) in enumerate(FakeWorker.log) if r["cmd"] == "fill"]
    assert fills == [0, 1, 2 + len(plan) // 2, 3 + len(plan) // 2]  # both engines filled before each context's runs
    assert len(speed["runs"]) == len(plan) and all(r["load_1m"] == 2.5 for r in speed["runs"])
    assert [(f["context"], f["worker"]) for f in speed["fills"]] == [(512, "torch"), (512, "llamacpp"),
                                                                     (1024, "torch"), (1024, "llamacpp")]
    assert speed["llama_info"]["use_extra_bufts"] is False
    assert json.loads((tmp_path / "fill_tokens.json").read_text()) == list(range(1024))
    rows = bl.summarize(speed["runs"])
    assert len(rows) == 2 * 2 * len(bl.CONFIGS)
    assert {r["config"]: r["speed_vs_raw"] for r in rows if r["context"] == 512 and r["threads"] == 2}["llama_f16"] == 2.0


def test_worker_pipes_skip_noise_and_report_errors():
    script = ("import json, sys\nprint('llama.cpp chatter')\nprint('MSG ' + json.dumps({'ready': True}), flush=True)\n"
              "for line in sys.stdin:\n    req = json.loads(line)\n    if req.get('cmd') == 'quit': break\n"
              "    if req.get('cmd') == 'die': sys.stderr.write('segfault here'); sys.exit(3)\n"
              "    out = {'error': 'bad'} if req.get('cmd') == 'bad' else {'echo': req['x']}\n"
              "    print('MSG ' + json.dumps(out), flush=True)\n")
    worker = bl.Worker([sys.executable, "-c", script], "fake")
    try:
        assert worker.read() == {"ready": True}
        assert worker.call(cmd="run", x=7) == {"echo": 7}
        with pytest.raises(RuntimeError, match="fake: bad"):
            worker.call(cmd="bad")
        with pytest.raises(RuntimeError, match=r"fake exited \(3\): segfault here"):
            worker.call(cmd="die")
    finally:
        worker.close()


def test_worker_loop_answers_each_line(monkeypatch, capsys):
    import io

    monkeypatch.setattr(sys, "stdin", io.StringIO('{"x": 1}\n{"x": 0}\n{"cmd": "quit"}\n{"x": 5}\n'))
    bl._serve(lambda request: {"inverse": 1 / request["x"]})
    lines = capsys.readouterr().out.splitlines()
    assert [json.loads(line.removeprefix(bl.MSG)) for line in lines] == [
        {"inverse": 1.0}, {"error": "ZeroDivisionError: division by zero"}]


def test_llama_streaming_calls_are_the_project_protocol():
    from flashcodec_fx.evaluate import stream_steps

    for length, prefill, chunk in ((1024, 128, 16), (256, 64, 16), (100, 7, 9)):
        assert bl.stream_slices(length, prefill, chunk) == [(f.start, f.stop) for f, _ in stream_steps(length, prefill, chunk)]


def test_numpy_kl_is_the_project_kl():
    np = pytest.importorskip("numpy")
    import torch

    from flashcodec_fx.evaluate import token_kl

    gen = np.random.default_rng(0)
    a, b = gen.normal(size=(5, 50)).astype(np.float32) * 3, gen.normal(size=(5, 50)).astype(np.float32) * 3
    la, lb = bl.log_softmax(a), bl.log_softmax(b)
    assert np.allclose(np.exp(la).sum(-1), 1.0) and np.allclose(la, torch.log_softmax(torch.from_numpy(a).double(), -1))
    expected = float(token_kl(torch.from_numpy(la), torch.from_numpy(lb)).mean())
    assert bl.mean_kl(la, lb) == pytest.approx(expected, rel=1e-12) and bl.mean_kl(la, la) == 0.0


def _fake_result():
    runs = _runs(2) + [{**r, "threads": 2, "times_ms": [t / 1.5 for t in r["times_ms"]]} for r in _runs(2)]
    quality = {"protocol": {"tokens": 256}, "references_kl": 1.234e-3, "rows": [
        {"config": "eager_raw", "bits_per_value": 32.0, "kl": 0.0, "reference": "reference"},
        {"config": "eager_4bit", "bits_per_value": 4.18, "kl": 7.7e-3, "reference": "flashcodec_fx raw"},
        {"config": "llama_f16_fa", "bits_per_value": 16.0, "kl": 0.0, "reference": "reference"},
        {"config": "llama_q4_0", "bits_per_value": 4.5, "kl": 4.7e-2, "reference": "llama.cpp f16, flash attention",
         "kl_vs_project_raw": 4.1e-2}]}
    payload = {"config": {"contexts": [1024]}, "runs": runs, "rows": bl.summarize(runs), "quality": quality}
    return bl.assemble(payload, version="0.3.36", amx=True, llama_info={"system_info": "AMX_INT8 = 1"},
                       load_start=[1.0, 1.0, 1.0], load_end=[2.0, 2.0, 2.0], wall_s=12.34)


def test_result_json_records_provenance_amx_and_load(tmp_path):
    from common import write_result

    path = write_result("llamacpp", _fake_result(), out=tmp_path / "llamacpp.json")
    result = json.loads(path.read_text())
    assert result["benchmark"] == "llamacpp" and result["date"] and result["machine"]["cpu_count"]
    assert "git_commit" in result["versions"] and "torch" in result["versions"]
    assert result["llama_cpp"]["version"] == "0.3.36" and result["llama_cpp"]["use_extra_bufts"] is False
    assert "use_extra_bufts=False" in result["llama_cpp"]["amx_note"] and result["llama_cpp"]["system_info"]
    assert result["load"]["before_runs_1m"] == {"min": 1.0, "median": 1.5, "max": 2.0} and result["wall_s"] == 12.3
    assert any("shared" in note for note in result["notes"])
    assert {"context", "threads", "config", "step_ms_median", "step_ms_p90", "speed_vs_raw"} <= set(result["rows"][0])
    quiet = bl.assemble({"config": {}}, None, False, {}, [0.0] * 3, [0.0] * 3, 1.0)
    assert quiet["llama_cpp"]["use_extra_bufts"] is True and "no AMX" in quiet["llama_cpp"]["amx_note"]
    assert quiet["load"]["before_runs_1m"] is None


def test_docs_table_from_a_fake_result():
    text = bl.markdown(_fake_result())
    lines = text.splitlines()
    assert lines[0] == ("| engine | KV cache | bits/value | KL | KL against | KL vs flashcodec_fx raw | "
                        "1 thread, 1k: ms (vs raw) | 2 threads, 1k: ms (vs raw) |")
    rows = {line.split(" | ")[1]: [c.strip() for c in line.strip("|").split("|")] for line in lines[2:] if line.startswith("|")}
    assert len(rows) == len(bl.CONFIGS)
    assert rows["`4bit`"] == ["flashcodec_fx (transformers)", "`4bit`", "4.18", "7.70e-03", "flashcodec_fx raw",
                              "7.70e-03", "47.7 (1.11x)", "31.8 (1.11x)"]
    assert rows["q4_0, flash attention"][2:6] == ["4.50", "4.70e-02", "llama.cpp f16, flash attention", "4.10e-02"]
    assert rows["f16, flash attention"][2:6] == ["16.00", "0", "reference", "-"]
    assert rows["raw DynamicCache, fp32"][2:7] == ["32.00", "0", "reference", "0", "53.0 (1.00x)"]
    assert rows["`int8`"][2:6] == ["-", "-", "-", "-"]  # timed, not in the quality part
    assert lines[-1] == "The two references on the same tokens: KL(flashcodec_fx raw || llama.cpp f16) = 1.23e-03."
    assert bl.markdown({"rows": []}).splitlines()[0] == ("| engine | KV cache | bits/value | KL | KL against | "
                                                          "KL vs flashcodec_fx raw |")


def test_readme_tables_renders_it_from_the_json(monkeypatch, tmp_path):
    import readme_tables
    from common import write_result

    write_result("llamacpp", _fake_result(), out=tmp_path / "llamacpp.json")
    monkeypatch.setattr(readme_tables, "RESULTS", tmp_path)
    table = readme_tables.TABLES["llamacpp"]()
    assert table.startswith(bl.markdown(_fake_result()))
    assert "[llamacpp.json](benchmarks/results/llamacpp.json): commit" in table.splitlines()[-1]
