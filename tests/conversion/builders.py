"""Tiny random source checkpoints for the converter tests, made in code with the real transformers classes."""

import json
import shutil
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

TINY = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name -> (config class, model class, overrides): GQA, tied/untied, biases, Qwen3 q/k norm, head_dim.
SOURCES = {
    "llama": (LlamaConfig, LlamaForCausalLM, dict(tie_word_embeddings=False)),
    "llama_tied_bias": (LlamaConfig, LlamaForCausalLM,
                        dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True, num_key_value_heads=4)),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM, dict(tie_word_embeddings=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(tie_word_embeddings=False, head_dim=16, num_key_value_heads=1)),
    "mistral": (MistralConfig, MistralForCausalLM, dict(tie_word_embeddings=False, sliding_window=None)),
    # Mixtures of experts: every MoE layer (Mixtral), a dense layer among them (Qwen3-MoE's mlp_only_layers),
    # and Qwen2-MoE's shared expert with every other layer sparse.
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, dict(tie_word_embeddings=False, head_dim=16, num_experts=4,
                                                             num_experts_per_tok=2, moe_intermediate_size=16,
                                                             mlp_only_layers=[1], norm_topk_prob=True)),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, dict(tie_word_embeddings=False, num_experts=4,
                                                             num_experts_per_tok=2, moe_intermediate_size=16,
                                                             shared_expert_intermediate_size=24, decoder_sparse_step=2,
                                                             norm_topk_prob=False)),
    "mixtral": (MixtralConfig, MixtralForCausalLM, dict(tie_word_embeddings=False, num_local_experts=4,
                                                         num_experts_per_tok=2, sliding_window=None)),
}
MOE_SOURCES = ("qwen3_moe", "qwen2_moe", "mixtral")

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random, biases and norm gains included (their init is 0 / 1, which would hide a
    transform that forgets them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
                param.copy_(noise)                  # routers: clear top-k choices, no ties float noise could flip
            else:
                param.copy_(0.02 * noise if name.endswith("weight") else 0.05 * noise)


def source_model(name: str, eps: float = 0.0, seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random float32 source model of the named case."""
    config_cls, model_cls, case = SOURCES[name]
    config = config_cls(**{**TINY, **case, "rms_norm_eps": eps, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    randomize(model, seed)
    return model


def save_source(model: torch.nn.Module, folder: Path, shards: bool = True, tokenizer: bool = False) -> Path:
    """Save as transformers does (sharded with an index by default), optionally with a tokenizer."""
    model.save_pretrained(folder, max_shard_size="40KB" if shards else "1GB")
    if tokenizer:
        tiny_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def tiny_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over made-up words, with a chat template (nothing is downloaded)."""
    words = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(vocab_size - 4)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def token_ids(vocab_size: int = TINY["vocab_size"], batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: the relative logit error the issue bounds."""
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


def hub_cache_snapshot(folder: Path, cache: Path, repo_id: str, sha: str = "0" * 40) -> Path:
    """Lay `folder` out as the Hub cache does (`models--ORG--NAME/refs/main` + `snapshots/<sha>/`)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / sha
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(sha)
    return snapshot


def edit_config(folder: Path, **changes) -> None:
    """Change fields of a saved config.json (to make it disagree with the weights)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))
