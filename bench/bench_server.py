"""The OpenAI endpoint under load: 1, 8 and 32 concurrent clients against `attnres-serve`.

    python bench/bench_server.py                          # the built-in default model
    python bench/bench_server.py --model PATH --concurrency 1 8 32 --requests-per-client 4

Starts one server on a free loopback port (127.0.0.1 only) and stops its process group at the end.
Each client sends `--requests-per-client` completions one after another (bounded: no open-ended
loop), `max_tokens` new tokens each with `ignore_eos`, so every request generates the same amount.
Reports requests/s, generated tokens/s, p50/p99 latency and errors, then the same prompts through
transformers `generate()` in the same dtype, two ways: one request at a time (what answering
concurrent requests with plain `generate()` amounts to, with no batching scheduler) and all prompts
of the largest concurrency as one padded batch (static batching, known in advance: an upper bound
no server receiving independent requests reaches), with the server's tokens/s ratio to each.

    python bench/bench_server.py --soak                   # 64 clients, 8 rounds, memory per round

`--soak` instead runs `--soak-clients` concurrent clients (every other one streaming) for one warm-up
round and `--soak-rounds` rounds, and prints per round the requests, errors (a failed request or one
that returned fewer than `--max-tokens` tokens) and the resident memory of the server's whole process
group (API server, engine core, workers), then the growth from the first round to the last; it exits
with status 1 if any request failed.
"""

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import markdown_table  # noqa: E402

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "for i in range("]


async def completion_tokens(api, model, prompt, max_tokens, stream: bool) -> int:
    """One greedy completion of exactly `max_tokens` tokens (EOS ignored); returns the tokens counted."""
    kwargs = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                  extra_body={"ignore_eos": True, "min_tokens": max_tokens})
    if not stream:
        return (await api.completions.create(**kwargs)).usage.completion_tokens
    chunks = await api.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    return [chunk.usage async for chunk in chunks if chunk.usage][-1].completion_tokens


async def client(api, model, n_requests, max_tokens, latencies, errors, counter, stream=False):
    for i in range(n_requests):
        start = time.perf_counter()
        try:
            tokens = await completion_tokens(api, model, PROMPTS[i % len(PROMPTS)], max_tokens, stream)
            counter.append(tokens)
            latencies.append(time.perf_counter() - start)
            if tokens != max_tokens:
                errors.append(f"{tokens} tokens instead of {max_tokens}")
        except Exception as exc:  # noqa: BLE001 — every failure is counted and reported
            errors.append(repr(exc))


async def load(url, model, concurrency, n_requests, max_tokens, mixed=False):
    """`concurrency` clients sending `n_requests` each; with `mixed`, every other client streams."""
    from openai import AsyncOpenAI

    api = AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0)
    latencies, errors, tokens = [], [], []
    start = time.perf_counter()
    await asyncio.gather(*(client(api, model, n_requests, max_tokens, latencies, errors, tokens, mixed and c % 2 == 1)
                           for c in range(concurrency)))
    seconds = time.perf_counter() - start
    await api.close()
    lat = sorted(latencies) or [float("nan")]
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return dict(concurrency=concurrency, requests=len(latencies), seconds=seconds, tokens=sum(tokens),
                p50=statistics.median(lat), p99=p99, errors=errors)


