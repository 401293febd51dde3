"""The work folder of an `attnres-retrofit` run (`--work-dir`): its Trainer checkpoints, each published
with a completion marker so that one cut short by a kill is never resumed from, the record of what they
were trained from (so that `--resume` continues only the same run), and the lock that keeps a second run
out of it."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from .errors import ConversionError
from .publish import fsync_tree, hash_file, sha256_of, staged_file

COMPLETE_MARKER = "attnres-complete.json"       # in a Trainer checkpoint: its files' hashes, written last
RUN_RECORD = "attnres-run.json"                 # in --work-dir: what its checkpoints were trained from
# The options a run's batches and weights depend on: --resume must be given the same ones.
RUN_OPTIONS = ("train", "steps", "batch_size", "seq_len", "lr", "warmup", "kl_weight", "seed", "validation_percent",
               "pattern", "eval_windows", "short_tokens", "save_every")


class RetrofitError(ConversionError):
    """A user-facing error: bad model, corpus or depth file (exit 1; bad options are `UsageError`)."""


def checkpoint_files(folder: Path) -> dict[str, str]:
    """sha256 of every file of a Trainer checkpoint folder but its completion marker, by relative path."""
    return {p.relative_to(folder).as_posix(): sha256_of(p)
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != COMPLETE_MARKER}


def is_complete(folder: Path) -> bool:
    """Whether a checkpoint was finished: its marker lists exactly the files it holds, unchanged."""
    try:
        return json.loads((folder / COMPLETE_MARKER).read_text())["files"] == checkpoint_files(folder)
    except (OSError, ValueError, KeyError, TypeError):
        return False


class MarkComplete(TrainerCallback):
    """After the Trainer saved a checkpoint (it writes in place), flush it to disk and publish a marker
    with its files' hashes: a checkpoint counts for --resume only once its marker is there (`is_complete`),
    so one cut short by a kill is never resumed from."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            fsync_tree(folder)
            marker = json.dumps({"step": state.global_step, "files": checkpoint_files(folder)})
            with staged_file(folder / COMPLETE_MARKER) as tmp:
                tmp.write_text(marker)
        return control


def last_checkpoint(work_dir: Path, log=print) -> str:
    """The newest complete Trainer checkpoint under `work_dir`, for --resume (incomplete ones, left by a
    run that was killed while saving, are passed over, and said so)."""
    found = sorted((int(p.name.split("-")[1]), p) for p in work_dir.glob("checkpoint-*")
                   if p.is_dir() and p.name.split("-")[1].isdigit()) if work_dir.is_dir() else []
    for _, folder in reversed(found):
        if is_complete(folder):
            return str(folder)
        log(f"attnres-retrofit: {folder} is incomplete (its run was interrupted while saving); passing over it")
    raise RetrofitError(f"--resume: no complete checkpoint-* folder in {work_dir}; run without --resume to start")


def run_record(args: argparse.Namespace, texts: dict[str, list[str]]) -> dict:
    """What a run's checkpoints depend on, for --resume: MODEL's files, the corpus's text, the RUN_OPTIONS."""
    model = hashlib.sha256()
    for file in [args.model / "config.json", *sorted(args.model.glob("*.safetensors"))]:
        model.update(file.name.encode())
        hash_file(file, model)
    corpus = hashlib.sha256("\0".join([*texts["train"], "\1", *texts["validation"]]).encode())
    options = {name: list(args.pattern) if name == "pattern" else getattr(args, name) for name in RUN_OPTIONS}
    return {"model": str(args.model.resolve()), "model_sha256": model.hexdigest(),
            "corpus_sha256": corpus.hexdigest(), "options": options}


def check_resumable(work_dir: Path, record: dict) -> None:
    """--resume continues only the run whose checkpoints `work_dir` holds: the same model files, corpus and
    options (its batches and weights depend on them), else it is refused, naming what differs."""
    if not any(work_dir.glob("checkpoint-*")):
        raise RetrofitError(f"--resume: no complete checkpoint-* folder in {work_dir}; run without --resume to start")
    try:
        saved = json.loads((work_dir / RUN_RECORD).read_text())
    except (OSError, ValueError):
        raise RetrofitError(f"--resume: {work_dir} has no record of the model and options its checkpoints were "
                            f"trained with ({RUN_RECORD}, written by attnres-retrofit when a run starts); run without "
                            "--resume to start over") from None
    changed = []
    if saved.get("model_sha256") != record["model_sha256"]:
        changed.append(f"MODEL (they were trained from {saved.get('model')}; {record['model']} has other files)")
    if saved.get("corpus_sha256") != record["corpus_sha256"]:
        changed.append("CORPUS (its text differs)")
    old = saved.get("options") or {}
    changed += [f"--{name.replace('_', '-')} (was {old.get(name)}, now {value})"
                for name, value in record["options"].items() if old.get(name) != value]
    if changed:
        raise RetrofitError(f"--resume: the checkpoints in {work_dir} were trained with another "
                            f"{'; '.join(changed)}. Resume with the same model, corpus and options, run without "
                            "--resume to start over, or pass another --work-dir")


def start_fresh(work_dir: Path, record: dict | None) -> None:
    """A run without --resume: an earlier run's checkpoints are removed first (a later --resume takes the
    newest), then this run's record is written (so a kill in between leaves no record to resume from)."""
    for folder in work_dir.glob("checkpoint-*"):
        if folder.is_dir():
            shutil.rmtree(folder)
    (work_dir / RUN_RECORD).unlink(missing_ok=True)
    if record is not None:
        with staged_file(work_dir / RUN_RECORD) as tmp:
            tmp.write_text(json.dumps(record, indent=1) + "\n")


@contextmanager
def work_dir_lock(work_dir: Path) -> Iterator[None]:
    """Hold `work_dir` for this run: a second run in the same folder would overwrite this one's
    checkpoints, so it is refused (the lock dies with its holder)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(work_dir / ".attnres-retrofit.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise RetrofitError(f"--work-dir {work_dir} is in use by another attnres-retrofit run; wait for it, or "
                                "pass another --work-dir") from None
        yield
    finally:
        os.close(fd)
