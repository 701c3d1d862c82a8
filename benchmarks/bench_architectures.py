"""flashcodec's conformance over every transformers CausalLM architecture (flashcodec_fx/evaluate/architectures.py).

    python benchmarks/bench_architectures.py                    # all of them, 2 processes -> results/architectures.json
    python benchmarks/bench_architectures.py --models llama,gemma2 --out /tmp/a.json
    python benchmarks/readme_tables.py                          # then: docs/architectures.md's table from the JSON

Each architecture of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` gets a tiny random-init model, run through
``apply_flash_codec(model, preset=...)`` as a new user would, and every check of ``architectures.CHECKS`` (lossless
tokens: greedy, left-padded batch, beam; ``remove_flash_codec``; int8 / 4bit / 2bit logits and compression; codec
layer placement; no fallback warning) records pass / fail / skip with its reason. Workers are separate processes, one
torch thread each (``--jobs``), each running a group of architectures; a worker that crashes or runs past
``--timeout`` seconds on one architecture records it as failed and a fresh worker takes the rest of its group.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STATUS_CELL = {"pass": "pass", "fail": "FAIL", "skip": "skip"}


def worker(models: list[str], timeout: int) -> None:
    """Run each architecture in this process; one JSON line per architecture on stdout."""
    import torch

    torch.set_num_threads(1)
    from flashcodec_fx.evaluate.architectures import run_architecture

    def alarm(signum, frame):
        raise TimeoutError(f"more than {timeout} s")

    signal.signal(signal.SIGALRM, alarm)
    for model_type in models:
        print(json.dumps({"started": model_type}), flush=True)
        signal.alarm(timeout)
        try:
            result = run_architecture(model_type)
        except TimeoutError as err:
            result = {"model_type": model_type, "status": "error", "reason": f"TimeoutError: {err}", "checks": {}}
        finally:
            signal.alarm(0)
        for rec in result.get("checks", {}).values():  # the key names the check
            rec.pop("check", None)
        print(json.dumps({"result": result}, default=str), flush=True)


def _run_group(models: list[str], timeout: int, log: Any) -> dict[str, dict]:
    """Run ``models`` in worker processes until each has a result (a crashed worker's current one is an error)."""
    results: dict[str, dict] = {}
    left = list(models)
    while left:
        proc = subprocess.Popen([sys.executable, __file__, "--worker", ",".join(left), "--timeout", str(timeout)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE.parent,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        current = None
        for line in proc.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "started" in message:
                current = message["started"]
            elif "result" in message:
                result = message["result"]
                results[result["model_type"]] = result
                log(result)
                current = None
        stderr = proc.stderr.read()
        proc.wait()
        left = [m for m in left if m not in results]
        if current is not None and current in left:
            tail = (stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            results[current] = {"model_type": current, "status": "error", "checks": {},
                                "reason": f"worker died (exit {proc.returncode}): {tail[:300]}"}
            log(results[current])
            left.remove(current)
        elif left and proc.returncode != 0:
            tail = (stderr.strip().splitlines() or [""])[-1]
            for m in left:
                results[m] = {"model_type": m, "status": "error", "checks": {}, "reason": f"worker failed: {tail}"}
            left = []
    return results


def run(models: list[str], jobs: int, timeout: int) -> dict[str, dict]:
    from concurrent.futures import ThreadPoolExecutor

    groups = [models[i::jobs] for i in range(jobs)]
    start = time.perf_counter()

    def log(result: dict) -> None:
        checks = result.get("checks", {})
        failed = [n for n, r in checks.items() if r["status"] == "fail"]
        state = result["status"] if result["status"] != "run" else ("FAIL " + ",".join(failed) if failed else "pass")
        print(f"[{time.perf_counter() - start:6.0f} s] {result['model_type']:28} {state} "
              f"{result.get('reason', '')[:120]}", flush=True)

    with ThreadPoolExecutor(jobs) as pool:
        parts = list(pool.map(lambda g: _run_group(g, timeout, log), [g for g in groups if g]))
    merged = {k: v for part in parts for k, v in part.items()}
    return {m: merged[m] for m in models}


def summary(results: dict[str, dict], checks: list[str]) -> dict[str, Any]:
    ran = [r for r in results.values() if r["status"] == "run"]
    per_check = {c: {s: sum(r["checks"].get(c, {}).get("status") == s for r in ran) for s in STATUS_CELL}
                 for c in checks}
    return {"architectures": len(results), "run": len(ran),
            "skipped": sum(r["status"] == "skip" for r in results.values()),
            "errors": sum(r["status"] == "error" for r in results.values()),
            "all_pass": sorted(r["model_type"] for r in ran
                               if all(x["status"] != "fail" for x in r["checks"].values())),
            "per_check": per_check}


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


CELL_CHARS = 90


def _cell(rec: dict | None) -> str:
    if rec is None:
        return "-"
    status = STATUS_CELL[rec["status"]]
    if rec["status"] == "pass":
        return status
    reason = _escape(rec.get("reason", ""))
    if len(reason) > CELL_CHARS:
        reason = reason[: CELL_CHARS - 3].rstrip() + "..."
    return f"{status}: {reason}" if reason else status


def cause(result: dict, rec: dict) -> str:
    """A failure's cause, the same words for every architecture it hits (class names, counts, positions and
    measured values taken out)."""
    import re

    reason = rec.get("reason", "")
    nested = re.match(r"no lossy run completed \((?:\w+): (.*)\)$", reason)
    if nested:
        reason = nested.group(1)
    if " differ: " in reason or reason.endswith(" differ"):
        return "lossless: tokens differ from the native model's"
    if " > " in reason and ("KL " in reason or "logit diff" in reason):
        return "lossy logits outside LOGIT_BOUNDS"
    if reason.startswith("silent no-op"):
        return "silent no-op: no codec layer on any layer that holds K/V"
    if "hold K/V natively but got no codec layer" in reason:
        kinds = sorted(set(re.findall(r"\d+ \((\w+)\)", reason.split(" hold K/V")[0])))
        return f"K/V layers left without a codec layer ({', '.join(kinds)})"
    if re.match(r"(int8|4bit|2bit)(, (int8|4bit|2bit))*: ", reason):  # stored_form: the warning
        reason = reason.split(": ", 1)[1]
    if reason.startswith("NoCodecLayers: "):
        return "NoCodecLayers warned: flashcodec compresses nothing (no layer kind of the model carries a codec)"
    for name in (result.get("model_class"), result.get("config_class")):
        if name:
            reason = reason.replace(name, "<model>")
    reason = re.sub(r"\b[A-Z]\w*Config\b", "<config>", reason)
    reason = re.sub(r"\d+", "N", reason)
    return reason[:160]


def failures_by_cause(result: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """cause -> {architecture: [failed checks]} over every architecture run."""
    causes: dict[str, dict[str, list[str]]] = {}
    for name, res in result["architectures"].items():
        for check, rec in res.get("checks", {}).items():
            if rec["status"] == "fail":
                causes.setdefault(cause(res, rec), {}).setdefault(name, []).append(check)
    return dict(sorted(causes.items(), key=lambda kv: -len(kv[1])))


def markdown(result: dict[str, Any]) -> str:
    """The architectures x checks table (every cell pass / FAIL: reason / skip: reason), the failures grouped by
    cause, then the architectures not run and why."""
    checks = result["checks"]
    archs = result["architectures"]
    lines = ["| architecture | " + " | ".join(f"`{c}`" for c in checks) + " |", "|---|" + "---|" * len(checks)]
    for name, res in archs.items():
        if res["status"] != "run":
            continue
        cells = [_cell(res["checks"].get(c)) for c in checks]
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    s = result["summary"]
    text = "\n".join(lines)
    text += (f"\n\n{s['run']} architectures run ({len(s['all_pass'])} pass every check), {s['skipped']} not run "
             f"(below), {s['errors']} errors, of {s['architectures']}.")
    causes = failures_by_cause(result)
    if causes:
        rows = ["| failure cause | architectures (failed checks) |", "|---|---|"]
        for why, hit in causes.items():
            every = len(checks)
            listed = ", ".join(f"`{n}` ({'all' if len(c) == every else ', '.join(c)})" for n, c in hit.items())
            rows.append(f"| {_escape(why)} | {listed} |")
        text += "\n\n" + "\n".join(rows)
    skipped = [(n, r) for n, r in archs.items() if r["status"] != "run"]
    if skipped:
        rows = ["| architecture | not run: why |", "|---|---|"]
        rows += [f"| `{n}` | {'error: ' if r['status'] == 'error' else ''}{_escape(r.get('reason', ''))[:200]} |"
                 for n, r in skipped]
        text += "\n\n" + "\n".join(rows)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", help="comma-separated model_types (default: every CausalLM architecture)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (one torch thread each; default 2)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per architecture before it is an error")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/architectures.json)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker.split(","), args.timeout)
        return 0
    from flashcodec_fx.evaluate import architectures as arch

    models = args.models.split(",") if args.models else arch.causal_lm_architectures()
    start = time.perf_counter()
    results = run(models, max(1, args.jobs), args.timeout)
    seconds = time.perf_counter() - start
    checks = list(arch.CHECKS)
    payload = {"protocol": {"prompt_tokens": arch.PROMPT_LEN, "new_tokens": arch.NEW_TOKENS, "seed": arch.SEED,
                            "window": arch.WINDOW, "lossy_presets": list(arch.LOSSY_PRESETS),
                            "logit_bounds": arch.LOGIT_BOUNDS, "jobs": args.jobs, "wall_seconds": round(seconds, 1),
                            "models_option": args.models},
               "checks": checks, "summary": summary(results, checks), "architectures": results}
    sys.path.insert(0, str(HERE))
    from common import write_result

    path = write_result("architectures", payload, out=args.out)
    print(f"{path}: {payload['summary']['run']} run, {payload['summary']['skipped']} skipped, "
          f"{payload['summary']['errors']} errors in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
