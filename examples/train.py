"""Train a small causal LM on CPython's standard library: Block AttnRes, Full AttnRes or a Llama baseline.

    .venv/bin/python examples/train.py --arch block --out models/attnres-tiny --overwrite

Deterministic given `--seed` (file list, split, tokenizer, initialisation and data order are all
functions of the seed and the arguments), with a tqdm bar showing loss and tokens/s, and resumable:
a checkpoint (model, optimizer, scheduler, step, RNG) is written to `--work-dir` every
`--checkpoint-every` steps; running the same command again continues from the saved step with the
same data order. `--arch llama` trains `transformers.LlamaForCausalLM` with the same dimensions,
so the three runs differ only in the residual path.

Several processes (`accelerate launch --multi_gpu --num_processes 2 examples/train.py ...`, on CPUs
with the gloo backend) split every batch evenly: DDP by default, FSDP (torch's `fully_shard`, one
unit per decoder layer) with `--fsdp`. `--batch-size` stays the global batch, so the loss curve is
the one-process curve up to float rounding, and checkpoints hold full (unsharded) state that any
process count reloads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
import attnres_data as data  # noqa: E402
from model_card import export_model  # noqa: E402

from attnres.conversion.checkpoint_io import check_destination  # noqa: E402
from attnres.conversion.errors import ConversionError  # noqa: E402
from attnres.conversion.publish import staged_file, user_cache_dir  # noqa: E402

ARCHS = ("block", "full", "llama")
# Arguments that change the data, the model or the optimisation: a checkpoint written under
# different values cannot be resumed (output paths, thread count and logging may change freely).
RESUME_KEYS = ("arch", "seed", "vocab_size", "seq_len", "batch_size", "steps", "lr", "min_lr_ratio", "warmup",
               "weight_decay", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size", "block_size",
               "corpus_root", "validation_percent")


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line options; defaults train the shipped model (under an hour on one CPU thread)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=ARCHS, default="block", help="residual path (default: block)")
    p.add_argument("--out", type=Path, help="write the trained model folder here (save_pretrained layout)")
    p.add_argument("--overwrite", action="store_true", help="replace an --out folder that holds a checkpoint")
    p.add_argument("--work-dir", type=Path, help="checkpoints and token cache (default: the user cache, "
                   "~/.cache/attnres/train/ARCH)")
    p.add_argument("--corpus-root", type=Path, help="folder of .py files (default: this Python's stdlib)")
    p.add_argument("--validation-percent", type=int, default=data.VALIDATION_PERCENT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--hidden-size", type=int, default=192)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--block-size", type=int, default=2, help="layers per block (Block AttnRes)")
    p.add_argument("--eval-windows", type=int, default=128, help="validation windows of seq-len tokens")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--stop-after", type=int, help="checkpoint and exit after this step (simulates an interruption)")
    p.add_argument("--no-resume", action="store_true", help="ignore an existing checkpoint in --work-dir")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--fsdp", action="store_true", help="shard parameters over the processes (FSDP2) instead of DDP")
    args = p.parse_args(argv)
    args.work_dir = args.work_dir or user_cache_dir() / "train" / args.arch
    return args


def check_args(args: argparse.Namespace) -> None:
    """Reject values that would only fail later, naming the value and the fix."""
    for name in ("steps", "batch_size", "seq_len", "hidden_size", "layers", "heads", "kv_heads", "intermediate_size",
                 "vocab_size", "block_size", "eval_windows", "checkpoint_every", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"error: --{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.hidden_size % args.heads:
        raise SystemExit(f"error: --hidden-size {args.hidden_size} must be a multiple of --heads {args.heads}")
    if args.heads % args.kv_heads:
        raise SystemExit(f"error: --heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    if not 0 < args.validation_percent < 100:
        raise SystemExit(f"error: --validation-percent must be in 1..99, got {args.validation_percent}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % world:
        raise SystemExit(f"error: --batch-size {args.batch_size} (the global batch) must be a multiple of the "
                         f"{world} processes")
    if args.fsdp and world == 1:
        raise SystemExit("error: --fsdp shards over several processes; launch with "
                         "`accelerate launch --multi_gpu --num_processes 2 examples/train.py --fsdp ...`")
    if args.vocab_size < 256 + len(data.SPECIAL_TOKENS):
        raise SystemExit(f"error: --vocab-size {args.vocab_size} is below the 256 byte tokens plus "
                         f"{len(data.SPECIAL_TOKENS)} special tokens; use at least 300")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise SystemExit(f"error: --lr must be a finite number > 0, got {args.lr} (the default is 2e-3)")
    if args.out is not None:          # before training: the output replaces --out whole, as attnres-convert's DST
        try:
            check_destination(args.out, args.corpus_root or data.stdlib_root(), args.overwrite, "--out",
                              "--corpus-root")
        except ConversionError as err:
            raise SystemExit(f"error: {err}") from None


# ----------------------------------------------------------------------------------------- data


def prepare_data(args):
    """Tokenizer and `[n, seq_len]` train/validation windows, cached in the work dir by argument key."""
    key = {k: str(getattr(args, k)) for k in ("corpus_root", "validation_percent", "vocab_size", "seq_len")}
    cache = args.work_dir / "data.pt"
    if cache.exists():
        blob = torch.load(cache, weights_only=True)
        if blob["key"] == key:
            from tokenizers import Tokenizer

            tok = data.wrap_tokenizer(Tokenizer.from_str(blob["tokenizer"]), args.seq_len)
            return tok, blob["train"], blob["validation"], blob["heldout_text"]
    texts = data.read_texts(args.corpus_root, args.validation_percent)
    if not texts["validation"]:
        raise SystemExit(f"error: no validation files in the corpus at {args.corpus_root or data.stdlib_root()}; "
                         f"add files or raise --validation-percent ({args.validation_percent})")
    raw = data.train_tokenizer(texts["train"], args.vocab_size)
    tok = data.wrap_tokenizer(raw, args.seq_len)
    train = data.chunk_stream(data.encode_stream(tok, texts["train"]), args.seq_len)
    val = data.chunk_stream(data.encode_stream(tok, texts["validation"]), args.seq_len)
    heldout = heldout_sample("\n".join(texts["validation"]))
    blob = {"key": key, "tokenizer": raw.to_str(), "train": train, "validation": val, "heldout_text": heldout}
    atomic_save(blob, cache)
    return tok, train, val, heldout


def heldout_sample(text: str, chars: int = 6000) -> str:
    """The first ~`chars` characters of the validation text, cut at a line end: the small fixed
    slice on which the model card's held-out loss is measured (and the tests re-measure it)."""
    cut = text.rfind("\n", 0, chars)
    return text[: cut + 1 if cut > 0 else chars]


