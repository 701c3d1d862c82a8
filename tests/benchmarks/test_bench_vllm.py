"""bench_vllm's bookkeeping (no vLLM needed): the throughput cells of the serving table and ``--merge``."""

from __future__ import annotations

import json

import bench_vllm


def serving_row(config: str, preset: str | None, kv_tokens: int) -> dict:
    greedy = [{"ids": [1, 2, 3], "top2": [[-0.1, -2.0]] * 3}]
    return {"config": config, "preset": preset, "kv_tokens": kv_tokens, "bits_per_value": 16.0,
            "concurrent": {"4160": kv_tokens // 4224}, "greedy": greedy}


def throughput_part(stock: list[float], preset: float) -> dict:
    rows = [{"config": "stock vLLM", "preset": None, "tokens_per_s": t} for t in stock]
    rows.insert(1, {"config": "3bit", "preset": "3bit", "tokens_per_s": preset})
    for row in rows:
        row["vs_stock"] = row["tokens_per_s"] / (sum(stock) / len(stock))
    return {"dtype": "float32", "rows": rows}


def test_the_serving_table_shows_each_throughput_run_and_dashes_without_one():
    rows = bench_vllm.compare_serving([serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 233856),
                                       serving_row("int8", "int8", 90368)])
    result = {"serving": rows, "throughput": throughput_part([100.0, 110.0], 126.0)}
    table = bench_vllm.serving_markdown(result).splitlines()
    stock, three, int8 = table[2], table[3], table[4]
    assert "| 100 / 110 | 0.95 / 1.05 |" in stock
    assert "| 126 | 1.20 |" in three
    assert "| - | - |" in int8
    assert "| 5.02 |" in three  # capacity vs stock


def test_merge_keeps_one_row_per_configuration_the_later_part_replacing_the_earlier(tmp_path):
    run = {"date": "2026-12-02", "machine": {"load_avg_1_5_15m": [1.0, 1.0, 1.0]}, "versions": {}, "config": {}}
    old = {**run, "serving": [serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 100)]}
    new = {**run, "serving": [serving_row("3bit", "3bit", 233856)], "throughput": throughput_part([100.0], 90.0)}
    paths = [tmp_path / "old.json", tmp_path / "new.json"]
    for path, part in zip(paths, (old, new), strict=True):
        path.write_text(json.dumps(part))
    out = tmp_path / "merged.json"
    bench_vllm.main(["--merge", *map(str, paths), "--out", str(out)])
    merged = json.loads(out.read_text())
    assert [r["config"] for r in merged["serving"]] == ["stock vLLM", "3bit"]
    assert merged["serving"][1]["kv_tokens"] == 233856
    assert merged["serving"][1]["capacity_vs_stock"] == 233856 / 46592
    assert merged["throughput"]["rows"][1]["vs_stock"] == 0.9
    assert sorted(merged["runs"]) == ["new", "old"]


def test_a_throughput_run_without_stock_shows_its_speed_and_no_ratio():
    rows = bench_vllm.compare_serving([serving_row("stock vLLM", None, 46592), serving_row("3bit", "3bit", 233856)])
    part = {"rows": [{"config": "3bit", "preset": "3bit", "tokens_per_s": 126.0, "vs_stock": None}]}
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
