"""The depth-attention work of one forward pass on its own, and each lever that makes it cheaper.

    python bench/bench_depth.py                        # default size; eager, compiled, piecewise; 1..2048 tokens
    python bench/bench_depth.py --tokens 64 512 --modes piecewise piecewise-kernel --dtype bfloat16

Replays what a model does on its residual path, with the sublayers replaced by fixed random outputs,
for the sites of `--num-hidden-layers` layers plus the output site:
- `llama`: the residual stream (each site reads it, each sublayer output is added to it);
- `per-site`: one `mix_site` pass over the bank per site, the bank preallocated for the forward pass
  and filled in place, its sources stored in the model's dtype (`attn_res_bank_dtype="auto"`);
- `per-site (A/A)`: `per-site` again, the control: its ratio to `per-site` is the error bar of the others;
- `cat-bank`: the same, the bank grown by `torch.cat` per stored block (undoes one lever);
- `float32-bank`: the same, sources stored in float32 (undoes the other; equal for float32 inputs);
- `two-phase`: the spec's alternative, written here (not in the models): when a block closes, score
  and mix the new bank for all the sites that will read it at once (one matmul each, phase 1); each
  site then merges its running partial with an exact online-softmax step (phase 2). It reads the
  bank twice per block instead of twice per site.
`cat-bank` and `two-phase` are checked against `per-site` before timing. Modes: `eager`; `cpu-kernel`,
eager with the fused C++ site kernel for the per-site paths (what `enable_cpu_kernel()` gives the
transformers model); `compiled`, the whole pass as one graph (like transformers'
`torch.compile(fullgraph=True)`); `piecewise`, each stretch between two attention ops compiled as its
own graph (like vLLM); `compiled-kernel` / `piecewise-kernel`, the same with the kernel enabled, so
the graphs call it as the custom op `attnres::mix_site` instead of generated code.
All paths run in one process, alternating in a rotating order (`common.rotation`; 12 repeats put each
path first twice), after a warm-up; the table gives median milliseconds per forward, what AttnRes adds
over the residual stream, and per lever the median and range of the paired per-repeat ratios (the
machine's drift between repeats cancels in a pair), with the A/A control's beside them.
"""

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_size_arguments, alternate, balanced, footer, header, markdown_table  # noqa: E402

from modeling_attnres.depth_attention import (  # noqa: E402
    DepthBank,
    acc,
    add_to_partial,
    bank_dtype,
    empty_bank,
    inverse_rms,
    mix_site,
    push_block,
)
from modeling_attnres.depth_attention_cpu import cpu_kernel_applies, enable_cpu_kernel, fused_mix_site  # noqa: E402
from modeling_attnres.depth_attention_ops import site_push as push  # noqa: E402

EPS = 1e-6


class BankSummary(NamedTuple):
    """Phase 1 for `S` sites reading one bank: log-sum-exp of their scores over the stored sources
    `lse [tokens, S]` (-inf with none) and their softmax-weighted sums `mixed [tokens, S, d]`."""

    lse: Tensor
    mixed: Tensor


def summarize_bank(bank: DepthBank, queries: Tensor) -> BankSummary:
    """Phase 1: score and mix the stored sources for the folded `queries [S, d]` at once."""
    src = acc(bank.sources)                                                    # [tokens, n, d]
    scores = (src @ queries.T) * bank.inv_rms.unsqueeze(-1)                    # [tokens, n, S]
    lse = torch.logsumexp(scores, dim=-2)                                      # [tokens, S]
    weights = torch.exp(scores - lse.unsqueeze(-2))
    return BankSummary(lse, weights.transpose(-1, -2) @ src)


def merge_partial(summary: BankSummary, row: int, partial: Tensor, query: Tensor, dtype: torch.dtype) -> Tensor:
    """Phase 2: the stored sources together weigh `sigmoid(lse - s_p)` against the partial's score."""
    p = acc(partial)
    partial_score = (p @ query) * inverse_rms(p, EPS)                          # [tokens]
    stored_weight = torch.sigmoid(summary.lse[..., row] - partial_score)
    return torch.lerp(p, summary.mixed[..., row, :], stored_weight.unsqueeze(-1)).to(dtype)