def eval_windows(val: torch.Tensor, count: int) -> torch.Tensor:
    """`count` validation windows spread evenly over the validation stream (every file contributes)."""
    if count >= val.shape[0]:
        return val
    idx = torch.linspace(0, val.shape[0] - 1, count).round().long()
    return val[idx]


# ---------------------------------------------------------------------------------------- model


def model_kwargs(args, tok) -> dict:
    """Config fields shared by the three architectures (so they differ only in the residual path)."""
    return dict(
        vocab_size=len(tok),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def build_model(args, tok) -> torch.nn.Module:
    """A freshly initialised model; initialisation is seeded so every run of a command is identical."""
    torch.manual_seed(args.seed)
    if args.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**model_kwargs(args, tok))
        config._attn_implementation = "sdpa"
        return LlamaForCausalLM(config)
    from modeling_attnres import AttnResConfig, AttnResForCausalLM

    config = AttnResConfig(**model_kwargs(args, tok), attn_res_mode=args.arch, attn_res_block_size=args.block_size)
    config._attn_implementation = "sdpa"
    return AttnResForCausalLM(config)


def build_optimizer(model, args):
    """AdamW with linear warm-up then cosine decay to `lr * min_lr_ratio`.

    Norm gains, the embedding and the depth pseudo-queries are not decayed: decaying a pseudo-query
    pulls its site back towards uniform mixing, which is exactly what training should be free to leave.
    """
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        skip = param.ndim < 2 or "embed_tokens" in name or "_res_proj" in name
        (no_decay if skip else decay).append(param)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_factor(step: int) -> float:
        if step < args.warmup:
            return (step + 1) / args.warmup
        progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)


