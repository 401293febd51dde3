"""Kernel-level timing of the depth mix, against the bytes it must move (GPU, or CPU with --device cpu).

    python bench/gpu/bench_kernel.py            # bf16, hidden 4096, the shapes of a 32-layer model
    python bench/gpu/bench_kernel.py --device cpu --dtype float32 --hidden-size 1024 --sources 8 --tokens 1 8 512

One site reads the stored sources `[tokens, n, d]` and the partial `[tokens, d]` and writes the
mix `[tokens, d]`; at best it is bandwidth-bound, so the table reports achieved GB/s for that byte
count (an H200's HBM3e peaks near 4.8 TB/s) and the time per token.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import markdown_table  # noqa: E402

from modeling_attnres.depth_attention import empty_bank, mix_site, push_source  # noqa: E402


def time_site(tokens: int, n: int, d: int, dtype: torch.dtype, iters: int, device: str) -> float:
    """Mean seconds per call of one site: `n` stored sources, `tokens` flat token rows."""
    bank = empty_bank(torch.empty(tokens, d, device=device))
    for _ in range(n):
        bank = push_source(bank, torch.randn(tokens, d, device=device, dtype=dtype), 1e-6)
    partial = torch.randn(tokens, d, device=device, dtype=dtype)
    query = torch.randn(d, device=device, dtype=torch.float32)
    with torch.inference_mode():
        for _ in range(5):
            mix_site(bank, partial, query, 1e-6, dtype)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            mix_site(bank, partial, query, 1e-6, dtype)
        if device == "cuda":
            torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 4, 9, 17])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    size = torch.finfo(dtype).bits // 8
    rows = []
    for tokens in args.tokens:
        for n in args.sources:
            seconds = time_site(tokens, n, args.hidden_size, dtype, args.iters, args.device)
            # float32 bank (n sources), the partial in and the mix out in `dtype`
            moved = tokens * args.hidden_size * (4 * n + 2 * size)
            rows.append([tokens, n, f"{seconds * 1e6:.1f}", f"{moved / 2**20:.2f}", f"{moved / seconds / 1e9:.0f}",
                         f"{seconds / tokens * 1e9:.0f}"])
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}, {args.dtype}, hidden {args.hidden_size}\n")
    print(markdown_table(["tokens", "stored sources", "us / site", "MiB moved", "GB/s", "ns / token"], rows))


if __name__ == "__main__":
    main()
