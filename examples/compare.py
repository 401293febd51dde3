"""Print the README's comparison table from the `metrics.json` of finished training runs.

    .venv/bin/python examples/compare.py /tmp/attnres-runs/block /tmp/attnres-runs/full /tmp/attnres-runs/llama

Each argument is an `--out` folder (or a `--work-dir`) of `examples/train.py`. Refuses to compare
runs trained on different numbers of tokens, since the table's point is equal training tokens.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

NAMES = {"block": "Block AttnRes", "full": "Full AttnRes", "llama": "Llama baseline"}


def load_metrics(folder: Path) -> dict:
    """The metrics of one finished run, with a clear error for a missing or unfinished run."""
    path = folder / "metrics.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; pass the --out folder of a finished examples/train.py run")
    metrics = json.loads(path.read_text())
    if "val_loss" not in metrics:
        raise SystemExit(f"error: the run in {folder} has not finished (no val_loss); rerun its command to resume it")
    return metrics


def table(runs: list[dict]) -> str:
    """Markdown table: validation loss, perplexity and the difference to the first row."""
    tokens = {m["train_tokens"] for m in runs}
    if len(tokens) != 1:
        raise SystemExit(f"error: the runs were trained on different numbers of tokens {sorted(tokens)}; "
                         f"train them with the same --steps/--batch-size/--seq-len")
    first = runs[0]["val_loss"]
    lines = ["| model | params | train tokens | val loss (nats/token) | val perplexity | vs. first row |",
             "|---|---:|---:|---:|---:|---:|"]
    for m in runs:
        delta = "" if m is runs[0] else f"{m['val_loss'] - first:+.4f}"
        lines.append(f"| {NAMES.get(m['arch'], m['arch'])} | {m['params'] / 1e6:.2f} M | {m['train_tokens']:,} | "
                     f"{m['val_loss']:.4f} | {math.exp(m['val_loss']):.2f} | {delta} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    folders = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not folders:
        raise SystemExit("usage: compare.py RUN_FOLDER [RUN_FOLDER ...]")
    print(table([load_metrics(f) for f in folders]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
