"""One sublayer boundary on a CPU, per call: AttnRes's C++ kernel against Llama's fused add+RMSNorm.

    python bench/bench_boundary.py                         # hidden 576 (SmolLM2), bfloat16, 1..4096 tokens
    python bench/bench_boundary.py --hidden-size 1024 --dtype float32 --tokens 1 512 --sources 0 8
    python bench/bench_boundary.py --baseline vllm         # vLLM's own CPU op as the Llama side
    python bench/bench_boundary.py --baseline vllm --via op --tokens 1 32   # both as a compiled graph calls them
    python bench/bench_boundary.py --baseline vllm --cold --tokens 1024 --sources 0 4 8   # as inside a layer
    python bench/bench_boundary.py --against HEAD~1 --cold --tokens 1024      # this kernel against an earlier one

What a model does between two sublayers, on the same shapes, in one process:
- `AttnRes`: `depth_attention_ops.site_boundary` as vLLM's model calls it in eager CPU inference (the C++
  kernel): the sublayer's output added into the float32 partial (in place, as past a model's first
  layer), the mix of `n` stored sources and the partial, the next sublayer's RMSNorm written over the
  output (in place, as Llama's). With `--via op`, the same kernel called as the dispatcher op
  `attnres::site_boundary_reuse_into`, as vLLM's compiled graphs
  call it (its arguments go through the op's schema). A boundary that closes a block also writes one
  bank row; the table times the others, which are most of them.
- `Llama`: `residual += output; output = RMSNorm(residual)` in place, one call: `bench/fused_llama.py`'s
  kernel (built as AttnRes's is), or with `--baseline vllm` vLLM's `_C.fused_add_rms_norm`, the op
  vLLM's Llama calls there.
- `Llama (A/A)`: the same op on its own tensors, timed the same way: the control.

Each repeat times `--calls` calls of each, in a rotating order (`common.alternate`); the table gives
median microseconds per call, the paired ratios (median, min-max) and what AttnRes adds per token.
The end-to-end effect is `bench_vllm.py`'s and `bench_transformers.py`'s to measure; this script says
where it comes from (how the kernel's cost grows with the tokens of a step and the stored sources).

`--against REVISION` compares this checkout's kernel with another build of it instead of with Llama: the
kernel's C++ source at a git revision of this repository (or in a Python file that defines it, as
`modeling_attnres/depth_attention_cpu_source.py` does), compiled with the same flags and loaded beside it
in the same process. Both are called directly as their extensions, the A/A control is the other build on
its own tensors, and a column gives the largest difference between the two builds' outputs on the same
inputs (0 where a change only moved time). Its C++ `site_boundary` must take this kernel's arguments (a
build from before `reuse_partial` or `consume_output` existed is called without them, writing fresh
partials or normed mixes).

`--cold` times each call alone after flushing the caches (writing a buffer of `--flush-mib` MiB, several
times the last-level cache) and writing the sublayer's output: the state a boundary meets inside a
model, where a layer's weights and activations have passed through the caches since the bank was last
read and the output was just written by the sublayer's last matrix product. It also prints the
machine's memory read bandwidth (a float32 sum over 512 MiB), the figure a byte floor divides by.
"""

import argparse
import ast
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, footer, header, markdown_table, ratios, spread  # noqa: E402
from fused_llama import fused_add_rms_norm_op  # noqa: E402

from modeling_attnres import depth_attention_cpu  # noqa: E402
from modeling_attnres.depth_attention import DepthBank, empty_bank, push_source  # noqa: E402
from modeling_attnres.depth_attention_cpu import cpu_kernel_applies, extension_name, load_inline  # noqa: E402
from modeling_attnres.depth_attention_ops import site_boundary  # noqa: E402

EPS = 1e-6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_FILES = ("modeling_attnres/depth_attention_cpu_source.py",   # where the kernel's source lives
                "modeling_attnres/depth_attention_cpu.py")          # where it lived before (up to 13727b4)


def llama_op(baseline: str):
    """The in-place `op(x, residual, weight, eps)` of the Llama side."""
    if baseline == "vllm":
        from vllm.platforms import current_platform

        # vLLM's loader, not `import vllm._C`: that build needs AVX512-BF16 (SIGILL elsewhere), and the
        # loader picks the build for this CPU (`_C_AVX512`, `_C_AVX2`), each registering torch.ops._C.
        current_platform.import_kernels()

        return torch.ops._C.fused_add_rms_norm
    return fused_add_rms_norm_op()


