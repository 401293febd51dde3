"""Where a compiled decoding step's time goes: AttnRes, the same-size Llama and its A/A control, part by part.

    python bench/profile_step.py                               # random hidden 1024 x 16 layers, bfloat16, batch 1
    ATTNRES_CPU_KERNEL=compiled python bench/profile_step.py   # the C++ boundary op in AttnRes's graph
    python bench/profile_step.py --smollm2 --batch 8           # real weights against their source

The three models of `bench_transformers.py` (AttnRes, Llama, a second Llama on the same weights as the
A/A control) decode with `generate()` compiled as transformers' recipe does it (`--modes compiled` there:
a static cache and `compile_config`), each call under `torch.profiler` with Inductor's per-kernel
profiling on, in rotating order after two warm-up calls a model. The table gives, per model, the median
over `--repeats` calls of the milliseconds each part takes per new token (a call's time over its new
tokens), and each part's AttnRes - Llama and A/A - Llama differences (the latter: what separates
identical models, the error bar). A part is the profiler events' own times (children excluded); the
prompt's prefill, which transformers leaves uncompiled, adds its matrix products and attention to
those parts and its eager boundaries (AttnRes's C++ kernel, called directly) to the time outside any
event, with the Python of `generate()`'s loop. Generated kernels are told apart by name: those with a
`rsqrt` (an RMSNorm) are the residual path's (Llama's add+norm, AttnRes's boundaries; with `qk_norm`
also the attention's query/key norms). The profiler adds its own cost to every part: compare the
columns, not these totals with unprofiled timings (`bench_transformers.py` gives those).
"""

import argparse
import os
import statistics
import sys
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_transformers import DTYPES, LABELS, MODELS, build_models, generate_fn  # noqa: E402
from common import (  # noqa: E402
    add_model_arguments,
    add_size_arguments,
    balanced,
    check_model_arguments,
    describe,
    footer,
    header,
    markdown_table,
    rotation,
)

# The parts of a step, in table order; `part` puts each profiler event in exactly one of them.
PARTS = ("matrix products", "attention", "residual-path kernels", "other generated kernels",
         "the graph's Python wrapper", "Dynamo's guard checks", "other recorded ops (cache, sampling, ...)")
OUTSIDE = "outside any event (generate's Python, direct kernel calls)"      # the whole call less the parts


def part(name: str) -> str:
    """The part of a step that the profiler event `name` (its own time, children excluded) belongs to."""
    if name in ("aten::mm", "aten::addmm", "aten::bmm"):
        return PARTS[0]
    if name.startswith("aten::") and "attention" in name:
        return PARTS[1]
    if name.startswith("attnres::") or (name.startswith("graph_") and "rsqrt" in name):
        return PARTS[2]     # Llama's add+norm kernels, AttnRes's boundaries (generated, or the C++ op)
    if name.startswith("graph_"):
        return PARTS[3]
    if name.startswith("## Call CompiledFxGraph"):
        return PARTS[4]
    if name.startswith("TorchDynamo Cache Lookup"):
        return PARTS[5]
    return PARTS[6]


def profiled_step_ms(run, ids: torch.Tensor, steps: int) -> dict[str, float]:
    """One profiled `generate()` call: ms a new token per part, and the whole call's."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        run(ids)
        whole = (time.perf_counter() - start) * 1e3 / steps
    parts = dict.fromkeys(PARTS, 0.0)
    for event in prof.key_averages():
        parts[part(event.key)] += event.self_cpu_time_total / 1e3 / steps
    return {**parts, OUTSIDE: whole - sum(parts.values()), "whole call": whole}


def rows(runs: list[dict[str, dict[str, float]]]) -> list[list]:
    """Per part: each model's median, then AttnRes - Llama and A/A - Llama (medians of the per-call values)."""
    table = []
    for name in (*PARTS, OUTSIDE, "whole call"):
        medians = [statistics.median(run[kind][name] for run in runs) for kind in MODELS]
        table.append([name, *(f"{m:.3f}" for m in medians), f"{medians[0] - medians[1]:+.3f}",
                      f"{medians[2] - medians[1]:+.3f}"])
    return table


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=6, help="profiled calls a model (a multiple of 6 is balanced)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    for name, least in (("batch", 1), ("prompt_tokens", 1), ("new_tokens", 2), ("repeats", 1), ("threads", 1)):
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} must be at least {least} (the first new token comes from the "
                         f"uncompiled prefill), got {getattr(args, name)}." if name == "new_tokens" else
                         f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}.")
    check_model_arguments(parser, args)
    args.device, args.bank_dtype = "cpu", None
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    inductor_config.cpp.enable_kernel_profile = True      # each generated kernel becomes its own event
    settings = {"dtype": args.dtype, "decode": f"{args.batch} x {args.new_tokens} new tokens (prompt "
                f"{args.prompt_tokens})", "compiled": "generate(cache_implementation='static', compile_config=...)",
                "boundaries": "the C++ op" if os.environ.get("ATTNRES_CPU_KERNEL") == "compiled" else
                "Inductor's code", "repeats": f"{args.repeats} profiled calls a model in rotating order ("
                f"{'balanced' if balanced(args.repeats, 3) else 'not a multiple of 6: unbalanced'})"}
    print(header(f"transformers, a compiled decoding step part by part: {describe(args)}", settings) + "\n")
    models = build_models(args, DTYPES[args.dtype])
    runners = {kind: generate_fn(model, "compiled", args.new_tokens, "cpu") for kind, model in models.items()}
    vocab = models["llama"].config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    for kind in MODELS:                                   # compiles, then one call at the compiled steady state
        runners[kind](ids), runners[kind](ids)
    runs = []
    for repeat in range(args.repeats):
        ids = torch.randint(0, vocab, ids.shape, generator=torch.Generator().manual_seed(repeat + 1))
        runs.append({kind: profiled_step_ms(runners[kind], ids, args.new_tokens)
                     for kind in rotation(list(MODELS), repeat)})
    print(markdown_table(["part of a step (ms a new token, profiled)", *(LABELS[k] for k in MODELS), "AttnRes - Llama",
                          "A/A: Llama (A/A) - Llama"], rows(runs)))
    print(footer())


if __name__ == "__main__":
    main()
