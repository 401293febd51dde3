"""A naive, independent implementation of `docs/spec.md`: the test oracle.

Written straight from the spec's pseudo-code with plain tensors and a state dict, sharing no code
with `modeling_attnres` (not even its depth-attention kernel). Runs full-sequence, no cache, with an
optional causal + padding mask, in whatever dtype the weights are (tests use float64).
"""

import math

import torch


def rms_norm(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def key_norm(x, gain, eps):
    """The spec's key norm: RMSNorm, except that an all-zero source's key is 0 when eps = 0 as well."""
    zero = (x.pow(2).mean(-1, keepdim=True) + eps) == 0
    return torch.where(zero, torch.zeros_like(x), rms_norm(x, gain, eps))


def naive_mix(sources, w, gain, eps):
    """sum_i softmax_i(w . key_norm(s_i)) * s_i, over a Python list of [B, T, d] sources."""
    scores = torch.stack([(key_norm(s, gain, eps) * w).sum(-1) for s in sources])   # [n, B, T]
    probs = torch.softmax(scores, dim=0)
    return sum(p[..., None] * s for p, s in zip(probs, sources)), probs


def rope(x, positions, theta):
    """x: [B, H, T, hd]; positions: [B, T]. Llama's rotate-half convention."""
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = positions[..., None].double() * inv                                          # [B, T, hd/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None].to(x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def attention(sd, prefix, h, cfg, positions, mask):
    B, T, _ = h.shape
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def proj(name):
        y = h @ sd[f"{prefix}.{name}.weight"].T
        bias = sd.get(f"{prefix}.{name}.bias")
        return y if bias is None else y + bias

    q = proj("q_proj").view(B, T, nh, hd)
    k = proj("k_proj").view(B, T, nkv, hd)
    v = proj("v_proj").view(B, T, nkv, hd)
    if cfg.qk_norm:
        q = rms_norm(q, sd[f"{prefix}.q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, sd[f"{prefix}.k_norm.weight"], cfg.rms_norm_eps)
    theta = cfg.rope_parameters["rope_theta"]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    rep = nh // nkv
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ v                                # [B, H, T, hd]
    out = out.transpose(1, 2).reshape(B, T, nh * hd)
    y = out @ sd[f"{prefix}.o_proj.weight"].T
    bias = sd.get(f"{prefix}.o_proj.bias")
    return y if bias is None else y + bias


def mlp(sd, prefix, h):
    gate = h @ sd[f"{prefix}.gate_proj.weight"].T
    up = h @ sd[f"{prefix}.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ sd[f"{prefix}.down_proj.weight"].T


def naive_forward(sd, cfg, input_ids, attention_mask=None, return_weights=False):
    """Logits `[B, T, V]` of an AttnRes model given its HF-named state dict, per the spec.

    Block mode follows the spec's pseudo-code literally (blocks list, partial, `l % k == 0`);
    full mode mixes `[embedding, v_0, ..., v_{j-1}]` at site j.
    """
    B, T = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(B, T, dtype=torch.bool)
    attention_mask = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    mask = causal[None] & attention_mask[:, None, :]                                    # [B, T, T]
    eps = cfg.rms_norm_eps
    emb = sd["model.embed_tokens.weight"][input_ids]
    weights = []

    def site(sources, name):
        out, probs = naive_mix(sources, sd[f"{name}_proj.weight"][0], sd[f"{name}_norm.weight"], eps)
        weights.append(probs)
        return out

    def attn_sub(l, h):
        p = f"model.layers.{l}"
        return attention(sd, f"{p}.self_attn", rms_norm(h, sd[f"{p}.input_layernorm.weight"], eps), cfg,
                         positions, mask)

    def mlp_sub(l, h):
        p = f"model.layers.{l}"
        return mlp(sd, f"{p}.mlp", rms_norm(h, sd[f"{p}.post_attention_layernorm.weight"], eps))

    L = cfg.num_hidden_layers
    if cfg.attn_res_mode == "full":
        sources = [emb]
        for l in range(L):
            sources.append(attn_sub(l, site(sources, f"model.layers.{l}.self_attention_res")))
            sources.append(mlp_sub(l, site(sources, f"model.layers.{l}.mlp_res")))
        out = site(sources, "model.output_attn_res")
    else:
        k = cfg.attn_res_block_size
        blocks, partial = [], emb
        for l in range(L):
            h = site(blocks + [partial], f"model.layers.{l}.self_attention_res")
            if l % k == 0:
                blocks.append(partial)
                partial = None
            a = attn_sub(l, h)
            partial = a if partial is None else partial + a
            h = site(blocks + [partial], f"model.layers.{l}.mlp_res")
            partial = partial + mlp_sub(l, h)
        out = site(blocks + [partial], "model.output_attn_res")
    hidden = rms_norm(out, sd["model.norm.weight"], eps)
    head = sd.get("lm_head.weight", sd["model.embed_tokens.weight"])
    logits = hidden @ head.T
    return (logits, weights) if return_weights else logits
