"""Tiny Llama GGUF files for the converter tests, written with the `gguf` package's own writer.

The layout is llama.cpp's (`convert_hf_to_gguf.py`): llama.cpp tensor names, q/k rows permuted for
its rotary convention, dimensions in ggml order, norms kept in F32, and a byte-level BPE tokenizer
with merges, control tokens and a chat template in the metadata (as SmolLM2's GGUF has).
"""

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, RopeScalingType, TokenType
from gguf.quants import dequantize, quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "o n", "e r", "Ġ c"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def tokens_and_merges() -> tuple[list[str], list[int], list[str]]:
    """Every byte (in GPT-2's byte alphabet), one token per merge, then the control tokens."""
    tokens = list(bytes_to_unicode().values()) + ["".join(m.split(" ")) for m in MERGES] + SPECIALS
    types = [TokenType.NORMAL] * (len(tokens) - len(SPECIALS)) + [TokenType.CONTROL] * len(SPECIALS)
    return tokens, types, MERGES


VOCAB_SIZE = len(tokens_and_merges()[0])


def llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's reordering of q/k rows (pairs interleaved per head), which transformers undoes."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def gguf_tensors(model) -> dict[str, torch.Tensor]:
    """The model's weights under llama.cpp's names (no `output.weight` when the head is tied)."""
    cfg, sd = model.config, model.state_dict()
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
             "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    for i in range(cfg.num_hidden_layers):
        for ours, theirs in names.items():
            out[f"blk.{i}.{ours}.weight"] = sd[f"model.layers.{i}.{theirs}.weight"]
        out[f"blk.{i}.attn_q.weight"] = llama_cpp_permute(out[f"blk.{i}.attn_q.weight"], cfg.num_attention_heads)
        out[f"blk.{i}.attn_k.weight"] = llama_cpp_permute(out[f"blk.{i}.attn_k.weight"], cfg.num_key_value_heads)
    return out


def write_metadata(writer: GGUFWriter, cfg, file_type: LlamaFileType) -> None:
    writer.add_name("tiny-llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(file_type)
    tokens, types, merges = tokens_and_merges()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|im_start|>"))
    writer.add_eos_token_id(tokens.index("<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(CHAT_TEMPLATE)


def write_gguf(model, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32, arch: str = "llama",
               raw: dict[str, np.ndarray] | None = None, expert_count: int = 0,
               extra: dict[str, np.ndarray] | None = None, rope_scaling: tuple[str, float] | None = None,
               split_max_tensors: int = 0) -> Path:
    """Write `model` (a LlamaForCausalLM with vocab VOCAB_SIZE) as a GGUF; matrices in `qtype`, norms in F32.
    `raw` stores the given arrays as they are instead of the named tensors (to write other tensor types);
    `expert_count` writes llama.cpp's `{arch}.expert_count` (how it marks a Mixtral written as "llama");
    `extra` adds tensors (llama.cpp's `rope_freqs.weight`), `rope_scaling` its rope scaling type and factor,
    and `split_max_tensors` splits the file as `llama-gguf-split` does (`path` then names the first part)."""
    file_type = {GGMLQuantizationType.F32: LlamaFileType.ALL_F32, GGMLQuantizationType.Q8_0: LlamaFileType.MOSTLY_Q8_0,
                 GGMLQuantizationType.Q4_1: LlamaFileType.MOSTLY_Q4_1}[qtype]
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    write_metadata(writer, model.config, file_type)
    if expert_count:
        writer.add_expert_count(expert_count)
    if rope_scaling:
        writer.add_rope_scaling_type(RopeScalingType(rope_scaling[0]))
        writer.add_rope_scaling_factor(rope_scaling[1])
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    for name, tensor in gguf_tensors(model).items():
        data = tensor.detach().float().numpy()
        if raw and name in raw:
            writer.add_tensor(name, raw[name])
        elif data.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def dequantised(model, qtype: GGMLQuantizationType):
    """`model` with every matrix quantized to `qtype` and back by the `gguf` package's own numpy code:
    what a correct reader of the file holds (blocks run along rows, so llama.cpp's row permutation of
    q/k commutes with this)."""
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 2 and qtype != GGMLQuantizationType.F32:
                data = param.detach().float().numpy()
                param.copy_(torch.from_numpy(dequantize(quantize(data, qtype), qtype).reshape(data.shape)))
    return model
