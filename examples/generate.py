"""Greedy (or sampled) completion with the built-in AttnRes model: the project's smallest demo.

    .venv/bin/python examples/generate.py
    .venv/bin/python examples/generate.py --prompt "class Stack:" --max-new-tokens 80
    .venv/bin/python examples/generate.py --model path/to/checkpoint --sample

The default model (the shipped `attnres-tiny`, `attnres.models.shipped_model_path()`) was trained by
`examples/train.py` on CPython's standard library, so it continues Python code; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from attnres.models import shipped_model_path

DEFAULT_MODEL = shipped_model_path()
DEFAULT_PROMPT = "class Reader:\n    def __init__(self"


def load(model_path: Path):
    """Model and tokenizer from a checkpoint folder, with a clear error for a wrong path."""
    if not (model_path / "config.json").is_file():
        raise SystemExit(f"error: {str(model_path)!r} is not a checkpoint folder (no config.json); "
                         f"pass --model with a folder written by save_pretrained, e.g. {DEFAULT_MODEL}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_attnres  # noqa: F401  (registers the AttnRes architecture with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_path)


def complete(model, tokenizer, prompt: str, max_new_tokens: int, sample: bool = False, seed: int = 0) -> str:
    """The prompt's continuation only (greedy unless `sample`; sampling is seeded)."""
    torch.manual_seed(seed)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    extra = dict(do_sample=True, temperature=0.8, top_p=0.95) if sample else dict(do_sample=False)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, **extra)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help=f"checkpoint folder (default {DEFAULT_MODEL})")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--sample", action="store_true", help="sample (temperature 0.8, top-p 0.95) instead of greedy")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if not args.prompt:
        p.error("--prompt is empty; pass some text for the model to continue")
    if args.max_new_tokens < 1:
        p.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    model, tokenizer = load(args.model)
    print(args.prompt + complete(model, tokenizer, args.prompt, args.max_new_tokens, args.sample, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