def transformers_tokens_per_second(model_path, prompts, max_tokens, dtype: str) -> float:
    """transformers `generate()` on `prompts` as one left-padded batch, `max_tokens` new tokens each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_attnres  # noqa: F401

    tok = AutoTokenizer.from_pretrained(model_path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
        seconds = time.perf_counter() - start
    return (out.shape[1] - enc["input_ids"].shape[1]) * len(prompts) / seconds


def transformers_baselines(model_path, args) -> dict[str, float]:
    """tokens/s of `generate()` one request at a time, and of one batch of the largest concurrency."""
    top = max(args.concurrency)
    sequential = [transformers_tokens_per_second(model_path, [PROMPTS[i % len(PROMPTS)]], args.max_tokens,
                                                 args.dtype) for i in range(args.sequential_requests + 1)][1:]
    batch = [PROMPTS[i % len(PROMPTS)] for i in range(top)]
    return {"generate(), one request at a time": sum(sequential) / len(sequential),
            f"generate(), {top} prompts as one batch": transformers_tokens_per_second(model_path, batch,
                                                                                       args.max_tokens, args.dtype)}


def soak(server, args) -> int:
    """The `--soak` run: one warm-up round and `--soak-rounds` rounds; returns the number of errors."""
    rows, rss, errors = [], [], 0
    for round_ in range(args.soak_rounds + 1):
        r = asyncio.run(load(server.url, "bench", args.soak_clients, args.requests_per_client, args.max_tokens,
                             mixed=True))
        rss.append(server.rss_bytes())
        errors += len(r["errors"]) if round_ else 0
        rows.append([round_ or "warm-up", r["requests"], len(r["errors"]), f"{r['seconds']:.1f}",
                     f"{r['tokens'] / r['seconds']:.1f}", f"{rss[-1] / 2**20:.0f}"])
        if r["errors"]:
            print(f"errors in round {round_}: {r['errors'][:3]}")
    print(markdown_table(["round", "requests", "errors", "seconds", "gen tok/s", "server RSS MiB"], rows))
    measured = rss[1:]
    print(f"\n{args.soak_clients} clients (every other one streaming) x {args.soak_rounds} rounds: {errors} errors; "
          f"server RSS {measured[0] / 2**20:.0f} -> {measured[-1] / 2**20:.0f} MiB from round 1 to "
          f"{args.soak_rounds} (growth {(measured[-1] - measured[0]) / 2**20:+.0f} MiB, range "
          f"{(max(measured) - min(measured)) / 2**20:.0f} MiB)")
    return errors


def main(argv=None) -> None:
    args = parse_args(argv)
    from attnres.serving.defaults import resolve_model
    from attnres.serving.launcher import ServerProcess

    model_path = resolve_model(args.model)
    max_seqs = max(args.concurrency + ([args.soak_clients] if args.soak else []))
    server_args = [model_path, "--served-model-name", "bench", "--max-num-seqs", str(max_seqs), "--dtype", args.dtype]
    if args.enforce_eager:
        server_args.append("--enforce-eager")
    rows = []
    with ServerProcess(server_args) as server:
        print(f"server ready in {server.startup_seconds:.1f} s ({model_path})\n")
        if args.soak:
            sys.exit(1 if soak(server, args) else 0)
        asyncio.run(load(server.url, "bench", 1, 1, 4))                       # warm-up
        for c in args.concurrency:
            r = asyncio.run(load(server.url, "bench", c, args.requests_per_client, args.max_tokens))
            rows.append([c, r["requests"], f"{r['requests'] / r['seconds']:.2f}", f"{r['tokens'] / r['seconds']:.1f}",
                         f"{r['p50'] * 1e3:.0f}", f"{r['p99'] * 1e3:.0f}", len(r["errors"])])
            if r["errors"]:
                print(f"errors at concurrency {c}: {r['errors'][:3]}")
    print(markdown_table(["clients", "requests", "req/s", "gen tok/s", "p50 ms", "p99 ms", "errors"], rows))
    if not args.skip_transformers:
        served, top = float(rows[-1][3]), max(args.concurrency)
        print(f"\nvLLM server at {top} clients: {served:.1f} tok/s ({args.dtype}) against transformers:\n")
        print(markdown_table(["transformers baseline", "tok/s", f"server at {top} clients / baseline"],
                             [[name, f"{tps:.1f}", f"**{served / tps:.2f}x**"]
                              for name, tps in transformers_baselines(model_path, args).items()]))


def parse_args(argv):
    from attnres.serving.defaults import DEFAULT_MODEL

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the server's and transformers' dtype")
    parser.add_argument("--sequential-requests", type=int, default=4,
                        help="requests timed one at a time for the transformers baseline (after one warm-up)")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--soak", action="store_true", help="run the soak test instead (see above)")
    parser.add_argument("--soak-clients", type=int, default=64)
    parser.add_argument("--soak-rounds", type=int, default=8)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
