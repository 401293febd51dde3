"""AttnRes vs the same-size Llama in transformers on one GPU, with an A/A control: prefill, decode, memory.

    python bench/gpu/bench_models.py                          # bfloat16, Llama-3-8B shapes, block size 4
    python bench/gpu/bench_models.py --compiled --num-hidden-layers 8 --decode-batches 1 32
    TRITON_INTERPRET=1 python bench/gpu/bench_models.py --device cpu --hidden-size 64 --num-hidden-layers 2 \\
        --num-attention-heads 2 --num-key-value-heads 1 --intermediate-size 128 --vocab-size 256 \\
        --prefill-tokens 8 --prompt-tokens 4 --new-tokens 2 --decode-batches 1 --repeats 2   # a dry run

Random models of the same dimensions (`bench/common.build`), held at once: AttnRes, Llama and a second
Llama with the same weights (the A/A control). Eager, AttnRes runs twice, its depth sites on the Triton
kernels (the default on a GPU) and on the torch path (`enable_triton_kernel(False)`). Each workload is
one whole `generate()` call per model, as users run it; every repeat makes fresh random prompts shared
by all models, which run in the rotating order of `common.rotation` after an untimed warm-up at the
timed size, and must all produce the same number of tokens. Each AttnRes/Llama ratio is printed with
its pairs' min-max and, beside it, the A/A ratio (Llama (A/A)/Llama) measured the same way. The models
are built in one order (AttnRes, Llama, Llama (A/A)) for half the repeats, then freed and built in the
reverse order for the other half (`--build-order both`, the default): each order's rows are printed as
measured, then the pairs of both pooled, so that where a model's memory landed does not pass for a
difference between the models.

`--compiled` runs transformers' recipe for fast decoding instead: `generate(..., cache_implementation=
"static", compile_config=CompileConfig(mode="reduce-overhead", fullgraph=True))`, which compiles the
decoding step with CUDA graphs (the prefill stays eager there, so compiled mode times decoding only).
Rows are printed as they are measured, so that a run cut short by a time limit keeps what it measured.
Peak memory (eager): the most a prefill allocates, per model.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from bench_transformers import BUILD_ORDERS as ORDERS  # noqa: E402
from bench_transformers import LABELS, generate_fn  # noqa: E402
from common import (  # noqa: E402
    add_size_arguments,
    balanced,
    build,
    footer,
    header,
    markdown_table,
    median_ms,
    ratios,
    rotate_runs,
    spread,
)

from modeling_attnres.depth_attention_ops import site_backend  # noqa: E402
from modeling_attnres.depth_attention_triton import enable_triton_kernel  # noqa: E402

LLAMA_3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, block_size=4)
COLUMNS = ["workload", "AttnRes", "AttnRes ms", "Llama ms", "Llama (A/A) ms", "AttnRes / Llama (median, min-max)",
           "A/A: Llama (A/A) / Llama (median, min-max)", "pairs"]


class Runner:
    """One model as the benchmark runs it: a `generate()` call and, for AttnRes, which depth-attention
    backend is on while it runs."""

    def __init__(self, model, mode: str, new_tokens: int, device: str, triton: bool | None = None):
        self.model, self.triton = model, triton
        self.generate = generate_fn(model, mode, new_tokens, device)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self.triton is not None:
            enable_triton_kernel(self.triton)
        return self.generate(ids)


def runners_for(models: dict, args, new_tokens: int) -> dict[str, Runner]:
    """Eager: AttnRes on Triton, AttnRes on the torch path, Llama, Llama (A/A); compiled: AttnRes (the
    torch path, which Inductor compiles), Llama, Llama (A/A)."""
    mode = "compiled" if args.compiled else "eager"
    if args.compiled:
        found = {"attnres": Runner(models["attnres"], mode, new_tokens, args.device, triton=False)}
    else:
        found = {"attnres-triton": Runner(models["attnres"], mode, new_tokens, args.device, triton=True),
                 "attnres-torch": Runner(models["attnres"], mode, new_tokens, args.device, triton=False)}
    found["llama"] = Runner(models["llama"], mode, new_tokens, args.device)
    found["llama-2"] = Runner(models["llama-2"], mode, new_tokens, args.device)
    return found


def workload_rows(name: str, runs: list[dict], runners: dict) -> list[list]:
    """One row per AttnRes variant: its ratio to Llama and the A/A ratio beside it."""
    return [[name, kind.removeprefix("attnres-"), median_ms(runs, kind), median_ms(runs, "llama"),
             median_ms(runs, "llama-2"), spread(ratios(runs, kind, "llama")), spread(ratios(runs, "llama-2", "llama")),
             len(runs)] for kind in runners if kind.startswith("attnres")]


def random_ids(args, batch: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, args.vocab_size, (batch, tokens), generator=gen).to(args.device)


def peak_memory_rows(models: dict, args) -> list[list]:
    """The most one prefill allocates, per model (the other models stay resident, so only the growth
    over what was allocated before counts), with the weights."""
    peaks = {}
    ids = random_ids(args, 1, args.prefill_tokens, 99)
    for kind in ORDERS["forward"]:
        model = models[kind]
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        enable_triton_kernel(True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        generate_fn(model, "eager", 1, args.device)(ids)
        torch.cuda.synchronize()
        peaks[kind] = ((torch.cuda.max_memory_allocated() - before) / 2**20, weights / 2**20)
    return [[f"prefill 1x{args.prefill_tokens}", kind, f"{peaks[kind][1]:.0f}", f"{peaks[kind][0]:.0f}",
             f"**{peaks[kind][0] / peaks['llama'][0]:.3f}**"] for kind in ORDERS["forward"]]


def check_backends_agree(args, dtype: torch.dtype, layers: int = 4) -> tuple[str, bool]:
    """The AttnRes logits with the Triton kernels and with the torch path, on one prompt, for a model of
    the benchmark's width and `layers` layers: in a deep random bfloat16 model the two paths' rounding
    differences grow layer by layer until the logits no longer compare (0.16 of the largest at 32
    layers, 0.008 at 4), which would hide what the check is for. The pseudo-queries start at zero
    (uniform weights); they get random values first so that the check sees real softmaxes. Returns the
    error relative to the largest logit and whether it is within bfloat16's few ulps."""
    small = argparse.Namespace(**{**vars(args), "num_hidden_layers": min(layers, args.num_hidden_layers)})
    model = build("attnres", small, dtype, device=args.device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_res_proj" in name:
                param.normal_(0, model.config.hidden_size**-0.5)
    ids = torch.randint(0, args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1)).to(args.device)
    logits = {}
    with torch.inference_mode():
        for triton in (True, False):
            enable_triton_kernel(triton)
            logits[triton] = model(ids, use_cache=False).logits.float()
    error = float((logits[True] - logits[False]).abs().max() / logits[False].abs().max().clamp(min=1e-6))
    del model
    return f"{error:.1e}", error <= 2e-2


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.set_defaults(**LLAMA_3_8B)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=16,
                        help="paired repeats (balanced: a multiple of 8 eager, of 6 compiled)")
    parser.add_argument("--build-order", choices=("both", *ORDERS), default="both",
                        help="both: half the repeats with the models built forward, half reversed, pooled")
    parser.add_argument("--compiled", action="store_true", help="generate() with a static cache and CUDA graphs")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the Triton kernels only under Triton's interpreter: set TRITON_INTERPRET=1")
    return args


