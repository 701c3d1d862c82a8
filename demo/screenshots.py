"""Drive the demo app in a real headless Chromium: the browser test's driver, and the README's screenshots.

    python demo/screenshots.py [--model PATH] [--out benchmarks/results] [--max-new 64] [--compare-tokens 32]

starts ``python demo/app.py`` (the real SmolLM2-135M by default) on a free local port, sends one chat turn, runs
the full comparison, opens the Frontier tab, and saves ``demo_chat.png``, ``demo_compare.png`` and
``demo_frontier.png`` into ``--out``. Needs Debian's ``chromium`` (``apt-get install chromium``) and the
``playwright`` package; the system browser is used, nothing downloads one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
FINISHED = r"/finished|not run:|failed:/"  # the status lines the app ends a chat turn or a comparison with
VIEWPORT = {"width": 1440, "height": 1000}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningApp:
    """The app's process, its URL and the seconds from starting the process to its "ready" line."""

    process: subprocess.Popen
    url: str
    startup_s: float
    log: list[str]


@contextlib.contextmanager
def running_app(model: str | None, port: int | None = None, timeout: float = 300.0, extra: tuple[str, ...] = (),
                env: dict[str, str] | None = None) -> Iterator[RunningApp]:
    """Start ``python demo/app.py`` on 127.0.0.1 (``extra`` flags, ``env`` added to the environment) and yield once
    it prints its "ready" line; stop it afterwards. Raises RuntimeError with the app's output when it exits or is
    not ready within ``timeout`` seconds."""
    port = port or free_port()
    command = [sys.executable, str(HERE / "app.py"), "--host", "127.0.0.1", "--port", str(port), *extra]
    if model is not None:
        command += ["--model", str(model)]
    path = os.pathsep.join(filter(None, [str(HERE.parent), os.environ.get("PYTHONPATH")]))  # this checkout's package
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1", PYTHONPATH=path, **(env or {}))
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    try:
        while True:
            line = process.stdout.readline()
            if not line:
                raise RuntimeError(f"demo/app.py exited ({process.wait()}) before it was ready:\n" + "".join(log[-30:]))
            log.append(line)
            if "ready in" in line:
                url = line.rsplit(" at ", 1)[-1].strip()
                break
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"demo/app.py not ready after {timeout:.0f} s:\n" + "".join(log[-30:]))
        yield RunningApp(process, url, time.perf_counter() - start, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_startup(model: str | None, env: dict[str, str] | None = None) -> dict[str, float]:
    """Start the app, stop it once ready: ``wall_s`` to its "ready" line and ``cpu_s``, the CPU time the app's
    process used in all (user + system, every thread; it idles once ready), which does not depend on how busy a
    shared machine is."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with running_app(model, env=env) as app:
        wall = app.startup_s
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1)}


@contextlib.contextmanager
def browser_page(url: str) -> Iterator[Any]:
    """A Playwright page of headless Debian Chromium on ``url``, once the app's tabs are rendered."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.goto(url)
            page.wait_for_selector("#chat-send", timeout=60_000)
            yield page
        finally:
            browser.close()


def open_tab(page: Any, tab: str) -> None:
    """Click the tab ``tab`` (``chat``, ``compare``, ``frontier``)."""
    page.click(f'button[role="tab"][data-tab-id="{tab}"]')


def _click_and_wait(page: Any, button: str, status: str, timeout_s: float) -> str:
    """Click ``button`` and wait until the ``status`` element reports a later run than before that has finished
    (or was not run, or failed); returns its text. The app starts every status line with "run N"."""
    last_run = "(el) => Math.max(0, ...[...el.innerText.matchAll(/run (\\d+)/g)].map((m) => Number(m[1])))"
    before = page.eval_on_selector(status, last_run)
    page.click(button)
    page.wait_for_function(f"""([selector, before]) => {{ const el = document.querySelector(selector);
        return ({last_run})(el) > before && {FINISHED}.test(el.innerText); }}""", arg=[status, before],
                           timeout=timeout_s * 1e3)
    return page.inner_text(status)


def _set_number(page: Any, selector: str, value: int) -> None:
    box = page.locator(f"{selector} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def _image_sizes(page: Any, selector: str) -> list[tuple[float, float]]:
    boxes = [img.bounding_box() for img in page.query_selector_all(f"{selector} img")]
    return [(box["width"], box["height"]) for box in boxes if box]


def run_chat(page: Any, prompt: str, max_new: int, timeout_s: float = 600.0) -> dict[str, Any]:
    """Send ``prompt`` to both panels and wait for the turn to finish. Returns what a person sees: each panel's
    answer, both stats rows, the status line, and how many times the right panel's text changed while streaming."""
    open_tab(page, "chat")
    _set_number(page, "#chat-max-new", max_new)
    page.fill("#chat-prompt textarea", prompt)
    page.evaluate("""() => { window.__fxMutations = 0;
        new MutationObserver(() => { window.__fxMutations += 1; })
            .observe(document.querySelector('#chat-right'), {subtree: true, childList: true, characterData: true}); }""")
    start = time.perf_counter()
    status = _click_and_wait(page, "#chat-send", "#chat-status", timeout_s)
    answers = {side: [m.inner_text() for m in page.query_selector_all(f'#chat-{side} [data-testid="bot"]')] or [""]
               for side in ("left", "right")}
    return {"status": status, "seconds": time.perf_counter() - start, "left": answers["left"][-1],
            "right": answers["right"][-1], "left_stats": page.inner_text("#stats-left"),
            "right_stats": page.inner_text("#stats-right"), "right_mutations": page.evaluate("window.__fxMutations")}


def run_comparison(page: Any, prompt: str, new_tokens: int, timeout_s: float = 900.0) -> dict[str, Any]:
    """Run every tier on ``prompt`` from the Full comparison tab; returns the status, the table (headers, rows of
    cell texts) and the rendered size of each chart's image."""
    open_tab(page, "compare")
    _set_number(page, "#compare-tokens", new_tokens)
    page.fill("#compare-prompt textarea", prompt)
    start = time.perf_counter()
    status = _click_and_wait(page, "#compare-run", "#compare-status", timeout_s)
    if "finished" in status:  # the last update carries the whole table and the charts: wait until they are drawn
        page.wait_for_function("""() => { const grid = document.querySelector('#compare-table [role="grid"]');
            const rows = document.querySelectorAll('#compare-table [role="row"]:has([role="gridcell"])').length;
            return grid && rows > 0 && rows === Number(grid.getAttribute('aria-rowcount')) - 1
                && document.querySelectorAll('#compare-storage img, #compare-speed img, #compare-quality img').length === 3;
        }""", timeout=60_000)
    headers = [span.inner_text().strip() for span in page.query_selector_all("#compare-table thead th span")]
    cells = '[role="gridcell"]'  # Gradio's data grid: a div row of gridcells per table row
    rows = [[cell.inner_text().strip() for cell in row.query_selector_all(cells)]
            for row in page.query_selector_all('#compare-table [role="row"]') if row.query_selector(cells)]
    charts = {key: _image_sizes(page, f"#compare-{key}") for key in ("storage", "speed", "quality")}
    return {"status": status, "seconds": time.perf_counter() - start, "headers": headers, "rows": rows, "charts": charts}


def open_frontier(page: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Open the Frontier tab; returns each chart's note text and rendered image sizes."""
    open_tab(page, "frontier")
    page.wait_for_selector("#frontier-kl-note h3", timeout=timeout_s * 1e3)
    with contextlib.suppress(Exception):  # a chart that is not drawn has no image: its note says why
        page.wait_for_selector("#frontier-kl img", timeout=timeout_s * 1e3)
    return {key: {"note": page.inner_text(f"#frontier-{key}-note"), "images": _image_sizes(page, f"#frontier-{key}")}
            for key in ("kl", "speed", "memory")}


def screenshot(page: Any, path: Path) -> Path:
    """Save the whole page as ``path``: a 256-colour PNG (a third of the bytes of Chromium's RGB one)."""
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    with Image.open(path) as image:
        small = image.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    small.save(path, optimize=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model folder for the app (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--out", type=Path, default=HERE.parent / "benchmarks" / "results")
    parser.add_argument("--prompt", default="Explain to a curious twelve-year-old how a refrigerator keeps food cold.")
    parser.add_argument("--max-new", type=int, default=64, help="chat turn's max new tokens")
    parser.add_argument("--compare-tokens", type=int, default=32, help="new tokens per tier in the comparison")
    parser.add_argument("--cold", action="store_true", help="also time a start with an empty model cache "
                        "(FLASHCODEC_CACHE in a temporary folder: the bundled GGUF is converted again)")
    args = parser.parse_args(argv)
    sys.path[:0] = [str(HERE.parent), str(HERE.parent / "benchmarks")]  # this checkout's package and its commit
    from common import write_result

    record: dict[str, Any] = {"model": args.model or "SmolLM2-135M-Instruct", "prompt": args.prompt}
    staging = Path(tempfile.mkdtemp(prefix="demo_screenshots-"))  # moved into --out after the JSON records the commit
    if args.cold:
        with tempfile.TemporaryDirectory() as empty:
            record["startup_cold"] = measure_startup(args.model, env={"FLASHCODEC_CACHE": empty})
        print(f"cold start (model converted into an empty cache): {record['startup_cold']}")
    record["startup_warm"] = measure_startup(args.model)
    print(f"warm start: {record['startup_warm']}")
    with running_app(args.model) as app, browser_page(app.url) as page:
        print(f"app ready in {app.startup_s:.1f} s: {app.log[-1].strip()}")
        chat = run_chat(page, args.prompt, args.max_new)
        record["chat"] = {k: round(v, 1) if isinstance(v, float) else v for k, v in chat.items()} | {"max_new": args.max_new}
        print(f"chat: {chat['status']} in {chat['seconds']:.1f} s\n  left:  {chat['left'][:200]!r}\n"
              f"  right: {chat['right'][:200]!r}\n  right stats: {chat['right_stats']!r}")
        print(f"wrote {screenshot(page, staging / 'demo_chat.png')}")
        compare = run_comparison(page, args.prompt, args.compare_tokens)
        record["comparison"] = {"status": compare["status"], "seconds": round(compare["seconds"], 1),
                                "new_tokens": args.compare_tokens, "headers": compare["headers"], "rows": compare["rows"]}
        print(f"comparison: {compare['status']} in {compare['seconds']:.1f} s, {len(compare['rows'])} rows")
        print(f"wrote {screenshot(page, staging / 'demo_compare.png')}")
        frontier = open_frontier(page)
        print("frontier: " + ", ".join(f"{key} {len(v['images'])} image(s)" for key, v in frontier.items()))
        print(f"wrote {screenshot(page, staging / 'demo_frontier.png')}")
    print(f"wrote {write_result('demo_screenshots', record, out=args.out / 'demo_screenshots.json')}")
    for shot in sorted(staging.glob("*.png")):
        print(f"wrote {shutil.move(shot, args.out / shot.name)}")
    staging.rmdir()


if __name__ == "__main__":
    main()
