"""Tiny AttnRes configs and models made in code for the tests (nothing is downloaded)."""

import shutil
import textwrap

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import modeling_attnres
from modeling_attnres import AttnResConfig, AttnResForCausalLM

TINY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    attn_res_block_size=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(**overrides) -> AttnResConfig:
    """A fresh tiny config per call (`_from_config` mutates the config it is given)."""
    return AttnResConfig(**{**TINY, **overrides})


def randomize_depth_parameters(model: torch.nn.Module, seed: int = 0, scale: float = 1.0) -> None:
    """Give every pseudo-query and depth key-norm gain a random non-zero value (they start at 0 / 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_res_proj" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
            elif "_res_norm" in name or name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))


def tiny_model(seed: int = 0, dtype=torch.float32, randomize: bool = True, **overrides) -> AttnResForCausalLM:
    """A tiny AttnRes LM with random weights, random depth parameters and eager attention by default."""
    torch.manual_seed(seed)
    overrides.setdefault("attn_implementation", "eager")
    attn_impl = overrides.pop("attn_implementation")
    config = tiny_config(**overrides)
    config._attn_implementation = attn_impl
    model = AttnResForCausalLM(config).to(dtype).eval()
    if randomize:
        randomize_depth_parameters(model, seed)
    return model


def oracle_state_dict(model: torch.nn.Module, dtype=torch.float64) -> dict[str, torch.Tensor]:
    """The model's weights as `tests/oracle.py` takes them: `dtype`, no tied `lm_head` entry."""
    sd = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def perturbed_copy(src, dst, names, seed=0) -> dict:
    """A checkpoint folder `src` with the `names` tensors changed (random, 0.3 of their scale), saved to
    `dst`; returns the changed tensors."""
    shutil.copytree(src, dst)
    weights, gen = load_file(src / "model.safetensors"), torch.Generator().manual_seed(seed)
    changes = {}
    for name in names:
        old = weights[name]
        noise = torch.randn(old.shape, generator=gen).to(old.dtype)
        changes[name] = old + 0.3 * old.float().std().clamp(min=0.1) * noise
    save_file({**weights, **changes}, dst / "model.safetensors", metadata={"format": "pt"})
    return changes


def write_head_checkpoint(base, out, head: str, num_labels: int = 3, seed: int = 11):
    """The causal-LM checkpoint `base` with the task head `head` (a `modeling_attnres` class name) of
    `num_labels` labels, its score layer as transformers initialises it (a bias, where the head has one, set
    to non-zero values so that a loader that drops it is caught), saved to `out` with `base`'s tokenizer."""
    torch.manual_seed(seed)
    model = getattr(modeling_attnres, head).from_pretrained(base, num_labels=num_labels, dtype=torch.float32)
    if model.score.bias is not None:
        model.score.bias.data = torch.linspace(0.5, -0.25, num_labels)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    return out


# A child script: load a saved folder with `trust_remote_code=True` where `modeling_attnres` cannot be
# imported, and save its logits for `ids` (argv: folder, ids file, output file, torch threads).
LOAD_WITHOUT_PACKAGE = textwrap.dedent(
    """
    import sys
    sys.modules["modeling_attnres"] = None          # the package is not importable here
    try:
        import modeling_attnres
    except ImportError:
        pass
    else:
        raise SystemExit("modeling_attnres is importable: the test would prove nothing")
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
    path, ids_path, out_path, threads = sys.argv[1:5]
    torch.set_num_threads(int(threads))             # same reduction order as the parent: exact logits
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(config).__module__.startswith("transformers_modules"), type(config).__module__
    # A head builds its base model through AutoModel, which the remote module registers for its config
    # (loaded first: loading AutoModel itself would register it).
    head = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True, num_labels=2)
    assert type(head.model).__module__.startswith("transformers_modules"), type(head.model).__module__
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, attn_implementation="eager").eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    assert type(AutoModel.from_pretrained(path, trust_remote_code=True)).__name__ == "AttnResModel"
    ids = torch.load(ids_path)
    with torch.no_grad():
        torch.save(model(ids).logits, out_path)
    """
)
