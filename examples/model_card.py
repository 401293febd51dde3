"""Export a trained example model as a complete, loadable folder with a model card.

The folder holds what `AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained` need
(config, weights, tokenizer with chat template, generation config), the held-out text the card's
loss was measured on (`heldout_sample.txt`, so a test can re-measure it), `metrics.json`, and the
card (`README.md`). It is written to a temporary sibling folder and renamed into place.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from attnres.conversion.publish import staged_folder

HELDOUT_FILE = "heldout_sample.txt"
# The card line the tests parse; keep the wording and the 4 decimals stable.
HELDOUT_LINE = "Held-out sample loss: {loss:.4f} nats/token"


def generation_config(model):
    """Greedy decoding by default: the model is small, so sampling mostly adds noise."""
    from transformers import GenerationConfig

    cfg = model.config
    return GenerationConfig(bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
                            pad_token_id=cfg.pad_token_id, do_sample=False, max_new_tokens=128)


def command_line(args, defaults: dict) -> str:
    """The command that reproduces this run: the arguments whose value differs from `defaults`
    (the training script's parsed defaults, passed in so this module does not import the script)."""
    parts = [".venv/bin/python examples/train.py"]
    for key, value in vars(args).items():
        if key in ("work_dir", "threads", "stop_after", "no_resume", "overwrite") or value == defaults.get(key):
            continue
        parts.append(f"--{key.replace('_', '-')}" + ("" if value is True else f" {value}"))    # a flag: no value
    return " ".join(parts)


def export_model(model, tok, args, metrics: dict, heldout: str, defaults: dict) -> Path:
    """Write the model folder to `args.out` (temp folder, then rename); returns the path.

    `defaults` are the training script's default arguments, for the card's reproduce command."""
    out = Path(args.out)
    with staged_folder(out, overwrite=args.overwrite) as tmp:      # --out was checked before training
        dtype = getattr(torch, args.save_dtype)
        model.to(dtype).save_pretrained(tmp)
        model.to(torch.float32)
        tok.save_pretrained(tmp)
        generation_config(model).save_pretrained(tmp)
        (tmp / HELDOUT_FILE).write_text(heldout, encoding="utf-8")
        summary = {k: v for k, v in metrics.items() if k != "history"}
        (tmp / "metrics.json").write_text(json.dumps(summary, indent=1) + "\n")
        (tmp / "README.md").write_text(card_text(model, args, summary, defaults), encoding="utf-8")
    print(f"wrote {out}", file=sys.stderr)
    return out


def speed_line(m: dict) -> str:
    """Training time and throughput, when this process measured them (not after a resume at the end)."""
    seconds, rate = m.get("train_seconds_total") or m.get("train_seconds_this_run"), m.get("tokens_per_s")
    if not seconds or not rate:
        return ""
    took = f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
    return f" Training took {took} at {rate:.0f} tokens/s (one thread of a busy shared CPU)."


def corpus_text(args) -> str:
    """What the model was trained on: the default corpus (this Python's standard library) or `--corpus-root`."""
    if args.corpus_root is None:
        return f"CPython {sys.version.split()[0]}'s standard-library sources (`.py` files, test suites excluded)"
    return f"the `.py` files under `{args.corpus_root}` (test folders excluded)"


def limitations_text(m: dict) -> str:
    """The card's limitations line, from this run's size and the share of its corpus it saw."""
    seen = ""
    if m.get("corpus_train_tokens"):
        seen = (f" and {m['train_tokens'] / m['corpus_train_tokens']:.3g} epochs of a "
                f"{m['corpus_train_tokens'] / 1e6:.2f}M-token training split")
    return (f"Limitations: {m['params'] / 1e6:.2f}M parameters{seen}; a model this small writes "
            "plausible-looking but mostly meaningless Python.")


# The folder `make train` writes, which the package ships (`attnres.models`): users of the wheel have no
# checkout, so its card finds the folder through the package rather than by a path in the repository.
SHIPPED_FOLDER = Path(__file__).resolve().parents[1] / "models" / "attnres-tiny"


def use_path_lines(out: str) -> str:
    """The card's lines that name the model folder: the package's copy for the shipped model, else `out`."""
    if Path(out).resolve() == SHIPPED_FOLDER:
        return ("from attnres.models import shipped_model_path\n\n"
                "path = shipped_model_path()  # this folder, as installed with the attnres package")
    return f"path = {str(out)!r}"


def card_text(model, args, m: dict, defaults: dict) -> str:
    """The model card: what it is, how it was trained, what it measures, how to use it."""
    cfg = model.config
    arch = {"block": f"Block AttnRes ({cfg.num_hidden_layers} layers, {getattr(cfg, 'attn_res_block_size', '')} "
                     f"layers per block: {getattr(cfg, 'num_depth_sources', 0) - 1} blocks + the embedding)",
            "full": "Full AttnRes (every sublayer output is a depth source)",
            "llama": "Llama baseline (standard residual stream)"}[args.arch]
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    dims = (f"hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, {cfg.num_attention_heads} heads, "
            f"MLP {cfg.intermediate_size}, context {cfg.max_position_embeddings}")
    return f"""---
license: apache-2.0
library_name: transformers
pipeline_tag: text-generation
tags: [attnres, attention-residuals, code, tiny]
---

# {Path(args.out).name}

A tiny {arch} language model trained from scratch on {corpus_text(args)},
as the built-in demo model of the `attnres` project (Attention Residuals, Kimi Team, arXiv:2603.15031).
It completes Python code; it is not an instruction or chat model (the chat template joins
the message contents with newlines, so a chat request continues the code it contains).

## Model

| | |
|---|---|
| architecture | `{cfg.model_type}`: {arch} |
| parameters | {m['params']:,} (tied input/output embeddings), {size_mb:.1f} MB in {args.save_dtype} |
| dims | {dims} |
| tokenizer | byte-level BPE, {cfg.vocab_size} tokens, trained with `tokenizers` on the training split |

## Training

{m['train_tokens']:,} tokens ({m['steps_done']} steps of {args.batch_size} x {args.seq_len}), AdamW
(lr {args.lr}, {args.warmup} warm-up steps, cosine to {args.min_lr_ratio} x lr, weight decay
{args.weight_decay}, grad clip 1.0), float32 on CPU, seed {args.seed}.{speed_line(m)} Split: a file is in validation
when the first 4 bytes of `sha256(relative path)`, read as a big-endian number, modulo 100 are
below {args.validation_percent}. Reproduce with:

```bash
{command_line(args, defaults)}
```

## Evaluation

- Validation loss: {m['val_loss']:.4f} nats/token (perplexity {m['val_ppl']:.2f}) on {m['val_tokens']:,}
  predicted tokens of held-out corpus files; a uniform guess scores ln({cfg.vocab_size}) = {m['uniform_loss']:.3f}.
- {HELDOUT_LINE.format(loss=m['heldout_loss'])} on `{HELDOUT_FILE}` (the first lines of the
  validation files, {m['heldout_windows']} windows of {args.seq_len} tokens), as computed by
  `examples/attnres_data.py:heldout_loss`; the project's tests re-measure it.

## Use

```python
import modeling_attnres  # registers the architecture (or pass trust_remote_code=True)
from transformers import AutoModelForCausalLM, AutoTokenizer

{use_path_lines(args.out)}
tok = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path)
ids = tok("class Reader:\\n    def __init__(self", return_tensors="pt").input_ids
print(tok.decode(model.generate(ids, max_new_tokens=64)[0]))
```

{limitations_text(m)}
"""
