"""AttnRes vs the same-size Llama in transformers: prefill, decode and peak memory, side by side.

    python bench/bench_transformers.py                   # the default size (hidden 1024, 16 layers)
    python bench/bench_transformers.py --hidden-size 256 --num-hidden-layers 4 --repeats 3
    python bench/bench_transformers.py --model out/smollm2-attnres --source smollm2-llama --accuracy

By default both models are random and of the same size; with `--model` (an attnres-convert output)
and `--source` (the folder it was converted from) the real weights, the source in its own
transformers class. Prefill runs are alternated (AttnRes, Llama, AttnRes, ...), each adjacent pair
giving a ratio. Decoding runs the two models in lock step, one token each in turn (the order
swapped every step), so that both see the same machine at the same moment: on a shared CPU the
drift between whole runs is larger than the effect measured. Each repeat gives a paired
AttnRes/Llama ratio; the table reports medians. Peak memory is measured in a fresh process per
model: the peak RSS during the prefill (the process's whole footprint), and the prefill's own peak
above the RSS it started from (activations and temporary buffers).

`--modes eager cpu-kernel compiled compiled-kernel` adds eager decoding with AttnRes's fused C++ site
kernel (`modeling_attnres.enable_cpu_kernel()`; Llama runs as in `eager`), the transformers recipe for
fast decoding (a `StaticCache` and `torch.compile(model.forward, fullgraph=True)`) for both models,
and that recipe with the kernel called from AttnRes's compiled graph; compiling takes minutes on a CPU.
`--accuracy` first compares each model's bfloat16 logits with its own float64 logits on the same
random tokens, AttnRes with each bank dtype (`attn_res_bank_dtype`).
"""

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import DynamicCache, StaticCache

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_model_arguments,
    add_size_arguments,
    alternate,
    build,
    check_model_arguments,
    describe,
    markdown_table,
    synchronize,
)

from modeling_attnres import enable_cpu_kernel  # noqa: E402
from modeling_attnres.depth_attention import bank_dtype  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def prefill_fn(forward, tokens: torch.Tensor):
    def run():
        with torch.inference_mode():
            forward(tokens, use_cache=False, logits_to_keep=1)
    return run


class Decoder:
    """Greedy decoding of one model, one step per `step()` call. `cache` is a `StaticCache` reused
    (reset) across runs, so that a compiled forward sees the same cache object and never recompiles;
    `None` means a fresh `DynamicCache`."""

    def __init__(self, model, forward, prompt: torch.Tensor, cache: StaticCache | None):
        self.forward = forward
        with torch.inference_mode():
            if cache is None:
                cache = DynamicCache(config=model.config)
            else:
                cache.reset()
            self.cache, self.pos = cache, prompt.shape[1]
            out = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
                        cache_position=torch.arange(self.pos, device=prompt.device))
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        with torch.inference_mode():
            position = torch.tensor([self.pos], device=self.next.device)
            out = self.forward(self.next, past_key_values=self.cache, use_cache=True, cache_position=position,
                               position_ids=position.expand(self.next.shape[0], 1))
            self.next = out.logits[:, -1].argmax(-1, keepdim=True)
            self.pos += 1


def lockstep_decode(models: dict, forwards: dict, caches: dict, prompt: torch.Tensor,
                    new_tokens: int) -> dict[str, float]:
    """Seconds each model spends on `new_tokens` decoding steps, the models taking turns per step."""
    decoders = {k: Decoder(models[k], forwards[k], prompt, caches[k]) for k in models}
    seconds = dict.fromkeys(models, 0.0)
    order = list(models)
    for i in range(new_tokens):
        for kind in order if i % 2 == 0 else order[::-1]:
            synchronize()
            start = time.perf_counter()
            decoders[kind].step()
            synchronize()
            seconds[kind] += time.perf_counter() - start
    return seconds


