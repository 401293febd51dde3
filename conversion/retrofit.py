"""`attnres-retrofit MODEL CORPUS --out DST`: teach a converted AttnRes model depth attention.

A converted checkpoint (`attnres-convert`) has zero pseudo-queries, so every site averages its
sources uniformly and the model computes what its source did (docs/spec.md, section 8). This command
trains the depth-attention parameters (the pseudo-queries `*_res_proj` and key-norm gains
`*_res_norm`; `--train all` trains everything) on a text corpus with the transformers `Trainer`,
the backbone frozen by default, and writes the trained model atomically to DST. The loss is the
language-model loss plus `--kl-weight` times the KL divergence to the model as it was given (for a
fresh conversion: the source), and the model kept is the best held-out checkpoint, or the starting
model itself when none beats it on both long windows and short paragraph starts (see `distill`). `--export-depth
FILE` also writes ONLY the depth parameters as a small safetensors file that `apply_depth_parameters`
puts back on top of a fresh conversion of the same source.

    attnres-retrofit out/smollm2-attnres docs-corpus/ --out out/smollm2-retrofit \\
        --export-depth depth.safetensors --steps 60 --seq-len 128 --batch-size 4

The corpus is a text file or a folder of them (`--pattern`, default `*.txt`, `*.md`, `*.rst`),
read in sorted order; a file is held out when the first 4 bytes of `sha256(relative path)`, read as a
big-endian number, modulo 100 are below `--validation-percent`
(a corpus of one file holds out its last `--validation-percent` % of lines), and the held-out loss is
reported before and after training. Checkpoints go to `--work-dir` every `--save-every` steps; `--resume`
continues from the last one exactly (same batches, same result), and only the run that wrote them: the
same model files, corpus and options (`retrofit_work.check_resumable`).
Runs under `accelerate launch --multi_gpu --num_processes N` unchanged (DDP; gloo on CPUs):
`--batch-size` is the global batch, split evenly over the processes, so the loss curve matches one
process. FSDP goes through the Trainer's accelerate integration, which shards only on GPUs and other
accelerators; on CPUs it is refused rather than silently run as DDP.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from contextlib import nullcontext, redirect_stdout
from pathlib import Path

import torch
from transformers import TrainerCallback

from modeling_attnres.configuration_attnres import is_depth_parameter

from .checkpoint_io import (
    builtin_folder,
    check_attnres_config,
    check_destination,
    is_builtin,
    path_argument,
    read_json_object,
    write_failures_named,
)
from .distill import EvaluateAtEnd, RetrofitTrainer, heldout_metrics, no_worse, paragraph_windows
from .errors import EXIT_INTERRUPTED, ConversionError, UsageError, fail, listing
from .publish import staged_file, staged_folder, user_cache_dir
from .retrofit_work import (
    MarkComplete,
    RetrofitError,
    check_resumable,
    last_checkpoint,
    run_record,
    start_fresh,
    work_dir_lock,
)

TRAINABLE = {
    "depth": ("_res_proj.", "_res_norm."),  # pseudo-queries and key-norm gains (`is_depth_parameter`)
    "queries": ("_res_proj.",),          # pseudo-queries only
    "norms": ("layernorm.", "model.norm."),  # the backbone's RMSNorm gains (a control for a standard model)
    "all": ("",),
}
DEFAULT_PATTERNS = ("*.txt", "*.md", "*.rst")
DEPTH_FORMAT = "attnres-depth-v1"
# Config fields that must agree between the model a depth file was trained on and the one it is applied to.
DEPTH_CONFIG_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "attn_res_mode", "attn_res_block_size")


# ----------------------------------------------------------------------------------------- args


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options (see the module docstring)."""
    p = argparse.ArgumentParser(prog="attnres-retrofit", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=path_argument("MODEL"),
                   help="a converted AttnRes checkpoint folder, or a built-in model (builtin:smollm2-135m-attnres, "
                        "builtin:attnres-tiny, ...)")
    p.add_argument("corpus", type=path_argument("CORPUS"), help="a text file or a folder of text files")
    p.add_argument("--out", type=path_argument("--out"), help="write the trained model here (default: WORK_DIR/final)")
    p.add_argument("--export-depth", type=path_argument("--export-depth"),
                   help="also write only the depth parameters to this .safetensors")
    p.add_argument("--work-dir", type=path_argument("--work-dir"), help="Trainer checkpoints (default: the user cache, "
                   "~/.cache/attnres/retrofit/MODEL_NAME)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work-dir (the same "
                                                         "model, corpus and options)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an --out folder that holds a checkpoint, or an existing --export-depth file")
    p.add_argument("--train", choices=sorted(TRAINABLE), default="depth",
                   help="depth: pseudo-queries + key-norm gains (default); queries: pseudo-queries only; norms: "
                        "the backbone's RMSNorm gains, not the key norms (a control: examples/retrofit_compare.py); "
                        "all: every parameter")
    p.add_argument("--pattern", action="append", help=f"file glob in a corpus folder (default: {DEFAULT_PATTERNS})")
    p.add_argument("--validation-percent", type=int, default=10)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (split over accelerate processes)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (pseudo-query scores grow fast)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--kl-weight", type=float, default=1.0, help="weight of the KL divergence to the starting "
                   "model's next-token distribution, next to the LM loss (0: the LM loss alone)")
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows of seq-len tokens (0: all); "
                   "as many short ones start at held-out paragraph starts")
    p.add_argument("--short-tokens", type=int, default=16, help="length of the short held-out windows")
    p.add_argument("--save-every", type=int, default=50, help="checkpoint and evaluate every N steps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop-after", type=int, help="checkpoint and exit after this step (simulates an interruption)")
    args = p.parse_args(argv)
    args.pattern = tuple(args.pattern or DEFAULT_PATTERNS)
    name = str(args.model).removeprefix("builtin:") if is_builtin(args.model) else args.model.resolve().name
    args.work_dir = args.work_dir or user_cache_dir() / "retrofit" / name
    return args


