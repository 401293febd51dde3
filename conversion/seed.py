"""Other AttnRes layouts -> ours: the seed pseudo-code's names and plain training-script state dicts.

The seed pseudo-code names a layer's pre-attention site `attn_res_proj` / `attn_res_norm` (ours:
`self_attention_res_proj` / `self_attention_res_norm`), its pre-MLP site `mlp_res_proj` /
`mlp_res_norm` (same as ours), and counts the block size in *sublayers* (an attention or an MLP),
two per layer. We count layers, so a seed block of `2k` sublayers is `attn_res_block_size=k`, a
block of one sublayer is Full AttnRes (every sublayer its own source), and any other odd size has no
equivalent. The seed has no name for the output site; we accept `final_attn_res_*`,
`output_attn_res_*`, `out_attn_res_*` and `final_res_*`, with or without the `model.` prefix.
Training scripts often wrap the model (DDP's `module.`, torch.compile's `_orig_mod.`) or save the
inner model without `model.`; `normalize_key` undoes that before the table applies.

Assumption: the seed's layer counter is 0-based and a block closes at `layer % (block_size // 2) == 0`,
which is the spec's schedule (K3 wins where sources differ).
"""

import dataclasses
import warnings
from collections.abc import Iterable

import torch
from huggingface_hub.errors import StrictDataclassError

from modeling_attnres import AttnResConfig

from .errors import ConversionError, listing
from .keymap import Rule, TensorSource
from .standard import LAYER, ROTARY_TABLES, same_keys

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
OUTPUT_SITE_NAMES = ("final_attn_res", "output_attn_res", "out_attn_res", "final_res")
# Config keys an AttnResConfig understands: its fields plus Llama's legacy rope spellings.
CONFIG_KEYS = {f.name for f in dataclasses.fields(AttnResConfig)} | {"rope_theta", "rope_scaling"}
NOT_CARRIED_KEYS = {"block_size", "model_type", "auto_map", "architectures", "transformers_version"}


def _split_config(config: dict) -> tuple[dict, list[str]]:
    """The keys to build the config from, and the foreign ones (training knobs) to report. Bookkeeping
    every saved transformers config has (`_name_or_path`, `torch_dtype`, ...) is dropped quietly."""
    bookkeeping = set(AttnResConfig().to_dict()) | {"torch_dtype"}
    fields = {k: v for k, v in config.items() if k in CONFIG_KEYS and k not in NOT_CARRIED_KEYS}
    return fields, sorted(set(config) - CONFIG_KEYS - NOT_CARRIED_KEYS - bookkeeping)


def _site(ours: str, *theirs: str) -> tuple[Rule, ...]:
    names = (ours, *theirs)
    return (Rule(tuple(f"{n}_proj.weight" for n in names), f"{ours}_proj.weight", "as_query"),
            Rule(tuple(f"{n}_norm.weight" for n in names), f"{ours}_norm.weight"))


SEED_RULES = (
    *same_keys("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"),
    *same_keys(*(f"{LAYER}.self_attn.{p}_proj.{t}" for p in "qkvo" for t in ("weight", "bias"))),
    *same_keys(f"{LAYER}.self_attn.q_norm.weight", f"{LAYER}.self_attn.k_norm.weight"),
    *same_keys(*(f"{LAYER}.mlp.{p}_proj.{t}" for p in ("gate", "up", "down") for t in ("weight", "bias"))),
    Rule((f"{LAYER}.input_layernorm.weight", f"{LAYER}.attn_norm.weight"), f"{LAYER}.input_layernorm.weight"),
    Rule((f"{LAYER}.post_attention_layernorm.weight", f"{LAYER}.mlp_norm.weight"),
         f"{LAYER}.post_attention_layernorm.weight"),
    *_site(f"{LAYER}.self_attention_res", f"{LAYER}.attn_res"),
    *_site(f"{LAYER}.mlp_res"),
    *_site("model.output_attn_res", *(f"model.{n}" for n in OUTPUT_SITE_NAMES if n != "output_attn_res")),
    ROTARY_TABLES,
)


def normalize_key(key: str) -> str:
    """Strip training wrappers (`module.`, `_orig_mod.`) and add the `model.` prefix where the inner
    model was saved on its own. `lm_head.` stays top-level, as in transformers."""
    while key.startswith(WRAPPER_PREFIXES):
        key = key.split(".", 1)[1]
    return key if key.startswith(("model.", "lm_head.")) else f"model.{key}"


