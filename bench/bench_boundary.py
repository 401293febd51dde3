"""One sublayer boundary on a CPU, per call: AttnRes's C++ kernel against Llama's fused add+RMSNorm.

    python bench/bench_boundary.py                         # hidden 576 (SmolLM2), bfloat16, 1..4096 tokens
    python bench/bench_boundary.py --hidden-size 1024 --dtype float32 --tokens 1 512 --sources 0 8
    python bench/bench_boundary.py --baseline vllm         # vLLM's own CPU op as the Llama side
    python bench/bench_boundary.py --baseline vllm --via op --tokens 1 32   # both as a compiled graph calls them
    python bench/bench_boundary.py --baseline vllm --cold --tokens 1024 --sources 0 4 8   # as inside a layer

What a model does between two sublayers, on the same shapes, in one process:
- `AttnRes`: `depth_attention_ops.site_boundary` as both models call it in eager CPU inference (the C++
  kernel): the sublayer's output added into the float32 partial, the mix of `n` stored sources and the
  partial, the next sublayer's RMSNorm. With `--via op`, the same kernel called as the dispatcher op
  `attnres::site_boundary`, as vLLM's compiled graphs call it (its arguments go through the op's schema).
  A boundary that closes a block also writes one bank row; the table times the others, which are most
  of them.
- `Llama`: `residual += output; output = RMSNorm(residual)` in place, one call: `bench/fused_llama.py`'s
  kernel (built as AttnRes's is), or with `--baseline vllm` vLLM's `_C.fused_add_rms_norm`, the op
  vLLM's Llama calls there.
- `Llama (A/A)`: the same op on its own tensors, timed the same way: the control.

Each repeat times `--calls` calls of each, in a rotating order (`common.alternate`); the table gives
median microseconds per call, the paired ratios (median, min-max) and what AttnRes adds per token.
The end-to-end effect is `bench_vllm.py`'s and `bench_transformers.py`'s to measure; this script says
where it comes from (how the kernel's cost grows with the tokens of a step and the stored sources).

`--cold` times each call alone after flushing the caches (writing a buffer of `--flush-mib` MiB, several
times the last-level cache) and writing the sublayer's output: the state a boundary meets inside a
model, where a layer's weights and activations have passed through the caches since the bank was last
read and the output was just written by the sublayer's last matrix product. It also prints the
machine's memory read bandwidth (a float32 sum over 512 MiB), the figure a byte floor divides by.
"""

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, footer, header, markdown_table, ratios, spread  # noqa: E402
from fused_llama import fused_add_rms_norm_op  # noqa: E402

from modeling_attnres.depth_attention import empty_bank, push_source  # noqa: E402
from modeling_attnres.depth_attention_cpu import cpu_kernel_applies  # noqa: E402
from modeling_attnres.depth_attention_ops import site_boundary  # noqa: E402

EPS = 1e-6
NAMES = ("AttnRes", "Llama", "Llama (A/A)")


def llama_op(baseline: str):
    """The in-place `op(x, residual, weight, eps)` of the Llama side."""
    if baseline == "vllm":
        import vllm._C  # noqa: F401  (registers torch.ops._C)

        return torch.ops._C.fused_add_rms_norm
    return fused_add_rms_norm_op()


def attnres_call(tokens: int, d: int, sources: int, dtype: torch.dtype, via: str = "extension"):
    """A boundary over `sources` stored rows (of a bank with room for `sources + 1`), as the models call it:
    through the extension (eager code) or, `via="op"`, as the dispatcher op `attnres::site_boundary` a
    compiled graph calls (vLLM's, with `ATTNRES_CPU_KERNEL=compiled`)."""
    gen = torch.Generator().manual_seed(sources)
    embeds = torch.randn(tokens, d, generator=gen).to(dtype)
    bank = empty_bank(embeds, sources + 1, dtype)
    for _ in range(sources):
        bank = push_source(bank, torch.randn(tokens, d, generator=gen), EPS)
    partial, output = torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen).to(dtype)
    query, gain, norm = (torch.randn(1, d, generator=gen).to(dtype), torch.rand(d, generator=gen).to(dtype),
                         torch.rand(d, generator=gen).to(dtype))
    if not cpu_kernel_applies(partial):
        raise SystemExit("The AttnRes C++ kernel is off or could not be built (see the log line above); this "
                         "benchmark times it. Unset ATTNRES_CPU_KERNEL=0, or install a C++ compiler and ninja.")

    if via == "op":
        op = torch.ops.attnres.site_boundary.default
        args = (bank.storage, bank.inv_storage, sources, partial, output, query, gain, EPS, norm, 1e-5)
        # `fused_site_boundary`'s call in a compiled graph (a site that does not close a block)

        def call():
            op(*args)
    else:
        def call():
            site_boundary(bank, partial, output, query, gain, EPS, False, norm, 1e-5)
    return call, output


def llama_call(op, tokens: int, d: int, dtype: torch.dtype, seed: int):
    """Llama's boundary on its own tensors (`op` works in place; the values stay finite over many calls)."""
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(tokens, d, generator=gen).to(dtype) for _ in range(2))
    weight = torch.rand(d, generator=gen).to(dtype)

    def call():
        op(x, residual, weight, 1e-5)
    return call, x


