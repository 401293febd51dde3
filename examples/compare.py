"""Print the README's comparison tables from training runs of `examples/train.py`.

    .venv/bin/python examples/compare.py ~/.cache/attnres/train/{block,full,llama}     # the default --work-dir

Each argument is a `--work-dir` of `examples/train.py` (it holds `checkpoint.pt` and, once the run
has finished, `metrics.json`). Two tables:

- validation loss and perplexity of the finished runs (refused if their training tokens differ);
- the *online* loss at equal tokens: the mean training loss over the last `--window` steps before
  the largest step every run has reached. Every batch is new to the model when it is trained on
  (less than one epoch), and all runs see the same batches in the same order, so this is a paired
  held-out measure that also covers a run that has not finished yet.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

NAMES = {"block": "Block AttnRes", "full": "Full AttnRes", "llama": "Llama baseline"}


def load_run(folder: Path) -> dict:
    """`{"arch", "history", "tokens_per_step", "metrics"}` of one run, with clear errors."""
    ckpt, metrics_file = folder / "checkpoint.pt", folder / "metrics.json"
    if not ckpt.is_file():
        raise SystemExit(f"error: {ckpt} does not exist; pass the --work-dir of an examples/train.py run")
    state = torch.load(ckpt, weights_only=True, map_location="cpu")
    args = state["args"]
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else {}
    finished = "val_loss" in metrics and metrics.get("steps_done") == int(args["steps"])
    return {"arch": args["arch"], "history": state["history"],
            "tokens_per_step": int(args["batch_size"]) * int(args["seq_len"]),
            "metrics": metrics if finished else None}


def validation_table(runs: list[dict]) -> str:
    """Markdown: validation loss and perplexity of the finished runs (equal training tokens)."""
    done = [r["metrics"] for r in runs if r["metrics"]]
    if not done:
        return "(no finished run yet)"
    tokens = {m["train_tokens"] for m in done}
    if len(tokens) != 1:
        raise SystemExit(f"error: the runs were trained on different numbers of tokens {sorted(tokens)}; "
                         f"train them with the same --steps/--batch-size/--seq-len")
    lines = ["| model | params | train tokens | val loss (nats/token) | val perplexity | vs. first row |",
             "|---|---:|---:|---:|---:|---:|"]
    for m in done:
        delta = "" if m is done[0] else f"{m['val_loss'] - done[0]['val_loss']:+.4f}"
        lines.append(f"| {NAMES.get(m['arch'], m['arch'])} | {m['params'] / 1e6:.2f} M | {m['train_tokens']:,} | "
                     f"{m['val_loss']:.4f} | {math.exp(m['val_loss']):.2f} | {delta} |")
    return "\n".join(lines)


def online_table(runs: list[dict], window: int, at: int | None = None) -> str:
    """Markdown: mean training loss over steps `(at - window, at]`, on batches each model saw first there."""
    common = min(len(r["history"]) for r in runs)
    at = common if at is None else min(at, common)
    if at < window:
        raise SystemExit(f"error: the runs share only {at} steps, fewer than --window {window}; pass --window {at} "
                         "or less")
    lines = [f"| model | tokens seen at step {at} | online loss, steps {at - window + 1}-{at} | perplexity |",
             "|---|---:|---:|---:|"]
    for r in runs:
        loss = sum(r["history"][at - window : at]) / window
        lines.append(f"| {NAMES.get(r['arch'], r['arch'])} | {at * r['tokens_per_step']:,} | {loss:.4f} | "
                     f"{math.exp(loss):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="--work-dir folders of examples/train.py runs")
    p.add_argument("--window", type=int, default=50, help="steps averaged for the online loss")
    p.add_argument("--at", type=int, help="step for the online loss (default: the largest common step)")
    args = p.parse_args(argv)
    if args.window < 1:
        p.error(f"--window must be at least 1 step, got {args.window}")
    if args.at is not None and args.at < 1:
        p.error(f"--at must be a step >= 1, got {args.at} (leave it out for the largest common step)")
    runs = [load_run(folder) for folder in args.runs]
    print(validation_table(runs))
    print()
    print(online_table(runs, args.window, args.at))
    return 0


if __name__ == "__main__":
    sys.exit(main())