def check_args(args: argparse.Namespace, world_size: int = 1) -> None:
    """Reject values that would only fail later, naming the value and the fix."""
    for name in ("steps", "batch_size", "seq_len", "save_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 2 <= args.short_tokens <= args.seq_len:
        raise UsageError(f"--short-tokens must be in 2..--seq-len ({args.seq_len}), got {args.short_tokens}")
    if not (math.isfinite(args.kl_weight) and args.kl_weight >= 0):
        raise UsageError(f"--kl-weight must be a finite number >= 0, got {args.kl_weight}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise UsageError(f"--lr must be a finite number > 0, got {args.lr} (the default is 5e-4)")
    if args.stop_after is not None and args.stop_after < 1:
        raise UsageError(f"--stop-after must be a step >= 1, got {args.stop_after}; drop it to train all --steps")
    for name in ("warmup", "eval_windows"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 < args.validation_percent < 100:
        raise UsageError(f"--validation-percent must be in 1..99, got {args.validation_percent}")
    if args.batch_size % world_size:
        raise UsageError(f"--batch-size {args.batch_size} (the global batch) must be a multiple of the "
                            f"{world_size} processes; pass a multiple of {world_size}")
    if args.export_depth is not None and args.export_depth.suffix != ".safetensors":
        raise UsageError(f"--export-depth {args.export_depth} must end in .safetensors")


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, outputs that would lose data, as attnres-convert refuses its DST: an --out
    over, inside or around MODEL, that is a file, or a non-empty folder without --overwrite; an
    --export-depth file inside MODEL or the output folder (whose files it would replace), a folder, or an
    existing file without --overwrite; a --work-dir overlapping MODEL (a new run clears its checkpoints)."""
    model = args.model.resolve()
    if args.out is not None:
        check_destination(args.out, args.model, args.overwrite, "--out", "MODEL")
    work = args.work_dir.resolve()
    if work.exists() and not work.is_dir():
        raise RetrofitError(f"--work-dir {work} is a file; pass a folder for the training checkpoints")
    if work == model or model in work.parents or work in model.parents:
        raise RetrofitError(f"--work-dir {work} overlaps MODEL {model}; pass a separate folder")
    if args.export_depth is None:
        return
    path, out = args.export_depth.resolve(), (args.out or args.work_dir / "final").resolve()
    for name, folder in (("MODEL", model), ("the output folder", out)):
        if path == folder or folder in path.parents:
            raise RetrofitError(f"--export-depth {path} is inside {name} {folder}, whose files it would replace; "
                             "write it elsewhere")
    if path.is_dir():
        raise RetrofitError(f"--export-depth {path} is a folder; pass the path of a .safetensors file")
    if path.exists() and not args.overwrite:
        raise RetrofitError(f"--export-depth {path} exists; pass --overwrite to replace it, or choose another path")


def check_attnres(path: Path) -> dict:
    """The checkpoint's config.json, refusing anything that is not an AttnRes checkpoint folder."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise RetrofitError(f"{path} is not a checkpoint folder (no config.json); pass a folder written by "
                            "attnres-convert or save_pretrained")
    config = read_json_object(path / "config.json")
    if config.get("model_type") != "attnres":
        raise RetrofitError(f"{path} holds a {config.get('model_type')!r} model, not an AttnRes one; "
                            f"convert it first: attnres-convert {path} {path}-attnres")
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method") if isinstance(config["quantization_config"],
                                                                                 dict) else None
        raise RetrofitError(f"{path} is quantized ({method}); retrofit trains in full precision and would write a "
                            "checkpoint that is neither: retrofit the unquantized checkpoint, then quantize the "
                            "result (attnres-quantize)")
    check_attnres_config(config, path)
    return config


def check_positions(seq_len: int, config: dict) -> None:
    """Refuse windows longer than the model's positions: training there would fit the depth attention to
    positions the model was never trained on (and that its rope scaling may not cover)."""
    limit = config.get("max_position_embeddings")
    if isinstance(limit, int) and seq_len > limit:
        raise UsageError(f"--seq-len {seq_len} is longer than the model's max_position_embeddings ({limit}); "
                         f"pass --seq-len {limit} or less")


# ----------------------------------------------------------------------------------------- data


def is_validation(rel_path: str, percent: int) -> bool:
    """Split by a hash of the relative path: stable across machines, and whole files stay on one side."""
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") % 100 < percent


def corpus_files(corpus: Path, patterns: tuple[str, ...]) -> list[tuple[str, Path]]:
    """`(relative path, path)` of the corpus files, sorted; a single file is its own corpus."""
    if corpus.is_file():
        return [(corpus.name, corpus)]
    if not corpus.is_dir():
        raise RetrofitError(f"corpus {corpus} does not exist; pass a text file or a folder of text files")
    files = {p for pattern in patterns for p in corpus.rglob(pattern) if p.is_file()}
    if not files:
        raise RetrofitError(f"corpus {corpus} holds no files matching {', '.join(patterns)}; "
                            "pass --pattern GLOB for other names")
    return sorted((p.relative_to(corpus).as_posix(), p) for p in files)


def read_corpus(corpus: Path, patterns: tuple[str, ...], percent: int) -> dict[str, list[str]]:
    """`{"train": [...], "validation": [...]}` non-empty file texts; both splits must be non-empty. A corpus
    of one non-blank file (a file, or a folder holding one) is split by position (`split_text`): a hash of
    one path would put the whole corpus on one side."""
    texts = {rel: path.read_text(encoding="utf-8", errors="replace") for rel, path in corpus_files(corpus, patterns)}
    texts = {rel: text for rel, text in texts.items() if text.strip()}
    if not texts:
        raise RetrofitError(f"corpus {corpus} is empty: every matching file is blank")
    if len(texts) == 1:
        (rel, text), = texts.items()
        return split_text(text, percent, f"corpus {corpus} ({rel}, its only non-blank file)")
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for rel, text in texts.items():
        splits["validation" if is_validation(rel, percent) else "train"].append(text)
    for split, other in (("train", "validation"), ("validation", "train")):
        if not splits[split]:
            raise RetrofitError(f"corpus {corpus}: no {split} files ({len(splits[other])} {other} files at "
                                f"--validation-percent {percent}); add files or change --validation-percent")
    return splits


def split_text(text: str, percent: int, what: str) -> dict[str, list[str]]:
    """One text's splits: its last `percent` % of lines held out (at least one line; the cut by characters
    when it has one line), the rest trained on."""
    lines = text.splitlines(keepends=True)
    if len(lines) == 1:
        cut = len(text) * (100 - percent) // 100
        parts = [text[:cut], text[cut:]]
    else:
        cut = min(len(lines) - 1, max(1, round(len(lines) * (100 - percent) / 100)))
        parts = ["".join(lines[:cut]), "".join(lines[cut:])]
    if not all(part.strip() for part in parts):
        raise RetrofitError(f"{what} is too short to split into train and validation text; add text or files")
    return {"train": [parts[0]], "validation": [parts[1]]}


def token_windows(tokenizer, texts: list[str], seq_len: int, what: str) -> torch.Tensor:
    """Texts joined by the end-of-text token, cut into non-overlapping `[n, seq_len]` windows."""
    ids: list[int] = []
    for text in texts:
        # Whole files, cut into windows below: transformers' "longer than the maximum length" warning is moot.
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    n = len(ids) // seq_len
    if n == 0:
        raise RetrofitError(f"the {what} text is {len(ids)} tokens, shorter than one window of --seq-len "
                            f"{seq_len}; add text or lower --seq-len")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


class Windows(torch.utils.data.Dataset):
    """Token windows as causal-LM examples (labels are the inputs; the model shifts them)."""

    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def training_windows(tokenizer, texts: list[str], seq_len: int) -> torch.Tensor:
    """The fixed-stride windows and as many again (at most) starting at paragraph starts: a model that
    never saw a window begin where a prompt begins learns nothing about short contexts."""
    strided = token_windows(tokenizer, texts, seq_len, "training")
    starts = spread(paragraph_windows(tokenizer, texts, seq_len, min_tokens=4), strided.shape[0])
    return torch.cat([strided, starts])


def heldout_windows(tokenizer, texts: list[str], args) -> tuple[torch.Tensor, torch.Tensor]:
    """`(long, short)` held-out windows: `--eval-windows` of `--seq-len` tokens spread over the held-out
    text, and as many of `--short-tokens` starting at its paragraph starts."""
    long = spread(token_windows(tokenizer, texts, args.seq_len, "held-out"), args.eval_windows)
    short = paragraph_windows(tokenizer, texts, args.short_tokens, min_tokens=4)
    if short.shape[0] == 0:
        raise RetrofitError(f"the held-out text has no paragraph (a blank-line-separated block of at least 4 "
                            f"tokens) with {args.short_tokens} tokens from its start; add text or lower --short-tokens")
    return long, spread(short, long.shape[0])


def spread(windows: torch.Tensor, count: int) -> torch.Tensor:
    """`count` windows spread evenly over all of them (so every held-out file contributes)."""
    if count <= 0 or count >= windows.shape[0]:
        return windows
    return windows[torch.linspace(0, windows.shape[0] - 1, count).round().long()]


# ---------------------------------------------------------------------------------------- model


def select_trainable(model, which: str) -> list[str]:
    """Freeze every parameter except those `which` names (see TRAINABLE); returns the trained names."""
    markers = TRAINABLE[which]
    names = []
    for name, param in model.named_parameters():
        param.requires_grad_(any(m in name + "." if m else True for m in markers))
        if param.requires_grad:
            names.append(name)
    if not names:
        raise RetrofitError(f"--train {which}: the model has no parameter matching {markers}")
    return names


def load_model(path: Path):
    """The AttnRes model (float32, for training) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_attnres  # noqa: F401  (registers the architecture with the Auto classes)

    check_attnres(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:      # transformers' own words for a folder without tokenizer files
        cause = str(err).strip().splitlines()[0].strip()[:200]
        raise RetrofitError(f"{path} has no tokenizer that transformers can load ({type(err).__name__}: {cause}); "
                            "retrofit tokenizes CORPUS with the model's tokenizer: copy the source model's tokenizer "
                            "files into the folder (attnres-convert copies them when its source has them)") from err
    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except ValueError as err:                # weights that disagree with config.json, a corrupt file: named there
        raise RetrofitError(" ".join(str(err).split())) from err
    missing, unexpected = info["missing_keys"], info["unexpected_keys"]
    if missing or unexpected:                # transformers would start the missing ones from random values
        raise RetrofitError(f"{path} does not hold the weights its config.json describes (missing: "
                            f"{listing(sorted(missing)) or 'none'}; not in the model: "
                            f"{listing(sorted(unexpected)) or 'none'}); retrofitting would train and publish "
                            "random values in their place. Pass the complete checkpoint (copy or convert it again).")
    return model, tokenizer


# ------------------------------------------------------------------------------------- training


def training_arguments(args, world_size: int):
    """Trainer settings: cosine schedule, no weight decay (it would pull pseudo-queries back to
    uniform mixing), deterministic data order from --seed, checkpoints every --save-every steps."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=str(args.work_dir), max_steps=args.steps, per_device_train_batch_size=args.batch_size // world_size,
        learning_rate=args.lr, lr_scheduler_type="cosine", warmup_steps=args.warmup, weight_decay=0.0,
        adam_beta2=0.95, max_grad_norm=1.0, logging_steps=max(1, min(10, args.steps // 20)),
        save_steps=args.save_every, save_total_limit=2, report_to=[], seed=args.seed, data_seed=args.seed,
        eval_strategy="steps", eval_steps=args.save_every, load_best_model_at_end=True,
        metric_for_best_model="heldout", greater_is_better=False,
        dataloader_drop_last=True, dataloader_pin_memory=False, disable_tqdm=False, remove_unused_columns=False,
        # Several processes without GPUs: DDP over gloo on the CPUs (accelerate would otherwise leave
        # each process training alone).
        use_cpu=world_size > 1 and not torch.cuda.is_available(),
        # The depth parameters and norms are in every step's graph (even a first site's query, whose gradient
        # is 0): DDP's search for unused ones costs a traversal a step and warns that it found none. With
        # --train all, experts no token chose in a step are unused, and the search is needed.
        ddp_find_unused_parameters=args.train == "all",
    )


def check_distributed(world_size: int) -> None:
    """Refuse a multi-process launch that would not train as one model."""
    if world_size > 1 and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and not torch.cuda.is_available():
        raise RetrofitError("FSDP was requested, but accelerate shards models only on GPUs and other accelerators, "
                            "not on CPUs (it would run plain DDP); on CPUs launch DDP instead: accelerate launch "
                            "--multi_gpu --num_processes N -m attnres.conversion.retrofit ...")


class StopAfter(TrainerCallback):
    """A Trainer callback that saves a checkpoint and stops after `step` (an interruption, for tests)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_save = control.should_training_stop = True
        return control


def train(model, train_windows: torch.Tensor, heldout: tuple[torch.Tensor, torch.Tensor], args, world_size: int = 1,
          record: dict | None = None):
    """Train `model`'s unfrozen parameters with the Trainer, evaluating on the `(long, short)` held-out
    windows at every checkpoint; the best evaluated one is loaded at the end. Without --resume, the work
    folder starts empty, with `record` (`run_record`) for a later --resume. Returns (trainer, loss history)."""
    from transformers import TrainerState
    from transformers.trainer import TRAINER_STATE_NAME

    resume = last_checkpoint(args.work_dir) if args.resume else None
    trainer = RetrofitTrainer(model=model, args=training_arguments(args, world_size),
                              train_dataset=Windows(train_windows), eval_dataset=Windows(heldout[0]),
                              kl_weight=args.kl_weight, long=heldout[0], short=heldout[1])
    if world_size > 1 and trainer.args.world_size != world_size:
        raise RetrofitError(f"{world_size} processes were launched but the Trainer sees {trainer.args.world_size}: "
                            "each would train alone. Launch with `accelerate launch --multi_gpu --num_processes N`")
    if args.stop_after is not None:
        trainer.add_callback(StopAfter(args.stop_after))
    trainer.add_callback(EvaluateAtEnd())
    trainer.add_callback(MarkComplete())
    with work_dir_lock(args.work_dir) if trainer.is_world_process_zero() else nullcontext():
        if resume is None and trainer.is_world_process_zero():
            start_fresh(args.work_dir, record)
        trainer.accelerator.wait_for_everyone()
        if resume is not None and int(Path(resume).name.split("-")[1]) >= args.steps:
            # Finished already (killed while publishing): the Trainer, resumed at max_steps, would train on.
            trainer._load_from_checkpoint(resume)
            trainer.state = TrainerState.load_from_json(str(Path(resume) / TRAINER_STATE_NAME))
            if trainer.state.best_model_checkpoint:
                trainer._load_best_model()
        else:
            trainer.train(resume_from_checkpoint=resume)
    history = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return trainer, history


# --------------------------------------------------------------------------------------- output


def save_result(trainer, tokenizer, out: Path, metrics: dict) -> None:
    """The trained model, tokenizer and `retrofit.json`, published at `out` atomically by the main
    process (every process calls this: saving is collective under FSDP; only the main one writes)."""
    if not trainer.is_world_process_zero():
        trainer.save_model(str(out))
    else:
        with write_failures_named(out, "the output folder"), staged_folder(out) as tmp:
            trainer.save_model(str(tmp))
            tokenizer.save_pretrained(tmp)
            (tmp / "training_args.bin").unlink(missing_ok=True)     # a pickle: not part of a published model
            (tmp / "retrofit.json").write_text(json.dumps(metrics, indent=1) + "\n")
    trainer.accelerator.wait_for_everyone()


def depth_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The depth-attention tensors of a saved checkpoint folder (read from its safetensors files)."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys() if is_depth_parameter(k)})
    if not tensors:
        raise RetrofitError(f"{folder} has no depth-attention tensors (*_res_proj, *_res_norm) in its safetensors")
    return tensors


def export_depth(folder: Path, dst: Path, metadata: dict) -> int:
    """Write only the depth parameters of `folder` to `dst` (atomically); returns the tensor count."""
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    meta = {"format": DEPTH_FORMAT, **{k: str(config.get(k)) for k in DEPTH_CONFIG_KEYS},
            **{k: str(v) for k, v in metadata.items()}}
    tensors = {k: v.float().contiguous() for k, v in depth_state_dict(folder).items()}
    with write_failures_named(dst, "--export-depth"), staged_file(dst) as tmp:
        save_file(tensors, str(tmp), metadata=meta)
    return len(tensors)


def apply_depth_parameters(model, path: Path) -> dict:
    """Load a `--export-depth` file into an AttnRes model in place; returns the file's metadata.

    The file must come from a model of the same shape and block schedule, and hold exactly the
    model's depth parameters. Pseudo-query scores read RMS-normalised sources, so the residual-stream
    scale that a conversion picks does not change what the parameters mean.
    """
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if meta.get("format") != DEPTH_FORMAT:
        raise RetrofitError(f"{path} is not a depth-parameter file (format {meta.get('format')!r}, expected "
                            f"{DEPTH_FORMAT!r}); write one with attnres-retrofit --export-depth")
    wrong = [f"{k}: file {meta.get(k)} vs model {getattr(model.config, k, None)}" for k in DEPTH_CONFIG_KEYS
             if meta.get(k) != str(getattr(model.config, k, None))]
    if wrong:
        raise RetrofitError(f"{path} was trained on a different model ({'; '.join(wrong)})")
    params = {n: p for n, p in model.named_parameters() if is_depth_parameter(n)}
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected or any(params[k].shape != v.shape for k, v in tensors.items()):
        raise RetrofitError(f"{path} does not match the model's depth parameters (missing: {missing[:3]}, "
                            f"unexpected: {unexpected[:3]}, or a shape differs)")
    with torch.no_grad():
        for name, tensor in tensors.items():
            params[name].copy_(tensor.to(params[name].dtype))
    return meta


def keep_start(model, start: dict[str, torch.Tensor], before: dict, after: dict) -> None:
    """Put the starting values of the trained parameters back (no checkpoint beat the start), and say so."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in start:
                param.copy_(start[name])
    print(f"attnres-retrofit: the best checkpoint is not better than the starting model on the held-out set "
          f"(loss {after['loss']:.4f} vs {before['loss']:.4f}, short contexts {after['short_loss']:.4f} vs "
          f"{before['short_loss']:.4f}); keeping the starting model", file=sys.stderr)


# ------------------------------------------------------------------------------------------ main


def retrofit(args) -> dict:
    """Load, measure, train, measure, save, export; returns the metrics (also in DST/retrofit.json)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    check_args(args, world_size)
    if is_builtin(args.model):                          # its folder, built on first use (after the cheap checks)
        args.model = Path(builtin_folder(str(args.model), "attnres-retrofit"))
    check_outputs(args)
    check_distributed(world_size)
    check_positions(args.seq_len, check_attnres(args.model))
    texts = read_corpus(args.corpus, args.pattern, args.validation_percent)
    record = run_record(args, texts)
    if args.resume:
        check_resumable(args.work_dir, record)
    model, tokenizer = load_model(args.model)
    train_windows = training_windows(tokenizer, texts["train"], args.seq_len)
    long, short = heldout_windows(tokenizer, texts["validation"], args)
    trained = select_trainable(model, args.train)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if n in trained}
    before = heldout_metrics(model, long, short)
    trainer, history = train(model, train_windows, (long, short), args, world_size, record)
    if trainer.state.global_step < args.steps:          # --stop-after: interrupted, nothing to publish
        return {"interrupted_at": trainer.state.global_step, "history": history}
    after = heldout_metrics(trainer.model, long, short)
    kept = "best checkpoint" if no_worse(after, before) else "start"
    if kept == "start":                                 # training can only make the model better, or leave it
        keep_start(model, start, before, after)
        after = before
    trained_count = sum(p.numel() for n, p in model.named_parameters() if n in trained)
    metrics = {"model": str(args.model), "train": args.train, "trained_parameters": trained_count,
               "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "lr": args.lr,
               "warmup": args.warmup, "kl_weight": args.kl_weight, "seed": args.seed, "processes": world_size,
               "validation_percent": args.validation_percent, "pattern": list(args.pattern),
               "train_windows": train_windows.shape[0], "heldout_windows": long.shape[0],
               "short_windows": short.shape[0], "short_tokens": args.short_tokens, "kept": kept,
               "best_step": trainer.state.best_global_step if kept != "start" else 0,
               "heldout_loss_before": before["loss"], "heldout_loss_after": after["loss"],
               "heldout_short_loss_before": before["short_loss"], "heldout_short_loss_after": after["short_loss"],
               "history": history}
    out = args.out or args.work_dir / "final"
    save_result(trainer, tokenizer, out, metrics)
    if args.export_depth is not None and trainer.is_world_process_zero():
        export_depth(out, args.export_depth, {"steps": args.steps, "kept": kept,
                                              "heldout_loss_before": f"{before['loss']:.4f}",
                                              "heldout_loss_after": f"{after['loss']:.4f}"})
    return metrics


def resume_hint(work_dir: Path) -> str:
    """What an interrupted run can be continued from: its newest complete checkpoint, if one was saved."""
    try:
        checkpoint = last_checkpoint(work_dir, log=lambda _: None)
    except RetrofitError:
        return "no checkpoint was saved yet, so run it again from the start"
    return f"run the same command with --resume to continue from {checkpoint}"


def main(argv=None) -> int:
    """Console entry point: `attnres-retrofit MODEL CORPUS [options]`."""
    args = parse_args(argv)
    try:
        with redirect_stdout(sys.stderr):               # the Trainer's log lines: stdout holds the summary alone
            metrics = retrofit(args)
    except (ConversionError, OSError) as err:
        return fail("attnres-retrofit", err)
    except KeyboardInterrupt:                           # the stagings are already removed
        return fail("attnres-retrofit", f"interrupted; nothing half-written is left at "
                    f"{args.out or args.work_dir / 'final'}; {resume_hint(args.work_dir)}.", status=EXIT_INTERRUPTED)
    if int(os.environ.get("RANK", "0")) == 0 and "interrupted_at" not in metrics:
        summary = {k: v for k, v in metrics.items() if k != "history"}
        summary["heldout_ppl_before"] = math.exp(metrics["heldout_loss_before"])
        summary["heldout_ppl_after"] = math.exp(metrics["heldout_loss_after"])
        print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
