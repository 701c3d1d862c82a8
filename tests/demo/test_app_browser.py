"""The demo app in a real browser: ``python demo/app.py`` on a free local port with a tiny random-init model,
driven by headless Debian Chromium through Playwright (the system browser; nothing downloads one).

Asserts what a person sees: text streaming into both chat panels, numbers in both stats rows, a message instead of
a traceback for an over-long request, one comparison row per tier, charts with a non-zero rendered size. Saves a
screenshot of each tab (into a temporary folder, printed; the README's screenshots come from the real model through
``python demo/screenshots.py``). Skipped when chromium or playwright (or the [demo] extra) is missing, unless
``FLASHCODEC_REQUIRE_BROWSER=1`` (set by .ci/run): then it fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "demo"
sys.path.insert(0, str(DEMO))

import screenshots  # noqa: E402
from conftest import save_tiny_model  # noqa: E402

MISSING = [what for what, absent in (
    (f"Debian's chromium ({screenshots.CHROMIUM}; apt-get install chromium)", not Path(screenshots.CHROMIUM).exists()),
    ("playwright (pip install playwright, in the [dev] extra)", importlib.util.find_spec("playwright") is None),
    ("gradio (the [demo] extra)", importlib.util.find_spec("gradio") is None),
    ("matplotlib (the [demo] extra)", importlib.util.find_spec("matplotlib") is None),
) if absent]
if MISSING and os.environ.get("FLASHCODEC_REQUIRE_BROWSER") == "1":
    pytest.fail("FLASHCODEC_REQUIRE_BROWSER=1 but the browser test cannot run: missing " + ", ".join(MISSING),
                pytrace=False)
pytestmark = pytest.mark.skipif(bool(MISSING), reason="browser test needs " + ", ".join(MISSING))

BYTES = r"\d+(\.\d+)? (B|KiB|MiB|GiB)"
CHAT_TOKENS = 120  # long enough to see the text change many times while it streams


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo_screenshots")


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_model")
    save_tiny_model(folder)
    with screenshots.running_app(str(folder), timeout=240) as app, screenshots.browser_page(app.url) as page:
        print(f"\napp ready in {app.startup_s:.1f} s (tiny model)")
        yield page


def test_chat_turn_streams_into_both_panels_with_stats(page, shots):
    seen = screenshots.run_chat(page, "the quick brown fox", CHAT_TOKENS)
    assert "finished" in seen["status"], seen["status"]
    assert seen["left"].strip() and seen["right"].strip()
    assert seen["right_mutations"] >= 5, "the right panel's text should change many times while tokens stream"
    for stats in (seen["left_stats"], seen["right_stats"]):
        assert re.search(rf"kept {BYTES}", stats) and re.search(rf"peak {BYTES}", stats), stats
        assert re.search(r"\d+\.\d ms/token", stats) and re.search(r"\d+\.\d\d bits/value", stats), stats
        assert re.search(rf"tokens\s+{CHAT_TOKENS}\b", stats), stats
    assert "32.00 bits/value" in seen["left_stats"]  # the native fp32 cache
    bits = float(re.search(r"(\d+\.\d\d) bits/value", seen["right_stats"]).group(1))
    assert bits < 32  # the default tier, jpeg K=8 int8, stores fewer bits
    assert re.search(rf"\d+/{CHAT_TOKENS} tokens identical", seen["right_stats"]), seen["right_stats"]
    print(screenshots.screenshot(page, shots / "demo_chat.png"))


def test_over_long_request_shows_a_message_not_a_traceback(page):
    before = len(page.query_selector_all('#chat-right [data-testid="bot"]'))
    seen = screenshots.run_chat(page, "x" * 40, 512)  # the tiny model has 512 positions
    assert "not run:" in seen["status"] and "512 positions" in seen["status"], seen["status"]
    assert "Traceback" not in page.inner_text("body")
    assert len(page.query_selector_all('#chat-right [data-testid="bot"]')) == before


def test_comparison_table_has_a_row_per_tier_and_three_charts(page, shots):
    from side_by_side import codec_tiers

    seen = screenshots.run_comparison(page, "the quick brown fox", 8)
    assert "finished" in seen["status"], seen["status"]
    assert [row[0] for row in seen["rows"]] == ["raw DynamicCache", *(t.name for t in codec_tiers())]
    assert {"KV kept", "bits/value", "decode tok/s", "NLL", "KL vs native", "token match"} <= set(seen["headers"])
    for row in seen["rows"]:
        assert all(cell and cell != "-" for cell in row), row
    for key, images in seen["charts"].items():
        assert len(images) == 1 and min(images[0]) > 50, (key, images)
    print(screenshots.screenshot(page, shots / "demo_compare.png"))


def test_frontier_tab_draws_the_committed_benchmark_json(page, shots):
    seen = screenshots.open_frontier(page)
    for key, chart in seen.items():
        assert "source:" in chart["note"] and "Not drawn" not in chart["note"], (key, chart["note"])
        assert len(chart["images"]) == 1 and min(chart["images"][0]) > 50, (key, chart["images"])
    print(screenshots.screenshot(page, shots / "demo_frontier.png"))
