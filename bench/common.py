"""Shared pieces of the benchmarks: same-dimension AttnRes and Llama models, timing, tables."""

import argparse
import statistics
import time
from typing import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_attnres import AttnResConfig, AttnResForCausalLM

DEFAULT_SIZE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=2816, vocab_size=32000)
ATTN_RES_FIELDS = ("attn_res_mode", "attn_res_block_size", "qk_norm")


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the model size; defaults are the issue's benchmark size."""
    for name, value in DEFAULT_SIZE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--block-size", type=int, default=2, help="AttnRes layers per block")
    parser.add_argument("--mode", choices=("block", "full"), default="block")


def configs(args: argparse.Namespace) -> tuple[AttnResConfig, LlamaConfig]:
    """An AttnRes config and the Llama config with exactly the same dimensions."""
    size = {name: getattr(args, name) for name in DEFAULT_SIZE}
    common = dict(size, max_position_embeddings=4096, tie_word_embeddings=False)
    attnres = AttnResConfig(**common, attn_res_mode=args.mode, attn_res_block_size=args.block_size)
    return attnres, LlamaConfig(**common)


def build(kind: str, args: argparse.Namespace, dtype: torch.dtype, attn: str = "sdpa",
          device: str = "cpu") -> torch.nn.Module:
    """A randomly initialised model of `kind` ("attnres" or "llama") in `dtype`, eval mode."""
    attnres_cfg, llama_cfg = configs(args)
    torch.manual_seed(0)
    cls, cfg = (AttnResForCausalLM, attnres_cfg) if kind == "attnres" else (LlamaForCausalLM, llama_cfg)
    cfg._attn_implementation = attn
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    return model


def synchronize() -> None:
    """Wait for queued GPU work, so that wall-clock timings are real (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def alternate(runs: dict[str, Callable[[], None]], repeats: int, warmup: int = 1,
              paired: list | None = None) -> dict[str, float]:
    """Time each callable `repeats` times, alternating between them; returns median seconds. If
    `paired` is a list, each repeat's `{name: seconds}` is appended to it (for paired ratios)."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            synchronize()
            start = time.perf_counter()
            fn()
            synchronize()
            times[name].append(time.perf_counter() - start)
        if paired is not None:
            paired.append({name: t[-1] for name, t in times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
