"""The depth-attention kernels on a GPU: checked against the torch path, then timed against the bytes
they must move.

    python bench/gpu/bench_kernel.py                        # hidden 4096, the H200 figures of the README
    python bench/gpu/bench_kernel.py --tokens 1 4096 --sources 8 --bank-dtypes bfloat16
    TRITON_INTERPRET=1 python bench/gpu/bench_kernel.py --device cpu --hidden-size 64 --tokens 1 4 \\
        --sources 0 3 --iters 2 --rounds 2   # a dry run of the whole script on a CPU (Triton's interpreter)

1. Check: `triton_mix_site` / `triton_push_source` against `depth_attention.mix_site` /
   `push_source` (themselves tested against the float64 oracle) on this device, in float64 and in
   every bank/partial/output dtype, with masked tails and the chunked kernel for wide rows. Any
   mismatch makes the script exit 1, after the timings.
2. Time one site: it reads the stored sources `[tokens, n, d]` (the bank's dtype) and their inverse
   RMS, the partial `[tokens, d]` (float32) and writes the mix `[tokens, d]` (bfloat16). At best it is
   bandwidth-bound, so each row gives the time those bytes take at the GPU's peak bandwidth (the
   floor; an H200's HBM3e peaks near 4.8 TB/s) and how far the kernel is from it (target: within 2x
   where the floor is long enough for bandwidth to matter), next to the torch path. Each row is timed
   in `--rounds` rounds, the Triton kernel twice and the torch path once per round, in rotating order;
   the ratio of the two Triton timings (A/A) is the error bar of the torch / Triton ratio.
3. Host time per call at one token, which is what eager decoding pays per site.
"""

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from common import footer, header, markdown_table, ratios, rotation, spread  # noqa: E402

from modeling_attnres.depth_attention import empty_bank, mix_site, push_source  # noqa: E402
from modeling_attnres.depth_attention_triton import triton_mix_site, triton_push_source  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
EPS = 1e-6


def case(tokens: int, n: int, d: int, bank_dtype, part_dtype, device: str, seed: int = 0):
    """A bank with room for one more source (`n` stored by the torch path), a partial, a query, a gain."""
    gen = torch.Generator(device=device).manual_seed(seed)
    partial = (torch.randn(tokens, d, generator=gen, device=device, dtype=torch.float32) * 3).to(part_dtype)
    with torch.no_grad():
        bank = empty_bank(partial, n + 1, bank_dtype)
        for _ in range(n):
            bank = push_source(bank, torch.randn(tokens, d, generator=gen, device=device) * 3, EPS)
    query = torch.randn(d, generator=gen, device=device)
    gain = 1 + 0.5 * torch.randn(d, generator=gen, device=device)
    return bank, partial, query, gain


def check(device: str) -> list[list]:
    """Each kernel vs the torch path on this device: rows of (what, max error, tolerance, verdict)."""
    rows = []
    f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16
    grid = [(t, n, d, f64, f64, f64) for t, n, d in [(3, 0, 7), (2, 1, 1), (5, 5, 300), (2, 33, 4096),
                                                       (2, 4, 20000)]]           # 20000: the chunked kernel
    grid += [(4, 5, 33, bank, part, out) for bank in (f32, bf16, f16) for part in (f32, bf16) for out in (f32, bf16)]
    grid += [(64, 8, 4096, bf16, f32, bf16)]
    with torch.no_grad():
        for tokens, n, d, bank_dtype, part_dtype, out in grid:
            bank, partial, query, gain = case(tokens, n, d, bank_dtype, part_dtype, device, seed=n + d)
            query_dtype = f64 if part_dtype == f64 else f32
            query, gain = query.to(query_dtype), gain.to(query_dtype)
            got, w = triton_mix_site(bank, partial, query, EPS, out, keep_weights=True, gain=gain)
            ref, ref_w = mix_site(bank, partial, query * gain, EPS, out, keep_weights=True)
            # float64: 1e-12; float32 sums: 2e-6 of the largest source (the mix is a convex combination);
            # an output rounded to bfloat16/float16: two units in its last place, relative
            atol = 1e-12 if out == f64 else 2e-6 * max(float(partial.abs().max()), 1.0) * 4
            rtol = 2 * torch.finfo(out).eps if out in (bf16, f16) else 0.0
            # weights: a float32 score is a length-d dot product, good to ~sqrt(d) float32 ulps
            w_atol = 1e-12 if out == f64 else 2e-6 * d**0.5
            good = (torch.allclose(got.double(), ref.double(), rtol=rtol, atol=atol)
                    and torch.allclose(w.double(), ref_w.double(), rtol=0, atol=w_atol))
            err = float((got.double() - ref.double()).abs().max())
            rows.append([f"mix {tokens}x{d}, n={n}, bank {bank_dtype}, partial {part_dtype}, out {out}",
                         f"{err:.2e}", f"{atol:.0e} + {rtol:.0e} rel.", "ok" if good else "**MISMATCH**"])
        for bank_dtype, part_dtype, n, d in [(f64, f64, 0, 7), (f32, f32, 3, 300), (bf16, f32, 3, 4096),
                                             (f16, f32, 1, 33)]:
            bank, partial, _, _ = case(3, n, d, bank_dtype, part_dtype, device, seed=7)
            ref = push_source(type(bank)(bank.storage.clone(), bank.inv_storage.clone(), bank.num_stored), partial,
                              EPS)
            got = triton_push_source(bank, partial, EPS)
            same = torch.equal(got.sources, ref.sources)
            err = float((got.inv_rms.double() - ref.inv_rms.double()).abs().max())
            tol = 1e-12 if bank_dtype == f64 else 1e-6
            rows.append([f"push 3x{d}, n={n}, bank {bank_dtype}, partial {part_dtype}",
                         f"{err:.2e}" + ("" if same else " (sources differ)"), f"{tol:.0e}",
                         "ok" if same and err <= tol else "**MISMATCH**"])
    return rows