def boundary_inputs(tokens: int, d: int, sources: int, dtype: torch.dtype, seed: int = 0) -> tuple:
    """The extension's `site_boundary` arguments at a site that does not close a block: `sources` stored rows
    (of a bank with room for `sources + 1`), the partial, the sublayer's output, the site's query and gain,
    the next norm's weight."""
    gen = torch.Generator().manual_seed(sources + 1000 * seed)
    embeds = torch.randn(tokens, d, generator=gen).to(dtype)
    bank = empty_bank(embeds, sources + 1, dtype)
    for _ in range(sources):
        bank = push_source(bank, torch.randn(tokens, d, generator=gen), EPS)
    partial, output = torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen).to(dtype)
    query, gain, norm = (torch.randn(1, d, generator=gen).to(dtype), torch.rand(d, generator=gen).to(dtype),
                         torch.rand(d, generator=gen).to(dtype))
    return (bank.storage, bank.inv_storage, sources, partial, output, query, gain, EPS, False, norm, 1e-5, dtype,
            False, False)


def in_place_flags(kernel) -> tuple:
    """The trailing arguments that make a built kernel's `site_boundary` work in place as the vLLM model calls
    it: `reuse_partial` (its 15th argument) and `consume_output` (its 16th), as far as that build takes them
    (earlier builds wrote every new partial, or every normed mix, to a fresh tensor)."""
    doc = kernel.site_boundary.__doc__ or ""
    return tuple(True for arg in ("arg14", "arg15") if arg in doc)


def attnres_call(tokens: int, d: int, sources: int, dtype: torch.dtype, via: str = "extension", kernel=None,
                 seed: int = 0):
    """A boundary on `boundary_inputs`, as vLLM's model calls it past its first layer (the new partial
    written into the partial it was given, the normed mix over the output): through the extension (eager
    code) or, `via="op"`, as the dispatcher op `attnres::site_boundary_reuse_into` a compiled graph calls
    (vLLM's, with `ATTNRES_CPU_KERNEL=compiled`). With `kernel` (a built extension), its `site_boundary`
    called directly (in place where that build can). Returns the call and the output tensor the sublayer
    writes."""
    args = boundary_inputs(tokens, d, sources, dtype, seed)
    storage, inv_storage, _, partial, output, query, gain, _, _, norm = args[:10]
    if not cpu_kernel_applies(partial):
        raise SystemExit("The AttnRes C++ kernel is off or could not be built (see the log line above); this "
                         "benchmark times it. Unset ATTNRES_CPU_KERNEL=0, or install a C++ compiler and ninja.")

    if kernel is not None:
        args += in_place_flags(kernel)

        def call():     # `fused_site_boundary`'s eager call, without its Python frame
            kernel.site_boundary(*args)
    elif via == "op":
        op = torch.ops.attnres.site_boundary_reuse_into.default
        op_args = (storage, inv_storage, sources, partial, output, query, gain, EPS, norm, 1e-5)
        # `fused_site_boundary`'s call in a compiled graph (a site that does not close a block)

        def call():
            op(*op_args)
    else:
        bank = DepthBank(storage, inv_storage, sources)

        def call():
            site_boundary(bank, partial, output, query, gain, EPS, False, norm, 1e-5, reuse_partial=True,
                          consume_output=True)
    return call, output


def string_value(node: ast.expr, strings: dict[str, str]) -> str | None:
    """The value of a string literal, a name of one in `strings`, or a `+` of such; None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return strings.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = string_value(node.left, strings), string_value(node.right, strings)
        return None if left is None or right is None else left + right
    return None


def source_strings(text: str, origin: str) -> dict[str, str]:
    """The module-level strings a Python file defines from literals and each other (`X = r"..." + Y`),
    read without running the file: the kernel's source wherever a revision kept it."""
    try:
        body = ast.parse(text).body
    except SyntaxError as error:
        raise SystemExit(f"--against {origin}: not Python ({error}). Expected a revision of this repository or "
                         "a Python file defining KERNEL_SOURCE.") from error
    strings: dict[str, str] = {}
    for node in body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = string_value(node.value, strings)
            if value is not None:
                strings[node.targets[0].id] = value
    return strings


def git(root: str, *args: str) -> subprocess.CompletedProcess:
    """`git -C root args...`, its output captured (exit status 127 where git is not installed)."""
    try:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        return subprocess.CompletedProcess(["git"], 127, "", "git is not installed")