# ----------------------------------------------------------------------------------- distributed


def init_distributed() -> tuple[int, int]:
    """(rank, world size): one process, or one of WORLD_SIZE processes started by accelerate/torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")           # CPU tensors: the example trains on CPU
    return (torch.distributed.get_rank() if world > 1 else 0), world


def wrap_model(model, args, world: int):
    """DDP (gradients averaged) or FSDP2 (each decoder layer, then the rest, sharded) over the processes."""
    if world == 1:
        return model
    if not args.fsdp:
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    # A layer that stores no block returns the bank it was given, which FSDP sees as a view and warns about
    # (an in-place op on it would skip FSDP's hook); the bank is never written in place under autograd (it
    # grows by concatenation), so the warning, once per rank, says nothing about this model.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPAttnRes\w*\) returned a view tensor")
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def mean_over_processes(value: torch.Tensor, world: int) -> float:
    """The mean of a per-process scalar (equal shards: the global batch mean)."""
    if world > 1:
        value = value.clone()
        torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.AVG)
    return value.item()


def full_state(model, optimizer) -> tuple[dict, dict]:
    """Unsharded model and optimizer state dicts, keyed by parameter name whatever the wrapper
    (plain, DDP or FSDP), so a checkpoint reloads under any process count."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state(model, optimizer, model_state: dict, optim_state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(full_state_dict=True))


# ----------------------------------------------------------------------------------- checkpoints


def atomic_save(obj, path: Path) -> None:
    """`torch.save` published atomically (`attnres.conversion.publish`): never a torn file. Only tensors,
    numbers, strings and containers of them, so that `torch.load(weights_only=True)` reads it back."""
    with staged_file(path) as tmp:
        torch.save(obj, tmp)


def save_checkpoint(path: Path, model, optimizer, scheduler, step: int, args, history: list, seconds: float) -> None:
    """Everything needed to continue exactly: weights, optimizer moments, schedule, step, RNG, loss
    history, and the training seconds so far (so a resumed run reports the total time). Every
    process gathers; the first one writes."""
    model_state, optim_state = full_state(model, optimizer)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    atomic_save({
        "model": model_state,
        "optimizer": optim_state,
        "scheduler": scheduler.state_dict(),
        "step": step,
        "rng": torch.get_rng_state(),
        "args": {k: str(getattr(args, k)) for k in RESUME_KEYS},
        "history": history,
        "seconds": seconds,
    }, path)