def device_seconds(fn, device: str, iters: int) -> float:
    """Median seconds of `fn` on the device: Triton's do_bench on a GPU (CUDA events, the L2 cache
    flushed before each run, so the bank really comes from memory), a plain loop on the CPU."""
    if device == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=max(iters, 20), return_mode="median") / 1e3
    fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def host_seconds(fn, device: str, iters: int) -> float:
    """Seconds of host time per call, launches queued back to back (what eager decoding pays)."""
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = (time.perf_counter() - start) / iters
    if device == "cuda":
        torch.cuda.synchronize()
    return seconds


def rotated_seconds(calls: dict[str, Callable], device: str, iters: int, rounds: int) -> list[dict[str, float]]:
    """`rounds` rounds of `device_seconds` for every call, in the rotating order of `common.rotation`
    (each call first equally often): per round `{name: seconds}`, for paired ratios."""
    return [{name: device_seconds(calls[name], device, iters) for name in rotation(list(calls), r)}
            for r in range(rounds)]


def site_rows(args, bandwidth: float) -> tuple[list[list], list[float]]:
    """Timed sites: rows for the table and the kernel's distance from the floor where bandwidth rules.
    The Triton kernel is timed twice per round (`triton`, `triton-2`): their ratio is the A/A control."""
    rows, bound = [], []
    d, out_dtype = args.hidden_size, torch.bfloat16
    for bank_name in args.bank_dtypes:
        bank_dtype = DTYPES[bank_name]
        for tokens in args.tokens:
            for n in args.sources:
                bank, partial, query, _ = case(tokens, n, d, bank_dtype, torch.float32, args.device)
                moved = tokens * (n * d * bank_dtype.itemsize + n * 4 + d * 4 + d * out_dtype.itemsize) + d * 4
                floor = moved / bandwidth
                with torch.no_grad():
                    runs = rotated_seconds(site_calls(bank, partial, query, out_dtype), args.device, args.iters,
                                           args.rounds)
                kernel = statistics.median(r["triton"] for r in runs)
                if floor >= args.bound_us * 1e-6:
                    bound.append(kernel / floor)
                rows.append([bank_name, tokens, n, f"{moved / 2**20:.2f}", f"{floor * 1e6:.1f}",
                             f"{kernel * 1e6:.1f}", f"**{kernel / floor:.2f}**", f"{moved / kernel / 1e9:.0f}",
                             f"{statistics.median(r['torch'] for r in runs) * 1e6:.1f}",
                             spread(ratios(runs, "torch", "triton"), 2), spread(ratios(runs, "triton-2", "triton"), 3)])
    return rows, bound


def site_calls(bank, partial, query, out_dtype) -> dict[str, Callable]:
    """The Triton site, the torch path, and the Triton site again (the A/A control)."""
    def triton() -> None:
        triton_mix_site(bank, partial, query, EPS, out_dtype)
    return {"triton": triton, "torch": lambda: mix_site(bank, partial, query, EPS, out_dtype), "triton-2": triton}