def kernel_source_at(against: str, root: str = ROOT) -> tuple[str, str]:
    """(label, C++ source) of the kernel `--against` names: a Python file that defines `KERNEL_SOURCE`, or
    a git revision of the repository at `root` (whichever file held the source there)."""
    if os.path.isfile(against):
        with open(against) as handle:
            texts, label = [handle.read()], os.path.basename(against)
    else:
        shown = [git(root, "show", f"{against}:{path}") for path in SOURCE_FILES]
        texts = [done.stdout for done in shown if done.returncode == 0]
        label = git(root, "rev-parse", "--short", against).stdout.strip() or against
        if not texts:
            raise SystemExit(f"--against {against!r}: not a file, and git found no kernel source at that revision "
                             f"of {root} ({shown[-1].stderr.strip()}). Expected a revision of this repository "
                             "such as HEAD~1, or a Python file defining KERNEL_SOURCE.")
    for text in texts:
        strings = source_strings(text, against)
        source = strings.get("KERNEL_SOURCE") or strings.get("_SOURCE")
        if source and "site_boundary" in source:
            return label, source
    raise SystemExit(f"--against {against!r}: no KERNEL_SOURCE (or _SOURCE) string with a site_boundary function "
                     "in it. Expected a revision of this repository or a Python file defining KERNEL_SOURCE.")


def build_kernel(label: str, source: str):
    """`source` compiled as this checkout's kernel is (same flags and headers option), under a name of its own."""
    name = extension_name("attnres_bench_against", source)
    try:
        return load_inline(name, source, ["site_boundary"])
    except Exception as error:
        raise SystemExit(f"--against: the kernel at {label} did not build ({type(error).__name__}: "
                         f"{str(error)[-2000:]})") from error


def largest_differences(kernels: list, label: str, tokens: int, d: int, sources: int, dtype: torch.dtype) -> str:
    """The largest |difference| between the two kernels' normed outputs and new partials on the same inputs,
    each called as it is timed (in place on its own copies where it can)."""
    results = []
    for kernel in kernels:
        args = boundary_inputs(tokens, d, sources, dtype, seed=3)    # the same values, fresh for each
        try:
            results.append(kernel.site_boundary(*args, *in_place_flags(kernel)))
        except (TypeError, RuntimeError) as error:
            raise SystemExit(f"--against: the kernel at {label} does not take this kernel's arguments, or refused "
                             f"them ({type(error).__name__}: {str(error)[:600]}). Compare with a revision whose "
                             "site_boundary has the same signature.") from error
    (partial_a, _, normed_a, _), (partial_b, _, normed_b, _) = results
    if partial_a.shape != partial_b.shape or normed_a.shape != normed_b.shape:
        raise SystemExit(f"--against: the two kernels return different shapes ({tuple(normed_a.shape)} against "
                         f"{tuple(normed_b.shape)})")
    return " / ".join(f"{(a.double() - b.double()).abs().max().item():.2e}"
                      for a, b in ((normed_a, normed_b), (partial_a, partial_b)))


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


def llama_sides(op, d: int, dtype: torch.dtype, via: str):
    """AttnRes against Llama's add+norm `op`, and the A/A control: the names and, per row, their calls."""
    names = ("AttnRes", "Llama", "Llama (A/A)")

    def makers(tokens: int, sources: int) -> dict:
        return {names[0]: lambda: attnres_call(tokens, d, sources, dtype, via),
                names[1]: lambda: llama_call(op, tokens, d, dtype, 1),
                names[2]: lambda: llama_call(op, tokens, d, dtype, 2)}
    return names, makers


def against_sides(kernels: list, label: str, d: int, dtype: torch.dtype):
    """This checkout's kernel against the build `kernels[1]` (at `label`), the control being that build on
    tensors of its own: the names and, per row, their calls."""
    names = ("AttnRes", f"AttnRes at {label}", f"AttnRes at {label} (A/A)")

    def makers(tokens: int, sources: int) -> dict:
        return {name: (lambda kernel=kernel, seed=seed: attnres_call(tokens, d, sources, dtype, kernel=kernel,
                                                                      seed=seed))
                for seed, (name, kernel) in enumerate(zip(names, (kernels[0], kernels[1], kernels[1])))}
    return names, makers