def site_group(site: int, spb: int) -> int:
    """Blocks stored before site `site` (they close after sites 0, spb, 2 spb, ...)."""
    return -(-site // spb)


def group_sites(group: int, spb: int, num_sites: int) -> range:
    """The sites that read the bank with `group` stored sources."""
    first = 0 if group == 0 else (group - 1) * spb + 1
    return range(first, min(group * spb, num_sites - 1) + 1)


def llama_step(state: tuple, site: int, outputs: torch.Tensor, queries: torch.Tensor, spb: int):
    """The standard residual stream: a site reads the running sum, then its sublayer adds to it."""
    (residual,) = state
    return (residual + outputs[site],) if site < len(outputs) else state, residual


def per_site_step(state: tuple, site: int, outputs: torch.Tensor, queries: torch.Tensor, spb: int):
    """AttnRes as both models run it: one `mix_site` pass over the bank per site (the fused CPU kernel,
    for the mix and the push, where it is enabled and applies, as in the transformers model)."""
    bank, partial = state
    site_mix = fused_mix_site if cpu_kernel_applies(partial) else mix_site
    read = site_mix(bank, partial, queries[site], EPS, outputs.dtype)[0]
    if site == len(outputs):
        return state, read
    bank, partial = push(bank, partial, site % spb == 0, EPS)
    return (bank, add_to_partial(partial, outputs[site])), read


def two_phase_step(state: tuple, site: int, outputs: torch.Tensor, queries: torch.Tensor, spb: int):
    """The two-phase scheme: phase 1 once per bank, phase 2 per site."""
    bank, summary, partial = state
    group = site_group(site, spb)
    row = site - group_sites(group, spb, len(queries)).start
    read = merge_partial(summary, row, partial, queries[site], outputs.dtype)
    if site == len(outputs):
        return state, read
    if site % spb == 0:
        bank, partial = push_block(bank, partial, True, EPS)
        following = group_sites(group + 1, spb, len(queries))
        summary = summarize_bank(bank, queries[following.start:following.stop])
    return (bank, summary, add_to_partial(partial, outputs[site])), read


# Each path: its step and, for AttnRes, whether the bank is preallocated (filled in place rather than
# grown by `torch.cat`) and its dtype choice (`AttnResConfig.attn_res_bank_dtype`). `per-site` is what
# the models run; `cat-bank` and `float32-bank` each undo one lever.
PATHS = {"llama": (llama_step, None, None), "per-site": (per_site_step, True, "auto"),
         "per-site (A/A)": (per_site_step, True, "auto"), "cat-bank": (per_site_step, False, "auto"),
         "float32-bank": (per_site_step, True, "float32"), "two-phase": (two_phase_step, True, "auto")}
LEVERS = ("per-site (A/A)", "cat-bank", "float32-bank", "two-phase")        # each over per-site


def initial_state(name: str, embeds: torch.Tensor, queries: torch.Tensor, capacity: int) -> tuple:
    """Each path's state before site 0: the residual, or the empty bank and the embedding as partial."""
    step, room, dtype_choice = PATHS[name]
    if step is llama_step:
        return (embeds,)
    bank = empty_bank(embeds, capacity if room else 0, bank_dtype(dtype_choice, embeds.dtype))
    partial = add_to_partial(None, embeds)
    return (bank, partial) if step is per_site_step else (bank, summarize_bank(bank, queries[:1]), partial)


def run_piece(step: Callable, state: tuple, sites: tuple[int, ...], outputs: torch.Tensor, queries: torch.Tensor,
              spb: int) -> tuple[tuple, list[torch.Tensor]]:
    """The sites between two attention ops (what vLLM compiles as one piece)."""
    reads = []
    for site in sites:
        state, read = step(state, site, outputs, queries, spb)
        reads.append(read)
    return state, reads


def forward(name: str, piece: Callable, embeds: Tensor, pieces: list[tuple[int, ...]], outputs: torch.Tensor,
            queries: torch.Tensor, spb: int) -> list[torch.Tensor]:
    """All sites of a forward pass, piece by piece; the bank is created inside, as in the models."""
    step, reads = PATHS[name][0], []
    state = initial_state(name, embeds, queries, site_group(len(outputs), spb))
    for sites in pieces:
        state, piece_reads = piece(step, state, sites, outputs, queries, spb)
        reads += piece_reads
    return reads


def run(tokens: int, mode: str, args) -> dict[str, float]:
    """Check the cat-bank and two-phase paths against per-site mixing on random inputs, then time all
    paths in `mode`; returns each repeat's seconds per forward by path."""
    gen = torch.Generator().manual_seed(0)
    d, sites = args.hidden_size, 2 * args.num_hidden_layers
    dtype = getattr(torch, args.dtype)
    embeds = torch.randn(tokens, d, generator=gen).to(dtype)
    outputs = torch.randn(sites, tokens, d, generator=gen).to(dtype)
    queries = torch.randn(sites + 1, d, generator=gen) * d ** -0.5
    spb = 1 if args.mode == "full" else 2 * args.block_size
    # Pieces between attention ops: [site 0], [MLP l, attention l + 1], ..., [last MLP, output site].
    pieces = [(0,)] + [(j, j + 1) for j in range(1, sites, 2)]
    in_graphs = mode in ("compiled-kernel", "piecewise-kernel")            # the kernel as the op in the graphs
    enable_cpu_kernel(mode == "cpu-kernel" or in_graphs, compiled=in_graphs)
    torch._dynamo.reset()                                      # each piece is its own graph: 5 x pieces
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 6 * len(pieces))
    paths = {}
    for name in PATHS:
        if mode.startswith("compiled"):
            whole = torch.compile(forward, dynamic=False, fullgraph=True)
            paths[name] = lambda name=name, whole=whole: whole(name, run_piece, embeds, pieces, outputs, queries, spb)
        else:
            eager = mode in ("eager", "cpu-kernel")
            piece = run_piece if eager else torch.compile(run_piece, dynamic=False, fullgraph=True)
            paths[name] = lambda name=name, piece=piece: forward(name, piece, embeds, pieces, outputs, queries, spb)
    with torch.inference_mode():
        # Same bank dtype, so only float32 summation order and the reads' final cast to `dtype` differ
        # (float32-bank rounds nothing when storing: it differs by the bank's rounding, and is not checked).
        reference = forward("per-site", run_piece, embeds, pieces, outputs, queries, spb)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        for name in ("cat-bank", "two-phase"):
            got = forward(name, run_piece, embeds, pieces, outputs, queries, spb)
            for a, b in zip(got, reference, strict=True):
                torch.testing.assert_close(a, b, rtol=tol, atol=tol)
        iters = max(1, args.work // (tokens * d))
        batches = {name: lambda fn=fn: [fn() for _ in range(iters)] for name, fn in paths.items()}
        paired: list[dict[str, float]] = []
        alternate(batches, args.repeats, paired=paired)
        return [{name: seconds / iters for name, seconds in r.items()} for r in paired]


def spread(values: list[float]) -> str:
    """`median (min-max)` of paired ratios."""
    return f"**{statistics.median(values):.2f}x** ({min(values):.2f}-{max(values):.2f})"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)                   # only hidden size, layers, block size and mode matter here
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    parser.add_argument("--modes", nargs="+", choices=("eager", "cpu-kernel", "compiled", "piecewise",
                                                        "compiled-kernel", "piecewise-kernel"),
                        default=["eager", "cpu-kernel", "compiled", "piecewise"])
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=12,
                        help="paired repeats; a multiple of 12 puts each of the 6 paths first equally often")
    parser.add_argument("--work", type=int, default=1 << 20, help="token x hidden elements per timed batch")
    args = parser.parse_args(argv)
    rows = []
    for mode in args.modes:
        for tokens in args.tokens:
            runs = run(tokens, mode, args)
            t = {name: statistics.median(r[name] for r in runs) for name in PATHS}
            rows.append([mode, tokens, *(f"{t[name] * 1e3:.2f}" for name in PATHS),
                         f"{(t['per-site'] - t['llama']) * 1e3:.2f}",
                         *(spread([r[name] / r["per-site"] for r in runs]) for name in LEVERS)])
    order = "balanced" if balanced(args.repeats, len(PATHS)) else f"not a multiple of {2 * len(PATHS)}: unbalanced"
    settings = {"size": f"hidden {args.hidden_size}, {args.num_hidden_layers} layers, {args.mode} (block size "
                        f"{args.block_size}), {args.dtype}; sublayers replaced by fixed random outputs",
                "timing": f"{args.repeats} paired repeats after one warm-up, the paths in a rotating order "
                          f"({order}{'' if args.repeats >= 10 else '; fewer than 10 pairs'}), each repeat "
                          f"--work {args.work} token x hidden elements per path; ms: median per forward",
                "ratios": "median (min-max) of the paired per-repeat ratios to per-site (> 1: the lever pays); "
                          "per-site (A/A) / per-site is the control"}
    print(header("The depth-attention work of a forward pass, path by path", settings) + "\n")
    print(markdown_table(["mode", "tokens", *PATHS, "per-site extra over llama",
                          *(f"{name} / per-site" for name in LEVERS)], rows))
    print(footer())

if __name__ == "__main__":
    main()
