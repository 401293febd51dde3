"""A tiny random AttnRes model made in code: a character-level tokenizer with a chat template and random
weights in the transformers layout (what vLLM loads). Needs torch and transformers only.

`attnres-serve builtin:attnres-random` serves it (generated on first use into the cache directory, see
`defaults.cache_dir`); the tests use it on purpose: its character tokenizer and peaked logits make
exact parity checks cheap. It is not the server's default (see `defaults`).
"""

import os
from pathlib import Path

import torch

from attnres.conversion.publish import staged_folder

# Bump when the checkpoint's recipe changes, so that stale caches are regenerated.
RANDOM_MODEL_VERSION = "1"

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# vLLM's CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, ...}: 32 is the smallest.
RANDOM_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    attn_res_block_size=2,
    # Wider than the training default (0.02) so that a random model's next-token distributions are
    # peaked: distinct greedy tokens and no near-ties, which parity checks need.
    initializer_range=0.2,
)


def make_tokenizer():
    """A character-level tokenizer (printable ASCII and newline) with special tokens and a chat template.

    Every id decodes to plain text, so random models produce readable (if meaningless) strings.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
        model_max_length=RANDOM_CONFIG["max_position_embeddings"],
    )


def randomize_depth(model: torch.nn.Module, seed: int) -> None:
    """Random non-zero pseudo-queries and non-unit norm gains (they start at 0 / 1: uniform mixing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_res_proj" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            elif name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))


def write_tiny_checkpoint(path: str | os.PathLike, seed: int = 0, dtype: torch.dtype = torch.float32,
                          **config_overrides) -> Path:
    """Write a random AttnRes checkpoint and the built-in tokenizer to `path`; returns the path.

    `config_overrides` are `AttnResConfig` fields on top of `RANDOM_CONFIG`; the vocabulary is the
    tokenizer's.
    """
    from modeling_attnres import AttnResConfig, AttnResForCausalLM

    tokenizer = make_tokenizer()
    fields = {**RANDOM_CONFIG, "vocab_size": len(tokenizer), "pad_token_id": 0, "bos_token_id": 1,
              "eos_token_id": 2, **config_overrides}
    torch.manual_seed(seed)
    model = AttnResForCausalLM(AttnResConfig(**fields)).to(dtype).eval()
    randomize_depth(model, seed)
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ensure_random_model(root: str | os.PathLike) -> Path:
    """The random model's directory under `root` (`attnres-random-v1`), generated on first use and
    published atomically; a concurrent writer that published first is kept."""
    target = Path(root) / f"attnres-random-v{RANDOM_MODEL_VERSION}"
    if (target / "config.json").exists():
        return target
    try:
        with staged_folder(target, overwrite=False) as tmp:
            write_tiny_checkpoint(tmp, seed=0)
    except FileExistsError:
        if not (target / "config.json").exists():
            raise
    return target


__all__ = ["RANDOM_CONFIG", "ensure_random_model", "make_tokenizer", "randomize_depth", "write_tiny_checkpoint"]