def measure(args, names: tuple, makers: dict, tokens: int, sources: int, flush: torch.Tensor | None) -> list:
    """One table row: median microseconds per call of each, and the paired ratios."""
    most = 16 if flush is not None else 2000                        # a flush costs milliseconds
    calls = args.calls or max(4, min(most, 262144 // tokens))       # ~the same time per repeat at every size
    runs = {}
    for name, make in makers.items():
        fn, output = make()
        runs[name] = repeated(fn if flush is None else flushed(fn, output, flush), calls)
    paired: list[dict[str, float]] = []
    seconds = alternate(runs, args.repeats, warmup=1, paired=paired)          # medians per timed unit
    us = {name: seconds[name] / calls * 1e6 for name in names}
    extra_ns = (us[names[0]] - us[names[1]]) / tokens * 1e3
    return [tokens, sources, f"{us[names[0]]:.1f}", f"{us[names[1]]:.1f}", f"{us[names[2]]:.1f}",
            spread(ratios(paired, names[0], names[1])), spread(ratios(paired, names[2], names[1])),
            f"{extra_ns:.1f}", len(paired)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=576)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024, 4096])
    parser.add_argument("--sources", type=int, nargs="+", default=[0, 4, 8],
                        help="stored sources the boundary reads (SmolLM2 with block size 4: 1 to 8)")
    parser.add_argument("--baseline", choices=("fused-llama", "vllm"), default=None,
                        help="the Llama side (default: fused-llama)")
    parser.add_argument("--against", metavar="REVISION",
                        help="compare with the kernel at this git revision (or in this Python file) instead of "
                             "with Llama (see above)")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--calls", type=int, default=0, help="calls per timed unit (default: by size)")
    parser.add_argument("--via", choices=("extension", "op"), default="extension",
                        help="how AttnRes's boundary is called: the extension (eager code) or the dispatcher op "
                             "(compiled graphs); vLLM's op (--baseline vllm) is a dispatcher op")
    parser.add_argument("--cold", action="store_true", help="flush the caches before every call (see above)")
    parser.add_argument("--flush-mib", type=int, default=128, help="the buffer --cold writes to flush the caches")
    args = parser.parse_args(argv)
    bad = [f"--{k} {v}" for k, v in (("tokens", args.tokens), ("sources", args.sources))
           if any(x < (1 if k == "tokens" else 0) for x in v)]
    bad += [f"--{k} {v}" for k, v, least in (("repeats", args.repeats, 2), ("hidden-size", args.hidden_size, 1),
                                             ("flush-mib", args.flush_mib, 1)) if v < least]
    if bad:
        parser.error(f"{', '.join(bad)}: expected tokens >= 1, sources >= 0, repeats >= 2, a positive hidden size "
                     "and a positive --flush-mib")
    if args.against and (args.baseline or args.via == "op"):
        parser.error(f"--against {args.against} compares two builds of AttnRes's kernel, both called as extensions: "
                     "--baseline and --via op do not apply to it; drop them or drop --against")
    args.baseline = None if args.against else (args.baseline or "fused-llama")
    return args


def main() -> None:
    args = parse_args()
    dtype, d = getattr(torch, args.dtype), args.hidden_size
    with torch.inference_mode():                                  # as the models run: no autograd
        if args.against:
            label, source = kernel_source_at(args.against)
            attnres_call(1, d, 0, dtype)                          # builds (or loads) this checkout's kernel
            kernels = [depth_attention_cpu._build(), build_kernel(label, source)]   # the first: as the models load it
            names, makers = against_sides(kernels, label, d, dtype)
            title, sides = f"One sublayer boundary, AttnRes's C++ kernel / the kernel at {label}", {"against": label}
        else:
            names, makers = llama_sides(llama_op(args.baseline), d, dtype, args.via)
            title = "One sublayer boundary, AttnRes's C++ kernel / Llama's fused add+RMSNorm"
            sides = {"Llama side": args.baseline, "AttnRes called via": args.via}
        flush = torch.zeros(args.flush_mib * 2**18) if args.cold else None
        rows = []
        for tokens in args.tokens:
            for sources in args.sources:      # the difference first: a build that refuses the arguments stops
                differences = [largest_differences(kernels, label, tokens, d, sources, dtype)] if args.against else []
                rows.append(measure(args, names, makers(tokens, sources), tokens, sources, flush) + differences)
    caches = f"flushed before every call ({args.flush_mib} MiB written)" if args.cold else "warm (calls back to back)"
    print(header(title, {"hidden": d, "dtype": args.dtype, **sides, "repeats": args.repeats,
                         "threads": torch.get_num_threads(), "caches": caches}))
    print()
    if args.cold:
        print(f"memory read bandwidth: {read_bandwidth():.1f} GB/s (a float32 sum over 512 MiB, median of 5)")
        print()
    columns = ["tokens", "stored sources", *(f"{name} us" for name in names),
               f"{names[0]} / {names[1]} (median, min-max)", "A/A (median, min-max)",
               f"{names[0]} - {names[1]} per token, ns", "pairs"]
    columns += ["largest difference, normed output / partial"] if args.against else []
    print(markdown_table(columns, rows))
    print()
    print(footer())


if __name__ == "__main__":
    main()
