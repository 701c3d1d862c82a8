"""bench_vllm's bookkeeping (no vLLM needed): the throughput cells of the serving table, the memory-bound parts'
cap, rows and table, and ``--merge``."""

from __future__ import annotations

import json

import bench_vllm
import pytest
import torch
import vllm_memory


def serving_row(config: str, preset: str | None, kv_tokens: int) -> dict:
    greedy = [{"ids": [1, 2, 3], "top2": [[-0.1, -2.0]] * 3}]
    return {"config": config, "preset": preset, "kv_tokens": kv_tokens, "bits_per_value": 16.0,
            "concurrent": {"4160": kv_tokens // 4224}, "greedy": greedy}


def throughput_part(*runs: tuple[str, str, int, float]) -> dict:
    """The throughput part of runs ``(mode, config, round, tokens/s)`` (config "stock vLLM": stock)."""
    rows = [{"mode": mode, "config": config, "preset": None if config == "stock vLLM" else config, "round": round_,
             "tokens_per_s": tps} for mode, config, round_, tps in runs]
    return {"dtype": "float32", "runs": rows, "rows": bench_vllm.throughput_rows(rows)}


def test_throughput_ratios_pair_each_round_with_its_own_stock_run():
    part = throughput_part(("eager", "stock vLLM", 0, 100.0), ("eager", "3bit", 0, 120.0),
                           ("eager", "3bit", 1, 99.0), ("eager", "stock vLLM", 1, 90.0),
                           ("compiled", "stock vLLM", 0, 200.0), ("compiled", "3bit", 0, 180.0))
    rows = {(r["mode"], r["config"]): r for r in part["rows"]}
    assert rows["eager", "3bit"]["vs_stock"] == pytest.approx((1.2 + 1.1) / 2)
    assert rows["eager", "3bit"]["vs_stock_range"] == pytest.approx([1.1, 1.2])
    assert rows["eager", "3bit"]["tokens_per_s"] == pytest.approx(109.5)
    assert rows["eager", "stock vLLM"]["vs_stock"] == 1.0
    assert rows["compiled", "3bit"]["vs_stock"] == pytest.approx(0.9)


def test_the_serving_table_shows_each_mode_and_dashes_without_a_run():
    rows = bench_vllm.compare_serving([serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 233856),
                                       serving_row("int8", "int8", 90368)])
    result = {"serving": rows, "throughput": throughput_part(
        ("eager", "stock vLLM", 0, 100.0), ("eager", "3bit", 0, 126.0),
        ("compiled", "stock vLLM", 0, 200.0), ("compiled", "3bit", 0, 180.0))}
    table = bench_vllm.serving_markdown(result).splitlines()
    stock, three, int8 = table[2], table[3], table[4]
    assert "| 100 / 200 | 1.00 / 1.00 |" in stock
    assert "| 126 / 180 | 1.26 / 0.90 |" in three
    assert "| - | - |" in int8
    assert "| 5.02 |" in three  # capacity vs stock


def test_merge_keeps_one_row_per_configuration_the_later_part_replacing_the_earlier(tmp_path):
    run = {"date": "2026-12-02", "machine": {"load_avg_1_5_15m": [1.0, 1.0, 1.0]}, "versions": {}, "config": {}}
    old = {**run, "serving": [serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 100)]}
    tput = throughput_part(("eager", "stock vLLM", 0, 100.0), ("eager", "3bit", 0, 90.0))
    new = {**run, "serving": [serving_row("3bit", "3bit", 233856)], "throughput": tput}
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    for path, part in zip(paths, (old, new), strict=True):
        path.write_text(json.dumps(part))
    out = tmp_path / "merged.json"
    bench_vllm.main(["--merge", *map(str, paths), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert [r["config"] for r in merged["serving"]] == ["stock vLLM", "3bit"]
    assert merged["serving"][1]["kv_tokens"] == 233856
    assert merged["serving"][1]["capacity_vs_stock"] == 233856 / 46592
    assert merged["throughput"]["rows"][1]["vs_stock"] == pytest.approx(0.9)
    assert sorted(merged["runs"]) == ["new", "old"]


def test_a_throughput_run_without_stock_shows_its_speed_and_no_ratio():
    rows = bench_vllm.compare_serving([serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 233856)])
    part = throughput_part(("eager", "3bit", 0, 126.0))
    table = bench_vllm.serving_markdown({"serving": rows, "throughput": part}).splitlines()
    assert "| 126 | - |" in table[3]


def test_merge_drops_the_runs_of_an_earlier_merge_whose_rows_were_all_replaced():
    def run(parts: list[str], only: list[str] | None, load: float) -> dict:
        return {"date": "2026-12-01", "machine": {"load_avg_1_5_15m": [load] * 3}, "versions": {},
                "config": {"parts": parts, "only": only}}

    quality = {"vllm": [{"config": "stock vLLM", "preset": None, "ppl": 20.0}], "flashcodec": [{"tier": "raw"}]}
    earlier = {"runs": {"s": run(["serving"], ["stock vLLM"], 28.0), "q": run(["quality"], None, 2.0)},
               "serving": [serving_row("stock vLLM", None, 46592)], "quality": quality}
    later = {"date": "2026-12-02", "machine": {"load_avg_1_5_15m": [1.0] * 3}, "versions": {},
             "config": {"parts": ["serving"]}, "serving": [serving_row("stock vLLM", None, 93184)]}
    merged = bench_vllm.merge([("vllm", earlier), ("new", later)])
    assert sorted(merged["runs"]) == ["new", "q"]
    assert merged["machine"]["load_avg_1_5_15m"][0] == 2.0
    assert merged["serving"][0]["kv_tokens"] == 93184
    assert merged["quality"]["vllm"][0]["delta_ppl"] == 0.0 and merged["quality"]["flashcodec"] == [{"tier": "raw"}]


def load_figures(ttfts: list[float], tpots: list[float], seconds: float, running: int, preemptions: int) -> dict:
    """What ``vllm_engine.load`` / ``vllm_server.send_load`` return for a load (the rows' input)."""
    requests = [{"generated": 8, "ttft": a, "tpot": b} for a, b in zip(ttfts, tpots, strict=True)]
    return {"seconds": seconds, "requests": requests, "max_running": running, "preemptions": preemptions}


def test_the_kv_cap_holds_the_stock_sequences_asked_for_and_the_null_page():
    # SmolLM2: 30 layers, 3 KV heads, head_dim 64; bf16 pages of 128 tokens are 30 * 3 * 128 * 256 bytes
    page = 30 * 3 * 128 * 256
    assert vllm_memory.kv_cap_bytes((30, 3, 64), torch.bfloat16, 768, 6) == (6 * 6 + 1) * page
    assert vllm_memory.kv_cap_bytes((30, 3, 64), torch.float32, 769, 1) == (7 + 1) * 2 * page  # a partial page


def test_summary_is_the_median_and_the_interpolated_90th_percentile():
    assert vllm_memory.summary([3.0, 1.0, 2.0]) == {"median": 2.0, "p90": 2.8}
    assert vllm_memory.summary([5.0]) == {"median": 5.0, "p90": 5.0}
    with pytest.raises(ValueError, match="values"):
        vllm_memory.summary([])


def test_load_rows_count_tokens_capacity_and_latencies_and_compare_with_stocks_mean():
    stock = {"name": "stock vLLM", "preset": None}
    rows = [vllm_memory.load_row(stock, load_figures([1.0, 3.0], [0.1, 0.3], 4.0, 5, 7), blocks=37, seq_tokens=768),
            vllm_memory.load_row({"name": "3bit", "preset": "3bit"},
                                 load_figures([1.0, 2.0], [0.2, 0.2], 2.0, 16, 0), blocks=185, seq_tokens=768),
            vllm_memory.load_row(stock, load_figures([1.0, 1.0], [0.1, 0.1], 8.0, 5, 3), blocks=37, seq_tokens=768)]
    rows = vllm_memory.compare(rows)
    first, three = rows[0], rows[1]
    assert first["output_tokens"] == 16 and first["output_tokens_per_s"] == 4.0 and first["requests_per_s"] == 0.5
    assert first["sequences_fit"] == 6 and first["kv_tokens"] == 37 * 128  # 36 pages besides the null page
    assert three["sequences_fit"] == 30 and three["capacity_vs_stock"] == 5.0
    assert first["ttft_median_s"] == 2.0 and first["ttft_p90_s"] == 2.8 and first["tpot_p90_s"] == pytest.approx(0.28)
    assert (first["max_running"], first["preemptions"], three["max_running"]) == (5, 7, 16)
    assert three["vs_stock"] == 8.0 / 3.0  # 8 tokens/s over the mean of stock's 4 and 2
    table = vllm_memory.markdown({"rows": rows, "requests": 2, "prompt_tokens": 256, "output_tokens": 8,
                                  "dtype": "bfloat16", "kv_cache_bytes": 37 * 30 * 3 * 128 * 256, "stock_seqs": 6},
                                 bench_vllm.markdown_table).splitlines()
    assert "(stock fits 6 whole sequences)" in table[0]
    assert "| 3bit | 23,680 | 30 | 16 | 0 | 8.0 | 2.67 | 1.000 | 1.5 / 1.9 | 200 / 200 |" == table[5]
    no_stock = vllm_memory.compare([dict(three)])
    assert no_stock[0]["vs_stock"] is None and no_stock[0]["capacity_vs_stock"] is None


def test_the_server_gets_the_offline_engines_settings_as_flags():
    settings = vllm_memory.engine_settings("bfloat16", 768, 109_117_440, 64, 2048)
    args = vllm_memory.server_args(settings)
    assert args[args.index("--kv-cache-memory-bytes") + 1] == "109117440"
    assert args[args.index("--max-model-len") + 1] == "768" and "--enforce-eager" in args
    assert len(args) == 3 + 2 * len(settings)


def test_merge_takes_a_later_memory_bound_part_whole_and_keeps_the_other_parts(tmp_path):
    run = {"date": "2026-12-03", "machine": {"load_avg_1_5_15m": [1.0, 1.0, 1.0]}, "versions": {}}

    def part(tokens_per_s: float) -> dict:
        row = {"config": "3bit", "preset": "3bit", "output_tokens_per_s": tokens_per_s}
        return {"dtype": "bfloat16", "rows": [row]}

    old = {**run, "config": {"parts": ["serving", "memory_bound"]}, "serving": [serving_row("stock vLLM", None, 1)],
           "memory_bound": part(10.0), "memory_bound_online": part(9.0)}
    new = {**run, "config": {"parts": ["memory_bound"]}, "memory_bound": part(20.0)}
    merged = bench_vllm.merge([("old", old), ("new", new)])
    assert merged["memory_bound"]["rows"][0]["output_tokens_per_s"] == 20.0
    assert merged["memory_bound_online"]["rows"][0]["output_tokens_per_s"] == 9.0
    assert [r["config"] for r in merged["serving"]] == ["stock vLLM"] and sorted(merged["runs"]) == ["new", "old"]


def test_each_preset_row_is_held_against_its_twin():
    """The target: 1.25x the twin's increase, or 0.05 above it where the twin's is tiny; option rows (anchors=0)
    and presets without a twin get none."""
    rows = [{"config": "stock vLLM", "preset": None, "delta_ppl": 0.0},
            {"config": "int8", "preset": "int8", "delta_ppl": 0.05},
            {"config": "3bit", "preset": "3bit", "delta_ppl": 2.4},
            {"config": "3bit anchors=0", "preset": "3bit", "anchors": 0, "delta_ppl": 2.2},
            {"config": "2bit", "preset": "2bit", "delta_ppl": 9.0}]
    twins = [{"tier": "raw DynamicCache", "delta_ppl": 0.0}, {"tier": "flashcodec int8", "delta_ppl": -0.01},
             {"tier": "flashcodec 3bit", "delta_ppl": 2.0}]
    out = {row["config"]: row for row in bench_vllm.against_twins(rows, twins)}
    assert out["int8"]["target_delta_ppl"] == pytest.approx(0.04) and not out["int8"]["within_target"]
    assert out["3bit"]["target_delta_ppl"] == pytest.approx(2.5) and out["3bit"]["within_target"]
    assert out["3bit"]["twin_delta_ppl"] == 2.0
    for name in ("stock vLLM", "3bit anchors=0", "2bit"):
        assert "within_target" not in out[name]
    table = bench_vllm.quality_markdown({"quality": {"vllm": [{**r, "bits_per_value_bf16": 16.0} for r in rows],
                                                     "flashcodec": [{**t, "kl": 0.0, "ppl": 1.0} for t in twins]}})
    assert "| 3bit | 16.00 |" in table and "| yes |" in table and "| **no** |" in table


def test_a_merge_credits_a_part_to_the_latest_run_that_measured_it():
    """Two runs of an earlier merge both list the throughput part: its rows are the later run's (merging replaced the
    earlier), so a further merge keeps that run, not the first in the list."""
    def run(date: str, parts: list[str]) -> dict:
        return {"date": date, "machine": {"load_avg_1_5_15m": [1.0] * 3}, "versions": {}, "config": {"parts": parts}}

    earlier = {"runs": {"serving": run("2026-12-04T19:00", ["serving", "throughput"]),
                        "tput": run("2026-12-04T22:00", ["throughput"])},
               "serving": [serving_row("stock vLLM", None, 46592)],
               "throughput": throughput_part(("eager", "stock vLLM", 0, 100.0))}
    later = {**run("2026-12-04T23:00", ["memory_bound"]), "memory_bound": {"rows": []}}
    merged = bench_vllm.merge([("vllm", earlier), ("memory", later)])
    assert sorted(merged["runs"]) == ["memory", "serving", "tput"]
    assert bench_vllm.source_run(earlier["runs"], "throughput", None) == "tput"


def test_vllms_fp8_cache_is_a_configuration_beside_stock_not_the_baseline():
    configs = bench_vllm.configurations(["int8", "3bit"], options=False)
    assert [c["name"] for c in configs] == ["stock vLLM", "stock fp8", "int8", "3bit"]
    fp8 = configs[1]
    assert bench_vllm.is_stock(configs[0]) and not bench_vllm.is_stock(fp8) and not bench_vllm.is_stock(configs[2])
    assert bench_vllm.engine_llm(fp8, {"dtype": "float32"}) == {"dtype": "float32", "kv_cache_dtype": "fp8"}
    assert bench_vllm.engine_llm(configs[2], {"dtype": "float32"}) == {"dtype": "float32"}
    assert bench_vllm.page_bits(fp8, 64, torch.bfloat16, 128) == (128, 8.0)  # e4m3 K and V, per-layer scales
    assert bench_vllm.page_bits(configs[0], 64, torch.bfloat16, 128) == (256, 16.0)
    assert [c["name"] for c in bench_vllm.configurations(["int8"], options=False, fp8=False)] == ["stock vLLM", "int8"]
    assert [c["name"] for c in bench_vllm.stock_first_and_last(configs)][-1] == "stock vLLM"


def test_fp8_throughput_is_paired_with_stock_and_does_not_replace_it():
    runs = [{"mode": "eager", "config": c, "preset": p, "kv_cache_dtype": d, "round": r, "tokens_per_s": t}
            for c, p, d, r, t in [("stock vLLM", None, None, 0, 100.0), ("stock fp8", None, "fp8", 0, 95.0),
                                  ("3bit", "3bit", None, 0, 90.0), ("3bit", "3bit", None, 1, 80.0),
                                  ("stock fp8", None, "fp8", 1, 110.0), ("stock vLLM", None, None, 1, 100.0)]]
    rows = {r["config"]: r for r in bench_vllm.throughput_rows(runs)}
    assert rows["stock fp8"]["vs_stock"] == pytest.approx(1.025)
    assert rows["3bit"]["vs_stock"] == pytest.approx(0.85) and rows["stock vLLM"]["vs_stock"] == 1.0


def fake_cpu_attn(monkeypatch, refuse: bool) -> None:
    """vLLM's CPU attention module with an ``_get_attn_isa`` that refuses fp8 (``refuse``) as it does without
    AVX-512 / AMX, or accepts it."""
    import sys
    import types

    def get_attn_isa(dtype, block_size, head_size=None, kv_cache_dtype=None):
        if refuse and kv_cache_dtype and kv_cache_dtype.startswith("fp8"):
            raise NotImplementedError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")
        return "vec"

    module = types.ModuleType("vllm.v1.attention.backends.cpu_attn")
    module._get_attn_isa = get_attn_isa
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.cpu_attn", module)


def test_where_vllm_refuses_fp8_the_row_says_why_and_no_engine_starts(monkeypatch):
    fake_cpu_attn(monkeypatch, refuse=True)
    started = []
    monkeypatch.setattr(bench_vllm, "run_job", lambda job, env, timeout: started.append(job) or {"ok": 1})
    fp8 = dict(bench_vllm.FP8)
    assert bench_vllm.fp8_refusal(fp8, torch.float32) == "vLLM: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    assert bench_vllm.fp8_refusal({"name": "3bit", "preset": "3bit"}, torch.float32) is None
    out, reason = bench_vllm.run_or_skip(fp8, torch.float32, {"llm": {}}, {}, 10)
    assert out is None and "AVX-512" in reason and not started
    out, reason = bench_vllm.run_or_skip({"name": "3bit", "preset": "3bit"}, torch.float32, {"llm": {}}, {}, 10)
    assert out == {"ok": 1} and reason is None and started == [{"llm": {}}]


def test_an_engine_that_fails_to_start_with_fp8_is_a_skip_but_a_presets_failure_raises(monkeypatch):
    fake_cpu_attn(monkeypatch, refuse=False)

    def failing(job, env, timeout):
        raise RuntimeError("vLLM engine job failed (1); error lines:\nNotImplementedError: no fp8 here")

    monkeypatch.setattr(bench_vllm, "run_job", failing)
    out, reason = bench_vllm.run_or_skip(dict(bench_vllm.FP8), torch.float32, {"llm": {}}, {}, 10)
    assert out is None and reason.startswith("the engine failed: vLLM engine job failed")
    with pytest.raises(RuntimeError, match="no fp8 here"):
        bench_vllm.run_or_skip({"name": "3bit", "preset": "3bit"}, torch.float32, {"llm": {}}, {}, 10)


def test_skipped_rows_show_their_reason_in_every_table():
    reason = "vLLM: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    skipped = bench_vllm.skipped_row(dict(bench_vllm.FP8), reason)
    serving = bench_vllm.compare_serving([serving_row("stock vLLM", None, 46592), dict(skipped),
                                          serving_row("3bit", "3bit", 233856)])
    part = throughput_part(("eager", "stock vLLM", 0, 100.0), ("eager", "3bit", 0, 90.0))
    table = bench_vllm.serving_markdown({"serving": serving, "throughput": {**part, "skipped": {"stock fp8": reason}}})
    fp8_line = table.splitlines()[3]
    assert fp8_line.startswith("| stock fp8 |") and "| skipped | - |" in fp8_line and "AVX-512" in fp8_line
    quality = bench_vllm.compare_quality([{"config": "stock vLLM", "preset": None, "ppl": 20.0,
                                           "bits_per_value_bf16": 16.0}, dict(skipped)])
    table = bench_vllm.quality_markdown({"quality": {"vllm": quality, "flashcodec": []}})
    assert "| stock fp8 | - | - | - | - | - | skipped (vLLM: FP8 KV cache on CPU requires x86" in table
    stock = vllm_memory.load_row({"name": "stock vLLM", "preset": None},
                                 load_figures([1.0], [0.1], 4.0, 5, 0), blocks=37, seq_tokens=768)
    rows = vllm_memory.compare([stock, dict(skipped)])
    table = vllm_memory.markdown({"rows": rows, "requests": 1, "prompt_tokens": 256, "output_tokens": 8,
                                  "dtype": "float32", "kv_cache_bytes": 2**20, "stock_seqs": 1},
                                 bench_vllm.markdown_table)
    assert "| stock fp8 | - | - | - | - | - | - | - | skipped (vLLM: FP8" in table


def test_a_merge_puts_stock_first_then_vllms_fp8_then_the_presets(tmp_path):
    run = {"date": "2026-12-06", "machine": {"load_avg_1_5_15m": [1.0] * 3}, "versions": {}, "config": {}}
    fp8 = {**serving_row("stock fp8", None, 183544), "kv_cache_dtype": "fp8"}
    old = {**run, "serving": [serving_row("3bit", "3bit", 233856)]}
    new = {**run, "serving": [fp8, serving_row("stock vLLM", None, 93184)]}
    merged = bench_vllm.merge([("old", old), ("new", new)])
    assert [r["config"] for r in merged["serving"]] == ["stock vLLM", "stock fp8", "3bit"]
    assert merged["serving"][1]["capacity_vs_stock"] == pytest.approx(183544 / 93184)


def test_cpu_time_ratios_pair_rounds_as_the_wall_time_ones_and_show_beside_them():
    runs = [{"mode": "eager", "config": c, "preset": p, "round": r, "tokens_per_s": t, "tokens_per_cpu_s": u}
            for c, p, r, t, u in [("stock vLLM", None, 0, 100.0, 200.0), ("3bit", "3bit", 0, 80.0, 190.0),
                                  ("3bit", "3bit", 1, 99.0, 210.0), ("stock vLLM", None, 1, 90.0, 200.0)]]
    rows = {r["config"]: r for r in bench_vllm.throughput_rows(runs)}
    assert rows["3bit"]["vs_stock_cpu"] == pytest.approx(1.0) and rows["3bit"]["vs_stock_cpu_range"] == [0.95, 1.05]
    assert rows["3bit"]["vs_stock"] == pytest.approx((0.8 + 1.1) / 2)
    old = [{k: v for k, v in r.items() if k != "tokens_per_cpu_s"} for r in runs]  # runs from before CPU time
    assert all(r["vs_stock_cpu"] is None for r in bench_vllm.throughput_rows(old))
    serving = bench_vllm.compare_serving([serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 1)])
    table = bench_vllm.serving_markdown({"serving": serving, "throughput": {"rows": list(rows.values())}})
    assert "| 90 | 0.95 | 1.00 |" in table.splitlines()[3]


def test_the_engines_cpu_time_counts_this_process_and_its_children():
    import subprocess
    import sys
    import time

    import vllm_engine

    before = vllm_engine.tree_cpu_seconds()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\ntime.sleep(5)"])
    try:
        for _ in range(50):  # the child's busy 0.3 s, counted while it lives
            if vllm_engine.tree_cpu_seconds() - before >= 0.25:
                break
            time.sleep(0.1)
        assert vllm_engine.tree_cpu_seconds() - before >= 0.25
    finally:
        child.kill()
        child.wait()