def time_decode(models, forwards, prompt, args, static) -> tuple[dict[str, float], float]:
    """Median seconds per model and the median of the per-repeat paired ratios."""
    max_len = prompt.shape[1] + args.new_tokens + 1
    caches = {k: StaticCache(config=m.config, max_cache_len=max_len) if static else None for k, m in models.items()}
    lockstep_decode(models, forwards, caches, prompt, 4)                       # warm-up (and compile)
    runs = [lockstep_decode(models, forwards, caches, prompt, args.new_tokens) for _ in range(args.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in models}
    return med, statistics.median(r["attnres"] / r["llama"] for r in runs)


def time_workloads(args, dtype_name: str, mode: str) -> list[list]:
    dtype = DTYPES[dtype_name]
    models = {kind: build(kind, args, dtype, device=args.device) for kind in ("attnres", "llama")}
    if args.bank_dtype:
        models["attnres"].config.attn_res_bank_dtype = args.bank_dtype
    compiled = mode in ("compiled", "compiled-kernel")
    enable_cpu_kernel(mode in ("cpu-kernel", "compiled-kernel"), compiled=mode == "compiled-kernel")  # AttnRes only
    forwards = {k: torch.compile(m.forward, fullgraph=True, dynamic=False) if compiled else m
                for k, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    rows = []
    tokens = torch.randint(0, args.vocab_size, (1, args.prefill_tokens), generator=gen).to(args.device)
    runs = {k: prefill_fn(f, tokens) for k, f in forwards.items()}
    paired = []
    med = alternate(runs, args.repeats, paired=paired)
    ratio = statistics.median(r["attnres"] / r["llama"] for r in paired)
    rows.append(row(f"prefill 1x{args.prefill_tokens}", dtype_name, mode, med, ratio, args.prefill_tokens))
    for batch in args.decode_batches:
        prompt = torch.randint(0, args.vocab_size, (batch, args.prompt_tokens), generator=gen).to(args.device)
        med, ratio = time_decode(models, forwards, prompt, args, static=compiled)
        rows.append(row(f"decode {batch}x{args.new_tokens} (prompt {args.prompt_tokens})", dtype_name, mode, med,
                        ratio, batch * args.new_tokens))
    return rows


def row(name, dtype_name, mode, med, ratio, tokens):
    a, l = med["attnres"], med["llama"]
    return [name, dtype_name, mode, f"{a * 1e3:.1f}", f"{l * 1e3:.1f}", f"{tokens / a:.1f}", f"{tokens / l:.1f}",
            f"**{ratio:.3f}**"]


def _status_mib(field: str) -> float:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in MiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


def memory_probe(args) -> None:
    """In a fresh process: build one model, run the prefill, print the peak RSS of the whole process and
    the peak of the prefill alone over the RSS it started from (MiB).

    Loading peaks higher than a short prefill, so the process's lifetime peak (`ru_maxrss`) would hide
    the prefill. A first prefill pages in the weights (a checkpoint is memory-mapped) and the kernels'
    one-time state; then freed memory is returned to the system (`malloc_trim`) and the kernel's
    high-water mark is reset (`/proc/self/clear_refs`), so that `VmHWM` is the second prefill's peak."""
    torch.set_num_threads(args.threads)
    model = build(args.memory_probe, args, DTYPES[args.dtype])
    tokens = torch.randint(0, args.vocab_size, (1, args.prefill_tokens))
    prefill_fn(model, tokens)()
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")                                                 # VmHWM := VmRSS
    start = _status_mib("VmRSS")
    prefill_fn(model, tokens)()
    peak = _status_mib("VmHWM")
    print(json.dumps({"start_mib": start, "peak_mib": peak}))


def memory_rows(args) -> list[list]:
    rows = []
    for dtype_name in args.dtypes:
        res = {}
        for kind in ("attnres", "llama"):
            cmd = [sys.executable, __file__, "--memory-probe", kind, "--dtype", dtype_name] + sys.argv[1:]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800).stdout
            res[kind] = json.loads(out.strip().splitlines()[-1])
        a, l = res["attnres"], res["llama"]
        a_act, l_act = a["peak_mib"] - a["start_mib"], l["peak_mib"] - l["start_mib"]
        rows.append([f"peak RSS, prefill 1x{args.prefill_tokens}", dtype_name, f"{a['peak_mib']:.0f}",
                     f"{l['peak_mib']:.0f}", f"{a_act:.1f}", f"{l_act:.1f}", f"**{a['peak_mib'] / l['peak_mib']:.3f}**",
                     f"**{a_act / l_act:.2f}**" if l_act > 0 else "-"])
    return rows


def cuda_memory_rows(args) -> list[list]:
    """Peak allocated GPU memory of the prefill, per model and dtype (one model on the GPU at a time)."""
    rows = []
    for dtype_name in args.dtypes:
        res = {}
        for kind in ("attnres", "llama"):
            torch.cuda.empty_cache()
            model = build(kind, args, DTYPES[dtype_name], device=args.device)
            built = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            tokens = torch.randint(0, args.vocab_size, (1, args.prefill_tokens), device=args.device)
            prefill_fn(model, tokens)()
            res[kind] = (torch.cuda.max_memory_allocated() / 2**20, built)
            del model
        (a, a0), (l, l0) = res["attnres"], res["llama"]
        rows.append([f"peak allocated, prefill 1x{args.prefill_tokens}", dtype_name, f"{a:.0f}", f"{l:.0f}",
                     f"{a - a0:.0f}", f"{l - l0:.0f}", f"**{a / l:.3f}**"])
    return rows


def accuracy_rows(args, batch: int = 4, tokens: int = 64) -> list[list]:
    """Each model's bfloat16 logits against its own float64 logits on the same random tokens.

    AttnRes runs with the fused CPU kernel (held to the same float64 oracle as the torch path in the
    tests): `"auto"` keeps a bfloat16 bank only where a fused reader reads it, and the eager torch path
    on a CPU is not one (`depth_attention_ops.site_bank`), so without the kernel both rows would
    measure a float32 bank."""
    ids = torch.randint(3, args.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for kind in ("llama", "attnres"):
        model = build(kind, args, torch.float64)
        with torch.no_grad():
            reference = model(ids).logits
            model.to(torch.bfloat16)
            enable_cpu_kernel(kind == "attnres")
            for choice in ("float32", "auto") if kind == "attnres" else ("-",):
                if kind == "attnres":
                    model.config.attn_res_bank_dtype = choice
                bank = bank_dtype(choice, torch.bfloat16) if kind == "attnres" else "-"
                logits = model(ids).logits
                err = logits.double() - reference
                agree = (logits.argmax(-1) == reference.argmax(-1)).double().mean()
                rows.append([kind, choice, str(bank).removeprefix("torch."), f"{err.abs().max():.3f}",
                             f"{err.pow(2).mean().sqrt():.4f}", f"{err.norm() / reference.norm():.5f}",
                             f"{agree:.3f}"])
            enable_cpu_kernel(False)
        del model
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--bank-dtype", choices=("auto", "float32"),
                        help="AttnResConfig.attn_res_bank_dtype for AttnRes (default: the config's)")
    parser.add_argument("--accuracy", action="store_true",
                        help="first: bfloat16 vs float64 logit error of each model (and each bank dtype)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=["eager"],
                        choices=("eager", "cpu-kernel", "compiled", "compiled-kernel"),
                        help="eager; eager with AttnRes's fused CPU site kernel; StaticCache + "
                             "torch.compile(fullgraph=True) for both models; the same with the kernel "
                             "(the compiled graph calls it as the custom op attnres::mix_site)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    parser.add_argument("--memory-probe", choices=("attnres", "llama"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_model_arguments(parser, args)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_probe:
        return memory_probe(args)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; {describe(args)}\n")
    if args.accuracy:
        print(markdown_table(["model", "attn_res_bank_dtype", "bank kept in", "max |logit error|", "RMS error",
                              "relative error",
                              "top-1 agreement"], accuracy_rows(args)))
        print("\n(bfloat16 vs the same model in float64, 4 x 64 random tokens; AttnRes with the CPU kernel)\n")
    rows = [r for mode in args.modes for dtype_name in args.dtypes for r in time_workloads(args, dtype_name, mode)]
    print(markdown_table(["workload", "dtype", "mode", "AttnRes ms", "Llama ms", "AttnRes tok/s", "Llama tok/s",
                          "ratio"], rows))
    if args.device.startswith("cuda") and not args.no_memory:
        print()
        print(markdown_table(["memory", "dtype", "AttnRes MiB", "Llama MiB", "AttnRes act. MiB",
                              "Llama act. MiB", "ratio"], cuda_memory_rows(args)))
    elif not args.no_memory:
        print()
        print(markdown_table(["memory", "dtype", "AttnRes MiB", "Llama MiB", "AttnRes act. MiB",
                              "Llama act. MiB", "ratio", "prefill's own ratio"], memory_rows(args)))


if __name__ == "__main__":
    main()