def push_rows(args, bandwidth: float) -> list[list]:
    rows = []
    for bank_name in args.bank_dtypes:
        bank_dtype = DTYPES[bank_name]
        for tokens in args.tokens:
            bank, partial, _, _ = case(tokens, 0, args.hidden_size, bank_dtype, torch.float32, args.device)
            moved = tokens * (args.hidden_size * (4 + bank_dtype.itemsize) + 4)
            with torch.no_grad():   # an empty bank with room for one: both store in place, again and again
                runs = rotated_seconds(push_calls(bank, partial), args.device, args.iters, args.rounds)
            kernel = statistics.median(r["triton"] for r in runs)
            rows.append([bank_name, tokens, f"{moved / 2**20:.2f}", f"{moved / bandwidth * 1e6:.1f}",
                         f"{kernel * 1e6:.1f}", f"**{kernel / (moved / bandwidth):.2f}**",
                         f"{statistics.median(r['torch'] for r in runs) * 1e6:.1f}",
                         spread(ratios(runs, "triton-2", "triton"), 3)])
    return rows


def push_calls(bank, partial) -> dict[str, Callable]:
    """The Triton block store, the torch path, and the Triton store again (the A/A control)."""
    def triton() -> None:
        triton_push_source(bank, partial, EPS)
    return {"triton": triton, "torch": lambda: push_source(bank, partial, EPS), "triton-2": triton}


def host_rows(args) -> list[list]:
    rows = []
    for n in (1, 8):
        bank, partial, query, gain = case(1, n, args.hidden_size, torch.bfloat16, torch.float32, args.device)
        proj = query.to(torch.bfloat16)[None]
        with torch.no_grad():
            calls = {
                "site: torch path (fold + mix_site)": lambda: mix_site(bank, partial, proj.float()[0] * gain, EPS,
                                                                       torch.bfloat16),
                "site: Triton (query folded in the kernel)": lambda: triton_mix_site(bank, partial, proj, EPS,
                                                                                     torch.bfloat16, gain=gain),
            }
            rows += [[name, n, f"{host_seconds(fn, args.device, 10 * args.iters) * 1e6:.1f}"]
                     for name, fn in calls.items()]
    return rows


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a large device-to-device copy (read + write): the practical ceiling."""
    if device != "cuda":
        return float("nan")
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    return 2 * x.numel() / device_seconds(lambda: y.copy_(x), device, 100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=4096)
    parser.add_argument("--sources", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 4096, 16384])
    parser.add_argument("--bank-dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--bandwidth-tbps", type=float, default=4.8, help="peak memory bandwidth (H200: 4.8)")
    parser.add_argument("--bound-us", type=float, default=20.0,
                        help="rows whose floor is at least this long count towards the 2x target")
    parser.add_argument("--iters", type=int, default=25, help="ms of timing per call and round on a GPU (do_bench's "
                                                               "rep)")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per row, the calls in rotating order")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the Triton kernels only under Triton's interpreter: set TRITON_INTERPRET=1")
    bandwidth = args.bandwidth_tbps * 1e12
    where = "" if args.device == "cuda" else " on a CPU under Triton's interpreter (a dry run)"
    print(header(f"Triton depth-attention kernels{where}: hidden {args.hidden_size}",
                 {"rounds": f"{args.rounds} per row, the Triton kernel timed twice per round (A/A) with the torch "
                            "path, in rotating order", "timing": f"do_bench median, {args.iters} ms per call and "
                            "round, L2 flushed" if args.device == "cuda" else "a plain loop"}) + "\n")
    checks = check(args.device)
    print(markdown_table(["check vs the torch path", "max error", "tolerance", "verdict"], checks) + "\n")
    rows, bound = site_rows(args, bandwidth)
    print(f"One site (partial float32, mix bfloat16); floor = bytes / {args.bandwidth_tbps} TB/s; a large copy "
          f"measured {copy_bandwidth(args.device) / 1e12:.2f} TB/s here.\n")
    print(markdown_table(["bank", "tokens", "stored sources", "MiB moved", "floor us", "Triton us", "x floor",
                          "GB/s", "torch us", "torch / Triton (median, min-max)", "A/A: Triton / Triton"], rows) + "\n")
    if bound:
        verdict = "met" if max(bound) <= 2 else "missed"
        print(f"Rows with a floor >= {args.bound_us:g} us: Triton at {min(bound):.2f}-{max(bound):.2f}x the floor "
              f"(target <= 2x: {verdict}).\n")
    print(markdown_table(["push: bank", "tokens", "MiB moved", "floor us", "Triton us", "x floor", "torch us",
                          "A/A: Triton / Triton"], push_rows(args, bandwidth)) + "\n")
    print(markdown_table(["host time per call, 1 token", "stored sources", "us"], host_rows(args)))
    print(footer())
    failed = [row[0] for row in checks if row[-1] != "ok"]
    if failed:
        sys.exit(f"\nFAILED: the Triton kernels disagree with the torch path on this device: {failed}")


if __name__ == "__main__":
    main()
