"""``flashcodec run``: the main job. A real model (SmolLM2-135M-Instruct, offline) generating greedily with the raw
cache and each compressed-KV tier; the table goes to stdout row by row, a progress bar per tier to stderr, and the
full results (every column, the tokens, the run's provenance) to ``--out FILE`` as JSON. Nothing else is written."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from . import main_job
from .errors import CLIError

DTYPES = ("float32", "bfloat16", "float16")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run", help="the main job: generate with the raw cache and each compressed-KV tier, print the comparison",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="tiers: " + ", ".join(main_job.available_tiers()) + f" (default: {', '.join(main_job.default_tier_names())})")
    parser.add_argument("--model", default=None, metavar="PATH_OR_ID",
                        help="a local folder saved with save_pretrained, a .gguf file, or a hub id already in the local "
                             "Hugging Face cache (default: the bundled SmolLM2-135M-Instruct; nothing is downloaded)")
    parser.add_argument("--tiers", default=None, metavar="A,B,...",
                        help="comma-separated tiers to run after the raw reference (see the list below)")
    parser.add_argument("--preset", action="append", default=None, metavar="NAME",
                        help="add one tier or preset by name (repeatable; combines with --tiers)")
    parser.add_argument("--prompt", default=main_job.DEFAULT_PROMPT, help="user message (sent through the chat template)")
    parser.add_argument("--new-tokens", type=int, default=64, metavar="N", help="tokens generated per tier (default 64)")
    parser.add_argument("--device", default="cpu", help="torch device (default cpu)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="model and cache dtype (default float32)")
    parser.add_argument("--threads", default="auto", metavar="auto|N",
                        help="torch CPU threads (default auto: torch's default on a quiet machine, fewer, down to one, "
                             "for the cores other processes keep busy, checked again before each tier; "
                             "flashcodec_fx/threads.py)")
    parser.add_argument("--out", default=None, metavar="FILE", help="write the full results as JSON to FILE")
    parser.set_defaults(handler=run)


def _tier_names(args: argparse.Namespace) -> list[str]:
    names = [] if args.tiers is None else [n.strip() for n in args.tiers.split(",") if n.strip()]
    names += args.preset or []
    return names or main_job.default_tier_names()


def _check(args: argparse.Namespace) -> None:
    if args.new_tokens < 2:
        raise CLIError(f"--new-tokens must be >= 2, got {args.new_tokens}")
    from ..threads import parse_threads

    try:
        args.threads = parse_threads(args.threads)
    except ValueError as err:
        raise CLIError(f"--{err}") from None
    if args.out is not None and Path(args.out).is_dir():
        raise CLIError(f"--out {args.out!r} is a folder; give a file name, e.g. {Path(args.out) / 'main_job.json'}")
    import torch

    try:
        device = torch.device(args.device)
    except RuntimeError as err:
        raise CLIError(f"--device {args.device!r} is not a torch device ({err})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device}: no CUDA device on this machine (torch {torch.__version__})")


HOW_TO_POINT = ("pass a folder saved with save_pretrained (config.json, weights, tokenizer) or a .gguf file, or leave "
                "--model out for the bundled SmolLM2-135M-Instruct")


def _model_not_found(name: str | None, err: Exception) -> CLIError:
    """One line: what was looked for, and how to point at a local model."""
    if name is None:
        return CLIError(f"the bundled model is not available: {err}")
    reason = str(err).split(": ", 1)[-1].split("\n")[0]
    if "Hugging Face cache" in reason:
        from huggingface_hub.constants import HF_HUB_CACHE

        return CLIError(f"--model {name!r}: no folder or .gguf file of that name here, and no hub model {name!r} in the "
                        f"local Hugging Face cache ({HF_HUB_CACHE}); nothing is downloaded: {HOW_TO_POINT}")
    return CLIError(f"--model {name!r}: {reason}: {HOW_TO_POINT}")


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    import torch

    from ..pretrained import load_pretrained

    try:
        return load_pretrained(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    except ValueError as err:
        raise _model_not_found(args.model, err) from None


def prompt_ids(tokenizer: Any, prompt: str) -> Any:
    """``(1, P)`` int64 ids of ``prompt`` as a user chat turn (the tokenizer's chat template when it has one)."""
    import torch

    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    return ids.to(torch.int64)


def _progress_bar(tier: Any, total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=tier.name, unit="step", file=sys.stderr, leave=True, mininterval=0.5)


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    _check(args)
    try:
        tiers = main_job.resolve_tiers(_tier_names(args))
    except ValueError as err:
        raise CLIError(f"--tiers / --preset: {err}") from None
    from ..threads import apply_threads

    choice = apply_threads(args.threads)
    model, tokenizer = _load(args)
    ids = prompt_ids(tokenizer, args.prompt).to(args.device)
    name = args.model or "SmolLM2-135M-Instruct"
    print(f"flashcodec run: {name} ({model.config.num_hidden_layers} layers, {args.dtype}, {args.device}, "
          f"{choice.threads} CPU threads, --threads {choice.setting}: {choice.reason}); prompt {ids.shape[1]} tokens, "
          f"{args.new_tokens} new tokens per tier; tiers: {', '.join(t.name for t in tiers)}", flush=True)
    kernels = main_job.prepare_kernels(args.device)
    if kernels is not None:
        print(kernels[0], flush=True)
    header, separator = main_job.markdown_rows([], main_job.COLUMNS)
    print(header, separator, sep="\n", flush=True)
    rows, choices = [], [choice.as_dict()]
    for result in main_job.measure(model, ids, args.new_tokens, tiers, _progress_bar):
        rows.append(result)
        print(main_job.markdown_rows([result], main_job.COLUMNS)[2], flush=True)
        if args.threads == "auto" and len(rows) < len(tiers):  # the machine's load changes: look again
            again = apply_threads("auto")
            if again.threads != choices[-1]["threads"]:
                print(f"flashcodec run: {again.threads} CPU threads from the next tier on ({again.reason})",
                      file=sys.stderr, flush=True)
            choices.append(again.as_dict())
    for result in (rows[0], rows[-1]) if len(rows) > 1 else rows:  # the raw text and the last tier's
        text = tokenizer.decode(result["tokens"], skip_special_tokens=True)
        print(f"\n--- {result['tier']} ---\n{text}", flush=True)
    wall = time.perf_counter() - started
    if args.out is None:
        print(f"\n{wall:.0f} s in all; run with --out FILE to keep the JSON (every column, tokens, provenance)")
        return 0
    from ..provenance import write_json

    path = write_json(args.out, "main_job", {
        "model": name, "dtype": args.dtype, "device": args.device, "threads": choice.threads,
        "thread_policy": {"setting": choice.setting, "choices": choices},
        "kernel_build_s": None if kernels is None else kernels[1],
        "prompt": args.prompt, "prompt_tokens": ids.shape[1], "new_tokens": args.new_tokens,
        "tiers": [t.name for t in tiers], "wall_s": wall,
        "method": "greedy decode per tier (prefill exact, then token by token); NLL/ppl/KL: the raw cache's "
                  "continuation teacher-forced token by token through each tier's cache, all positions scored; "
                  "KL in float64 from fp32 log-probs, clamped at 0, kl_noise_floor: its fp32 rounding bound; "
                  "kv_bytes: archive (filled blocks incl. scales/indices) + raw tail; held_bytes: everything held; "
                  "seconds: the tier's wall time (prefill, decode, teacher forcing), the CPU kernels built before "
                  "the first tier; threads: each row's torch threads (--threads auto checks the machine again "
                  "before each tier: thread_policy)",
        "rows": rows,
    })
    print(f"\n{wall:.0f} s in all; full results: {Path(path)}")
    return 0