class NormalizedSource:
    """A tensor source seen through `normalize_key`, still lazy."""

    def __init__(self, source: TensorSource):
        self._source = source
        self._original = {}
        for key in source.keys():
            self._original.setdefault(normalize_key(key), []).append(key)
        twice = [f"{' and '.join(keys)}" for keys in self._original.values() if len(keys) > 1]
        if twice:
            raise ConversionError(f"Keys that differ only by a wrapper prefix: {listing(twice)}; "
                                  "save the checkpoint from one module only.")

    def keys(self) -> Iterable[str]:
        return self._original.keys()

    def get(self, key: str) -> torch.Tensor:
        return self._source.get(self._original[key][0])

    def shape(self, key: str) -> tuple[int, ...]:
        return self._source.shape(self._original[key][0])

    def dtype(self, key: str) -> torch.dtype:
        return self._source.dtype(self._original[key][0])


def block_size_from_sublayers(sublayers: int) -> dict:
    """AttnResConfig fields for a seed block size counted in sublayers."""
    if sublayers == 1:
        return {"attn_res_mode": "full"}
    if sublayers < 1 or sublayers % 2:
        raise ConversionError(
            f"Seed block size {sublayers} (in sublayers) cannot be expressed: AttnRes blocks hold whole "
            "layers (2 sublayers each), so expected 1 (Full AttnRes) or an even number; a block of "
            f"{sublayers} sublayers would split a layer between two blocks."
        )
    return {"attn_res_mode": "block", "attn_res_block_size": sublayers // 2}


def _infer_flags(keys: Iterable[str], fields: dict) -> None:
    """Booleans a training config often omits but the weights show."""
    keys = set(keys)
    fields.setdefault("tie_word_embeddings", "lm_head.weight" not in keys)
    fields.setdefault("qk_norm", any(k.endswith("self_attn.q_norm.weight") for k in keys))
    fields.setdefault("attention_bias", any(k.endswith("self_attn.q_proj.bias") for k in keys))
    fields.setdefault("mlp_bias", any(k.endswith("mlp.gate_proj.bias") for k in keys))


def attnres_config_from_seed(config: dict, keys: Iterable[str], seed_block_size: int | None = None) -> AttnResConfig:
    """An AttnResConfig from a training-script config dict (Llama field names).

    The seed's `block_size` (sublayers) or `seed_block_size` sets the block size; a config that is
    already ours (`model_type: attnres`) keeps `attn_res_block_size` (layers).
    """
    fields, ignored = _split_config(config)
    if ignored:  # training hyper-parameters and the like: not part of the model, kept out of config.json
        warnings.warn(f"Config keys that are not AttnResConfig fields were ignored: {', '.join(ignored)}")
    own = config.get("block_size")
    if seed_block_size is not None and own is not None and own != seed_block_size:
        # The flag wins (a training script's `block_size` may mean its context length), but not unsaid:
        # verification reads the same schedule, so a wrong one would pass it.
        warnings.warn(f"--seed-block-size {seed_block_size} overrides the checkpoint's own block_size {own!r}; "
                      "the converted model mixes blocks of that many sublayers.")
    sublayers = seed_block_size if seed_block_size is not None else own
    if sublayers is not None:
        fields.pop("attn_res_block_size", None)
        if isinstance(sublayers, bool) or not isinstance(sublayers, int):
            raise ConversionError(f"The seed checkpoint's block_size {sublayers!r} is not a number of sublayers per "
                                  "block; pass --seed-block-size N (as in the seed pseudo-code).")
        fields.update(block_size_from_sublayers(sublayers))
    elif config.get("model_type") != "attnres":
        raise ConversionError(
            "The seed checkpoint's block size is unknown: its config has no `block_size` (in sublayers). "
            "Pass --seed-block-size N (sublayers per block, as in the seed pseudo-code)."
        )
    _infer_flags(keys, fields)
    fields["architectures"] = ["AttnResForCausalLM"]
    try:
        return AttnResConfig(**fields)
    except (ValueError, TypeError, StrictDataclassError) as err:
        raise ConversionError(f"The seed config does not make a valid AttnResConfig: {err}") from err
