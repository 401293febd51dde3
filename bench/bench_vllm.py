"""vLLM offline throughput: the AttnRes plugin vs vLLM's own Llama, and vs transformers `generate()`.

    python bench/bench_vllm.py                          # default size, 64 prompts x 128 new tokens
    python bench/bench_vllm.py --hidden-size 256 --num-hidden-layers 4 --prompts 16 --new-tokens 32
    python bench/bench_vllm.py --model out/smollm2-attnres --source smollm2-llama --dtype bfloat16

By default both models are random, same dimensions, saved once to a temporary folder; with `--model`
(an attnres-convert output) and `--source` (the folder it was converted from) the real weights, the
source served by vLLM's own Llama. Two workloads: `decode` (`--prompts` x `--prompt-tokens`, then
`--new-tokens` generated) and `prefill` (`--prompts` x `--prefill-tokens`, one new token). One process holds both
vLLM engines (in-process engine cores) and times `LLM.generate` over all prompts for each in turn,
the order swapped every repeat, so that each repeat gives a paired AttnRes/Llama ratio measured under
the same machine conditions (between separate processes this shared CPU drifts by 10-20 %). Engine
start-up (loading and compilation) is reported in its own column and, like a warm-up batch, kept
out of the timings; for cold compile times, run with `VLLM_DISABLE_COMPILE_CACHE=1
TORCHINDUCTOR_FX_GRAPH_CACHE=0 TORCHINDUCTOR_AUTOGRAD_CACHE=0`. transformers `generate()` runs in
its own process on the same prompts.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_model_arguments, add_size_arguments, build, check_model_arguments, describe, markdown_table  # noqa: E402,E501

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def write_models(args, root: Path) -> dict[str, Path]:
    import torch

    if args.model:
        return {"attnres": Path(args.model), "llama": Path(args.source)}
    paths = {}
    for kind in ("attnres", "llama"):
        model = build(kind, args, getattr(torch, args.dtype))
        paths[kind] = root / kind
        model.save_pretrained(paths[kind])
        del model
    return paths


def prompt_ids(args, tokens: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, args.vocab_size) for _ in range(tokens)] for _ in range(args.prompts)]


def workload(args, name: str) -> tuple[list[dict], int]:
    """The prompts and the number of new tokens of a workload."""
    tokens, new = (args.prompt_tokens, args.new_tokens) if name == "decode" else (args.prefill_tokens, 1)
    return [{"prompt_token_ids": ids} for ids in prompt_ids(args, tokens)], new


def run_vllm(args) -> dict:
    """In a fresh process: both engines, a warm-up each, then `--repeats` alternating timed batches."""
    from vllm import LLM, SamplingParams

    paths = dict(zip(("attnres", "llama"), args.probe_path.split(os.pathsep)))
    engines, startup = {}, {}
    max_len = max(args.prompt_tokens + args.new_tokens, args.prefill_tokens + 1) + 8
    for kind, path in paths.items():
        overrides = {"attn_res_bank_dtype": args.bank_dtype} if kind == "attnres" and args.bank_dtype else None
        start = time.perf_counter()
        engines[kind] = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=args.enforce_eager,
                            kv_cache_memory_bytes=args.kv_cache_bytes, max_model_len=max_len, seed=0,
                            hf_overrides=overrides)
        startup[kind] = time.perf_counter() - start                   # loading + compilation
    results = {}
    for name in args.workloads:
        prompts, new = workload(args, name)
        params = SamplingParams(max_tokens=new, min_tokens=new, ignore_eos=True, temperature=0.0, detokenize=False)
        for llm in engines.values():
            llm.generate(prompts[:2], params, use_tqdm=False)
        runs = []
        for repeat in range(args.repeats):
            run = {}
            for kind in list(engines) if repeat % 2 == 0 else list(engines)[::-1]:
                start = time.perf_counter()
                outputs = engines[kind].generate(prompts, params, use_tqdm=False)
                run[kind] = {"seconds": time.perf_counter() - start,
                             "tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}
            runs.append(run)
        results[name] = runs
    return {"workloads": results, "startup": startup}


def run_transformers(args) -> dict:
    """In a fresh process: transformers `generate()` on the same prompts, one padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    import modeling_attnres  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(args.probe_path, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor(prompt_ids(args, args.prompt_tokens))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": int((out.shape[1] - ids.shape[1]) * out.shape[0])}


def probe(engine: str, path: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--probe", engine, "--probe-path", path] + argv
    done = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} probe failed on {path}:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.probe:
        print(json.dumps(run_vllm(args) if args.probe == "vllm" else run_transformers(args)))
        return
    with tempfile.TemporaryDirectory(prefix="attnres-bench-") as tmp:
        paths = write_models(args, Path(tmp))
        vllm = probe("vllm", os.pathsep.join(str(paths[k]) for k in ("attnres", "llama")), argv)
        hf = None if args.skip_transformers else probe("transformers", str(paths["attnres"]), argv)
    mode = "eager" if args.enforce_eager else "compiled"
    print(f"{describe(args)}; {args.dtype}, vLLM {mode}, bank dtype {args.bank_dtype or 'from the config'}; "
          f"{args.repeats} alternating repeats\n")
    rows = []
    for name, runs in vllm["workloads"].items():
        seconds = {k: statistics.median(r[k]["seconds"] for r in runs) for k in ("attnres", "llama")}
        ratios = [r["attnres"]["seconds"] / r["llama"]["seconds"] for r in runs]
        prompts, new = workload(args, name)
        shape = f"{name}, {len(prompts)} x {len(prompts[0]['prompt_token_ids'])} tokens -> {new} new"
        rows.append([shape, f"{seconds['attnres']:.2f}", f"{seconds['llama']:.2f}",
                     f"**{statistics.median(ratios):.3f}**", f"{min(ratios):.3f}-{max(ratios):.3f}"])
    print(markdown_table(["workload", "AttnRes s", "Llama s", "time ratio AttnRes/Llama (median)",
                          "paired repeats min-max"], rows))
    print(f"\nengine start-up (loading + compilation): AttnRes {vllm['startup']['attnres']:.0f} s, "
          f"Llama {vllm['startup']['llama']:.0f} s")
    if hf and "decode" in vllm["workloads"]:
        runs = vllm["workloads"]["decode"]
        seconds = statistics.median(r["attnres"]["seconds"] for r in runs)
        speedup = (runs[0]["attnres"]["tokens"] / seconds) / (hf["tokens"] / hf["seconds"])
        print(f"vLLM vs transformers generate() on AttnRes, decode (tok/s): **{speedup:.2f}x**")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--workloads", nargs="+", choices=("decode", "prefill"), default=["decode", "prefill"])
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--bank-dtype", choices=("auto", "float32"),
                        help="AttnResConfig.attn_res_bank_dtype for the AttnRes engine (default: the checkpoint's)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--enforce-eager", action="store_true", help="turn vLLM's torch.compile off")
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--probe", choices=("vllm", "transformers"), help=argparse.SUPPRESS)
    parser.add_argument("--probe-path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    return args


if __name__ == "__main__":
    main()