def flushed(fn, output: torch.Tensor, flush: torch.Tensor):
    """`fn` timed alone (returns its seconds) after `flush` and then `output` were written: caches that
    hold nothing of the boundary's but the output its sublayer just wrote."""
    def call() -> float:
        flush.add_(1.0)
        output.mul_(1.0)
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return call


def repeated(fn, calls: int):
    """`fn` `calls` times: one timed unit (its seconds, where `fn` times itself)."""
    def run() -> float | None:
        own = [fn() for _ in range(calls)]
        return None if own[0] is None else sum(own)
    return run


def read_bandwidth(mib: int = 512) -> float:
    """GB/s of a float32 `sum` over `mib` MiB (the median of five): how fast this machine reads memory."""
    x = torch.ones(mib * 2**18)
    x.sum()
    seconds = []
    for _ in range(5):
        start = time.perf_counter()
        x.sum()
        seconds.append(time.perf_counter() - start)
    return x.numel() * 4 / statistics.median(seconds) / 1e9


def measure(args, op, tokens: int, sources: int, dtype: torch.dtype, flush: torch.Tensor | None) -> list:
    """One table row: median microseconds per call of each, and the paired ratios."""
    most = 16 if flush is not None else 2000                        # a flush costs milliseconds
    calls = args.calls or max(4, min(most, 262144 // tokens))       # ~the same time per repeat at every size
    makers = {NAMES[0]: lambda: attnres_call(tokens, args.hidden_size, sources, dtype, args.via),
              NAMES[1]: lambda: llama_call(op, tokens, args.hidden_size, dtype, 1),
              NAMES[2]: lambda: llama_call(op, tokens, args.hidden_size, dtype, 2)}
    runs = {}
    for name, make in makers.items():
        fn, output = make()
        runs[name] = repeated(fn if flush is None else flushed(fn, output, flush), calls)
    paired: list[dict[str, float]] = []
    seconds = alternate(runs, args.repeats, warmup=1, paired=paired)          # medians per timed unit
    us = {name: seconds[name] / calls * 1e6 for name in NAMES}
    extra_ns = (us[NAMES[0]] - us[NAMES[1]]) / tokens * 1e3
    return [tokens, sources, f"{us[NAMES[0]]:.1f}", f"{us[NAMES[1]]:.1f}", f"{us[NAMES[2]]:.1f}",
            spread(ratios(paired, NAMES[0], NAMES[1])), spread(ratios(paired, NAMES[2], NAMES[1])),
            f"{extra_ns:.1f}", len(paired)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    parser.add_argument("--sources", type=int, nargs="+", default=[0, 4, 8],
                        help="stored sources the boundary reads (SmolLM2 with block size 4: 1 to 8)")
    parser.add_argument("--baseline", choices=("fused-llama", "vllm"), default="fused-llama")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--calls", type=int, default=0, help="calls per timed unit (default: by size)")
    parser.add_argument("--via", choices=("extension", "op"), default="extension",
                        help="how AttnRes's boundary is called: the extension (eager code) or the dispatcher op "
                             "(compiled graphs); vLLM's op (--baseline vllm) is a dispatcher op")
    parser.add_argument("--cold", action="store_true", help="flush the caches before every call (see above)")
    parser.add_argument("--flush-mib", type=int, default=128, help="the buffer --cold writes to flush the caches")
    args = parser.parse_args()
    bad = [f"--{k} {v}" for k, v in (("tokens", args.tokens), ("sources", args.sources))
           if any(x < (1 if k == "tokens" else 0) for x in v)]
    bad += [f"--{k} {v}" for k, v, least in (("repeats", args.repeats, 2), ("hidden-size", args.hidden_size, 1),
                                             ("flush-mib", args.flush_mib, 1)) if v < least]
    if bad:
        parser.error(f"{', '.join(bad)}: expected tokens >= 1, sources >= 0, repeats >= 2, a positive hidden size "
                     "and a positive --flush-mib")
    dtype = getattr(torch, args.dtype)
    op = llama_op(args.baseline)
    with torch.inference_mode():                                  # as the models run: no autograd
        flush = torch.zeros(args.flush_mib * 2**18) if args.cold else None
        rows = [measure(args, op, tokens, sources, dtype, flush) for tokens in args.tokens
                for sources in args.sources]
    caches = f"flushed before every call ({args.flush_mib} MiB written)" if args.cold else "warm (calls back to back)"
    print(header("One sublayer boundary, AttnRes's C++ kernel / Llama's fused add+RMSNorm", {
        "hidden": args.hidden_size, "dtype": args.dtype, "Llama side": args.baseline, "AttnRes called via": args.via,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(), "caches": caches}))
    print()
    if args.cold:
        print(f"memory read bandwidth: {read_bandwidth():.1f} GB/s (a float32 sum over 512 MiB, median of 5)")
        print()
    print(markdown_table(["tokens", "stored sources", "AttnRes us", "Llama us", "Llama (A/A) us",
                          "AttnRes / Llama (median, min-max)", "A/A (median, min-max)",
                          "AttnRes - Llama per token, ns", "pairs"], rows))
    print()
    print(footer())


if __name__ == "__main__":
    main()
