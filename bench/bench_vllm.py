"""vLLM offline throughput: the AttnRes plugin vs vLLM's own Llama, and vs transformers `generate()`.

    python bench/bench_vllm.py                          # default size, 64 prompts x 128 new tokens
    python bench/bench_vllm.py --hidden-size 256 --num-hidden-layers 4 --prompts 16 --new-tokens 32

Both models are random, same dimensions, saved once to a temporary folder. One process holds both
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
from common import add_size_arguments, build, markdown_table  # noqa: E402

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}


def write_models(args, root: Path) -> dict[str, Path]:
    import torch

    paths = {}
    for kind in ("attnres", "llama"):
        model = build(kind, args, getattr(torch, args.dtype))
        paths[kind] = root / kind
        model.save_pretrained(paths[kind])
        del model
    return paths


def prompt_ids(args) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, args.vocab_size) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]


def run_vllm(args) -> dict:
    """In a fresh process: both engines, a warm-up each, then `--repeats` alternating timed batches."""
    from vllm import LLM, SamplingParams

    paths = dict(zip(("attnres", "llama"), args.probe_path.split(os.pathsep)))
    engines, startup = {}, {}
    for kind, path in paths.items():
        start = time.perf_counter()
        engines[kind] = LLM(model=path, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=args.enforce_eager,
                            kv_cache_memory_bytes=args.kv_cache_bytes,
                            max_model_len=args.prompt_tokens + args.new_tokens + 8, seed=0)
        startup[kind] = time.perf_counter() - start                   # loading + compilation
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, ignore_eos=True,
                            temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": ids} for ids in prompt_ids(args)]
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
    return {"runs": runs, "startup": startup}


def run_transformers(args) -> dict:
    """In a fresh process: transformers `generate()` on the same prompts, one padded batch."""
    import torch
    from transformers import AutoModelForCausalLM

    import modeling_attnres  # noqa: F401  (registers the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(args.probe_path, dtype=getattr(torch, args.dtype)).eval()
    ids = torch.tensor(prompt_ids(args))
    kwargs = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:2], max_new_tokens=2, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": int((out.shape[1] - ids.shape[1]) * out.shape[0])}


def probe(engine: str, path: str, argv: list[str]) -> dict:
    cmd = [sys.executable, __file__, "--probe", engine, "--probe-path", path] + argv
    done = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True)
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
        vllm_runs = vllm["runs"]
        hf = None if args.skip_transformers else probe("transformers", str(paths["attnres"]), argv)
    seconds = {k: statistics.median(r[k]["seconds"] for r in vllm_runs) for k in ("attnres", "llama")}
    tokens = vllm_runs[0]["attnres"]["tokens"]
    ratio = statistics.median(r["attnres"]["seconds"] / r["llama"]["seconds"] for r in vllm_runs)
    mode = "eager" if args.enforce_eager else "compiled"
    print(f"{args.prompts} prompts x {args.prompt_tokens} tokens -> {args.new_tokens} new tokens, {args.dtype}, "
          f"vLLM {mode}; hidden {args.hidden_size}, {args.num_hidden_layers} layers, block size {args.block_size}; "
          f"{args.repeats} alternating repeats\n")
    rows = [[f"vLLM {k}", f"{seconds[k]:.2f}", f"{tokens / seconds[k]:.1f}", f"{vllm['startup'][k]:.0f}"]
            for k in ("attnres", "llama")]
    if hf:
        rows.append(["transformers generate(), attnres", f"{hf['seconds']:.2f}", f"{hf['tokens'] / hf['seconds']:.1f}",
                     "-"])
    print(markdown_table(["engine / model", "seconds", "generated tok/s", "engine start-up s"], rows))
    spread = ", ".join(f"{r['attnres']['seconds'] / r['llama']['seconds']:.3f}" for r in vllm_runs)
    print(f"\nvLLM time ratio AttnRes/Llama (median of paired repeats): **{ratio:.3f}** (repeats: {spread})")
    if hf:
        speedup = (tokens / seconds["attnres"]) / (hf["tokens"] / hf["seconds"])
        print(f"vLLM vs transformers generate() on AttnRes (tok/s): **{speedup:.2f}x**")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
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
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