def build_models(args, dtype: torch.dtype, order: list[str]) -> dict:
    """AttnRes, Llama and the A/A Llama, built in `order`."""
    return {kind: build(kind.removesuffix("-2"), args, dtype, device=args.device) for kind in order}


def time_workloads(args, models: dict, shapes: list, repeats: int, order: str, seed: int) -> dict[str, list]:
    """Each workload's runs with `models`, each row printed as soon as it is measured (a run cut short by
    its time limit keeps them)."""
    found = {}
    for index, (kind, batch, tokens, new) in enumerate(shapes):
        name = f"prefill 1x{tokens}" if kind == "prefill" else f"decode {batch}x{new} (prompt {tokens})"
        runners = runners_for(models, args, new)
        found[name] = rotate_runs(
            runners, lambda repeat, b=batch, t=tokens, i=index: random_ids(args, b, t, seed + 1000 * i + repeat),
            repeats, count=lambda out: tuple(out.shape))
        for row in workload_rows(name, found[name], runners):
            print("| " + " | ".join(str(c) for c in [order, *row]) + " |", flush=True)
    return found


def main() -> None:
    args = parse_args()
    dtype = getattr(torch, args.dtype)
    with torch.inference_mode():
        enable_triton_kernel(True)
        backend = site_backend(torch.zeros(1, device=args.device))
    agree, agreed = ("-", True) if args.compiled else check_backends_agree(args, dtype)
    orders = list(ORDERS) if args.build_order == "both" else [args.build_order]
    per_order = -(-args.repeats // len(orders))
    runners = 3 if args.compiled else 4
    mode = ("generate() with a static cache, compile_config(mode='reduce-overhead', fullgraph=True): CUDA graphs; "
            "AttnRes sites on the torch path, compiled by Inductor") if args.compiled else (
            f"eager generate(); AttnRes sites on {backend} and on the torch path (Triton vs torch logits of a "
            f"{min(4, args.num_hidden_layers)}-layer model of this width agree to {agree} of the largest)")
    settings = {"dtype": args.dtype, "mode": mode, "device": args.device,
                "build orders": " then ".join(f"{o} ({', '.join(LABELS[k] for k in ORDERS[o])})" for o in orders),
                "repeats": f"{per_order} per build order in rotating order "
                           f"({'balanced' if balanced(per_order, runners) else 'unbalanced'})",
                "prompts": "fresh random token ids every repeat, shared by all models; warm-up at the timed size"}
    print(header(f"transformers on one GPU, AttnRes / Llama with an A/A control: random weights, hidden "
                 f"{args.hidden_size}, {args.num_hidden_layers} layers, block size {args.block_size}, vocab "
                 f"{args.vocab_size}", settings) + "\n", flush=True)
    shapes = [] if args.compiled else [("prefill", 1, args.prefill_tokens, 1)]
    shapes += [("decode", b, args.prompt_tokens, args.new_tokens) for b in args.decode_batches]
    print(markdown_table(["build order", *COLUMNS], []), flush=True)
    pooled: dict[str, list] = {}
    for i, order in enumerate(orders):
        models = build_models(args, dtype, ORDERS[order])
        for name, runs in time_workloads(args, models, shapes, per_order, order, 1_000_000 * i).items():
            pooled.setdefault(name, []).extend(runs)
        if i + 1 < len(orders):
            del models
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print("\n" + markdown_table(COLUMNS, [row for name, runs in pooled.items()
                                          for row in workload_rows(name, runs, runners_for(models, args, 1))]))
    print(f"\n(pooled over the build orders: {', '.join(orders)})")
    if args.device == "cuda" and not args.compiled:
        print("\n" + markdown_table(["memory", "model", "weights MiB", "a prefill's own peak MiB",
                                     "/ Llama's"], peak_memory_rows(models, args)))
    print(footer())
    if not agreed:                     # after the timings, which do not depend on it
        sys.exit(f"FAILED: AttnRes logits differ between the Triton kernels and the torch path by {agree} of the "
                 "largest logit (expected <= 2e-2 in bfloat16)")


if __name__ == "__main__":
    main()