def load_checkpoint(path: Path, model, optimizer, scheduler, args) -> tuple[int, list, float]:
    """Restore a checkpoint written by the same command; returns (next step, loss history, seconds)."""
    state = torch.load(path, weights_only=True)
    expected = {k: str(getattr(args, k)) for k in RESUME_KEYS}
    changed = {k: (state["args"].get(k), v) for k, v in expected.items() if state["args"].get(k) != v}
    if changed:
        detail = ", ".join(f"{k}: checkpoint {old!r} vs now {new!r}" for k, (old, new) in changed.items())
        raise SystemExit(f"error: checkpoint {path} was written with different arguments ({detail}); "
                         f"rerun with the original arguments, or pass --no-resume to start over")
    load_full_state(model, optimizer, state["model"], state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return state["step"], state["history"], state.get("seconds", 0.0)


# -------------------------------------------------------------------------------------- training


def train_step(model, optimizer, scheduler, batch: torch.Tensor, world: int = 1) -> float:
    """One optimizer step on this process's share of the batch `[b, seq]`; returns the loss of the
    whole batch (mean over predicted tokens; every share has the same number of tokens)."""
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return mean_over_processes(loss.detach(), world)


def train(args) -> dict:
    """Run (or resume) training; returns the metrics dict (also written to work_dir/metrics.json).

    Thread count and deterministic mode are process-wide, so they are restored afterwards (the
    tests call this in-process).
    """
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return run_training(args)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def run_training(args) -> dict:
    """The training loop proper (see `train`)."""
    rank, world = init_distributed()
    if rank == 0:                                   # the first process tokenizes and caches, the others read
        prepare_data(args)
    if world > 1:
        torch.distributed.barrier()
    tok, train_chunks, val_chunks, heldout = prepare_data(args)
    model = wrap_model(build_model(args, tok).train(), args, world)
    optimizer, scheduler = build_optimizer(model, args)
    ckpt = args.work_dir / "checkpoint.pt"
    start, history, before = 0, [], 0.0
    if ckpt.exists() and not args.no_resume:
        start, history, before = load_checkpoint(ckpt, model, optimizer, scheduler, args)
        print(f"resuming from {ckpt} at step {start}/{args.steps}", file=sys.stderr)
    tokens_per_step = args.batch_size * args.seq_len
    stop = min(args.steps, args.stop_after) if args.stop_after is not None else args.steps
    began = time.perf_counter()
    bar = tqdm(range(start, stop), initial=start, total=args.steps, desc=args.arch, mininterval=2, smoothing=0.1,
               disable=rank != 0)
    share = args.batch_size // world
    for step in bar:
        batch = train_chunks[data.batch_indices(step, args.batch_size, train_chunks.shape[0], args.seed)]
        history.append(train_step(model, optimizer, scheduler, batch[rank * share : (rank + 1) * share], world))
        rate = (step + 1 - start) * tokens_per_step / (time.perf_counter() - began)
        bar.set_postfix(loss=f"{history[-1]:.3f}", tok_s=f"{rate:.0f}", lr=f"{scheduler.get_last_lr()[0]:.2e}")
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == stop:
            seconds = before + time.perf_counter() - began
            save_checkpoint(ckpt, model, optimizer, scheduler, step + 1, args, history, seconds)
    bar.close()
    elapsed = time.perf_counter() - began
    metrics = {"arch": args.arch, "steps_done": stop, "train_tokens": stop * tokens_per_step,
               "corpus_train_tokens": train_chunks.numel(),
               "final_train_loss": history[-1] if history else None, "history": history,
               "tokens_per_s": (stop - start) * tokens_per_step / elapsed if stop > start else None,
               "train_seconds_this_run": elapsed, "train_seconds_total": before + elapsed}
    if stop == args.steps:
        metrics.update(evaluate(model, tok, val_chunks, heldout, args))
        if args.out:
            export(model, optimizer, tok, args, metrics, heldout, rank, world)
    if rank == 0:
        (args.work_dir / "metrics.json").write_text(json.dumps(metrics, indent=1))
    return metrics


def export(model, optimizer, tok, args, metrics: dict, heldout: str, rank: int, world: int) -> None:
    """The model folder (and card), from the first process; a wrapped model is gathered into a plain one."""
    if world > 1:
        state = full_state(model, optimizer)[0]
        if rank != 0:
            return
        model = build_model(args, tok)
        model.load_state_dict(state)
    export_model(model, tok, args, metrics, heldout, defaults=vars(parse_args([])))


def evaluate(model, tok, val_chunks, heldout: str, args) -> dict:
    """Validation loss on `--eval-windows` windows and the loss on the held-out sample text."""
    windows = eval_windows(val_chunks, args.eval_windows)
    val_loss = data.mean_loss(model, windows)
    heldout_loss, heldout_windows = data.heldout_loss(model, tok, heldout, args.seq_len)
    return {"val_loss": val_loss, "val_ppl": data.perplexity(val_loss),
            "val_tokens": windows[:, 1:].numel(), "heldout_loss": heldout_loss,
            "heldout_windows": heldout_windows, "params": sum(p.numel() for p in model.parameters()),
            "uniform_loss": float(torch.log(torch.tensor(float(len(tok)))))}


def main(argv=None) -> int:
    args = parse_args(argv)
    check_args(args)
    try:
        metrics = train(args)
    except (FileNotFoundError, data.CorpusTooShort) as err:     # a bad --corpus-root or --seq-len: no traceback
        raise SystemExit(f"error: {err}") from None
    except KeyboardInterrupt:              # checkpoints and the model folder are written whole or not at all
        saved = (args.work_dir / "checkpoint.pt").exists()
        print("error: interrupted; " + (f"run the same command to continue from the last checkpoint in "
                                        f"{args.work_dir}" if saved else "no checkpoint was saved yet") + ".",
              file=sys.stderr)
        return 130
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    summary = {k: v for k, v in metrics.items() if k != "history"}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
