"""Corpus, tokenizer and token streams for the example training script.

The corpus is CPython's own standard library (`.py` files under `sysconfig.get_paths()["stdlib"]`),
which is on every machine that has Python, so nothing is downloaded. Everything here is
deterministic: files are listed in sorted order of their relative path, the train/validation
split is a hash of that relative path (stable across machines and Python versions), and the
byte-level BPE tokenizer is trained single-threaded on the training split only.
"""

from __future__ import annotations

import hashlib
import math
import os
import sysconfig
from pathlib import Path

import torch

# Test suites and IDLE are excluded: the tests are huge and repetitive, which would make the
# validation loss a measure of memorised boilerplate rather than of Python.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "__pycache__", "lib2to3"}
VALIDATION_PERCENT = 5
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>"]
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, *CHAT_TOKENS]

# The model is a code-completion model, not a chat model: the template joins the message contents with
# newlines so that a chat request continues the code the user sent. The newline is an expression: transformers
# and vLLM render with `trim_blocks`, which drops a newline written right after a block tag.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def stdlib_root() -> Path:
    """The directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_corpus_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """All corpus files as `(relative posix path, absolute path)`, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise FileNotFoundError(f"corpus root {root} is not a directory; pass --corpus-root with a folder of .py files")
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files.append((rel.as_posix(), path))
    if not files:
        raise FileNotFoundError(f"no .py files under {root}; pass --corpus-root with a folder of .py files")
    return sorted(files)


def is_validation(rel_path: str, percent: int = VALIDATION_PERCENT) -> bool:
    """Deterministic split by a hash of the relative path (not of the contents, which change per version)."""
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < percent


def read_texts(root: Path | None = None, validation_percent: int = VALIDATION_PERCENT) -> dict[str, list[str]]:
    """`{"train": [...], "validation": [...]}` file texts, in file order."""
    splits: dict[str, list[str]] = {"train": [], "validation": []}
    for rel, path in list_corpus_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            splits["validation" if is_validation(rel, validation_percent) else "train"].append(text)
    return splits


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (GPT-2 style) trained on `texts`; returns a `tokenizers.Tokenizer`."""
    # Single-threaded training keeps merges (and so token ids) identical from run to run.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def wrap_tokenizer(tokenizer, max_length: int):
    """A `PreTrainedTokenizerFast` with the special tokens and the chat template set."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=max_length,
        additional_special_tokens=CHAT_TOKENS,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """Every text followed by the end-of-text token, concatenated into one int32 stream."""
    eos = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    ids: list[int] = []
    # The backend tokenizer directly: documents are longer than the model's context on purpose.
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


class CorpusTooShort(ValueError):
    """A split of the corpus holds less than one training window."""


def chunk_stream(stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping windows `[n, seq_len]` (the tail that does not fill a window is dropped)."""
    n = stream.numel() // seq_len
    if n == 0:
        raise CorpusTooShort(f"a token stream of {stream.numel()} tokens is shorter than one window of --seq-len "
                             f"{seq_len}; lower --seq-len, or use a larger corpus (or --validation-percent)")
    return stream[: n * seq_len].view(n, seq_len).long()


def epoch_order(num_chunks: int, seed: int, epoch: int) -> torch.Tensor:
    """The chunk order of one epoch: a pure function of (seed, epoch), so resuming needs only the step."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_chunks, generator=gen)


def batch_indices(step: int, batch_size: int, num_chunks: int, seed: int) -> torch.Tensor:
    """Chunk indices of training batch `step` (0-based); epochs are concatenated, a batch may span two."""
    start = step * batch_size
    out = []
    for pos in range(start, start + batch_size):
        epoch, offset = divmod(pos, num_chunks)
        out.append(epoch_order(num_chunks, seed, epoch)[offset])
    return torch.stack(out)


@torch.no_grad()
def mean_loss(model, chunks: torch.Tensor, batch_size: int = 8) -> float:
    """Mean next-token cross-entropy (nats per predicted token) of `model` over `chunks [n, seq]`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, chunks.shape[0], batch_size):
        batch = chunks[start : start + batch_size]
        logits = model(input_ids=batch).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train(was_training)
    return total / count


def heldout_loss(model, tokenizer, text: str, seq_len: int) -> tuple[float, int]:
    """Loss on a held-out text: tokenized, cut into `seq_len` windows. Returns (loss, windows)."""
    ids = torch.tensor(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids, dtype=torch.int32)
    chunks = chunk_stream(ids, seq_len)
    return mean_loss(model, chunks), chunks.shape[0]


def perplexity(loss: float) -> float:
    """`exp(loss)`, the perplexity per token."""
    return math.exp(loss)
