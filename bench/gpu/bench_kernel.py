"""Kernel-level timing of the depth mix on a GPU, against the bytes it must move.

    python bench/gpu/bench_kernel.py            # bf16, hidden 4096, the shapes of a 32-layer model

One site reads the stored sources `[tokens, n, d]` and the partial `[tokens, d]` and writes the
mix `[tokens, d]`; at best it is bandwidth-bound, so the table reports achieved GB/s for that byte
count (an H200's HBM3e peaks near 4.8 TB/s) and the time per token.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import markdown_table  # noqa: E402

from modeling_attnres.depth_attention import mix_site  # noqa: E402


def time_site(tokens: int, n: int, d: int, dtype: torch.dtype, iters: int) -> float:
    """Median-free mean over `iters` CUDA-event-timed calls, seconds per call."""
    stored = torch.randn(tokens, n, d, device="cuda", dtype=dtype)
    partial = torch.randn(tokens, d, device="cuda", dtype=dtype)
    query = torch.randn(d, device="cuda", dtype=torch.float32)
    for _ in range(5):
        mix_site(stored, partial, query, 1e-6)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        mix_site(stored, partial, query, 1e-6)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 4, 9, 17])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    rows = []
    for tokens in args.tokens:
        for n in args.sources:
            seconds = time_site(tokens, n, args.hidden_size, dtype, args.iters)
            moved = tokens * args.hidden_size * size * (n + 2)
            rows.append([tokens, n, f"{seconds * 1e6:.1f}", f"{moved / 2**20:.2f}", f"{moved / seconds / 1e9:.0f}",
                         f"{seconds / tokens * 1e9:.0f}"])
    print(f"{torch.cuda.get_device_name()}, {args.dtype}, hidden {args.hidden_size}\n")
    print(markdown_table(["tokens", "stored sources", "us / site", "MiB moved", "GB/s", "ns / token"], rows))


if __name__ == "__main__":
    main()
