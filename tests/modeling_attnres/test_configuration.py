"""AttnResConfig: defaults, round trips and clear errors at construction and load."""

import importlib.util
import json
import logging
import sys

import pytest
from huggingface_hub.errors import (
    StrictDataclassClassValidationError,
    StrictDataclassError,
    StrictDataclassFieldValidationError,
)
from transformers import AutoConfig

from modeling_attnres import AttnResConfig, configuration_attnres
from tests.support.models import tiny_config


def test_defaults_and_derived_fields():
    config = AttnResConfig()
    assert config.model_type == "attnres"
    assert config.attn_res_mode == "block" and config.attn_res_block_size == 2 and config.qk_norm is False
    assert config.head_dim == config.hidden_size // config.num_attention_heads
    assert config.num_key_value_heads == config.num_attention_heads
    assert tiny_config(num_hidden_layers=5, attn_res_block_size=2).num_depth_sources == 4   # emb, 2 blocks, partial
    assert tiny_config(num_hidden_layers=5, attn_res_mode="full").num_depth_sources == 11


def test_save_load_round_trip(tmp_path):
    config = tiny_config(attn_res_mode="full", qk_norm=True, attention_bias=True, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, AttnResConfig)
    def drop(fields):
        return {k: v for k, v in fields.items() if k != "_name_or_path"}

    assert drop(loaded.to_dict()) == drop(config.to_dict())


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        (dict(attn_res_mode="blocks"), "attn_res_mode must be one of ('block', 'full'), got 'blocks'"),
        (dict(attn_res_block_size=0),
         "attn_res_block_size is the number of transformer layers per block and must be >= 1, got 0"),
        (dict(attn_res_block_size=-2), "got -2"),
        (dict(num_attention_heads=4, num_key_value_heads=3),
         "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer up to 4096, got 0; give the "),
        (dict(attn_res_mode="full", attn_res_block_size=0), "Full AttnRes does not use it: leave it at its default"),
        (dict(attention_dropout=1.0), "must be < 1, got 1.0; use 0.0 for none"),
        (dict(attention_dropout=-0.1), "attention_dropout must be a finite number >= 0, got -0.1; set it in "
                                       "config.json (0.0 for none"),
        (dict(max_position_embeddings=0), "got 0; set it to the longest sequence the model takes"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 0.0}), "got 0.0; use the source model's"),
        (dict(hidden_size=24, num_attention_heads=8, num_key_value_heads=8, head_dim=3),
         "head_dim must be even for rotary embeddings, got 3; the usual one is hidden_size // num_attention_heads"),
    ],
)
def test_invalid_values_raise_at_construction(overrides, fragment):
    with pytest.raises(StrictDataclassClassValidationError) as err:      # wraps our validate_* ValueError
        tiny_config(**overrides)
    assert fragment in str(err.value)


def test_wrong_type_raises_at_construction():
    with pytest.raises(StrictDataclassFieldValidationError) as err:
        tiny_config(attn_res_block_size="2")
    assert "attn_res_block_size" in str(err.value)


@pytest.mark.parametrize(
    "field, value, error, fragment",
    [
        ("attn_res_block_size", "two", StrictDataclassFieldValidationError, "attn_res_block_size"),   # a wrong type
        ("attn_res_mode", "sparse", StrictDataclassClassValidationError, "attn_res_mode must be one of"),
        ("attn_res_block_size", 0, StrictDataclassClassValidationError, "must be >= 1"),
        ("num_key_value_heads", 3, StrictDataclassClassValidationError, "multiple of num_key_value_heads (3)"),
    ],
)
def test_invalid_config_json_raises_at_load(tmp_path, field, value, error, fragment):
    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(error) as err:
        AutoConfig.from_pretrained(tmp_path)
    assert fragment in str(err.value)


def test_invalid_assignment_is_caught_on_save(tmp_path):
    config = tiny_config()
    with pytest.raises(StrictDataclassClassValidationError) as err:
        config.attn_res_mode = "diagonal"
        config.save_pretrained(tmp_path)
    assert "attn_res_mode" in str(err.value)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("mode, k, layers", [("block", 2, 5), ("block", 1, 3), ("block", 3, 8), ("full", 2, 4)])
def test_depth_sites_follow_the_spec_pseudo_code(mode, k, layers):
    """The schedule on the config against the spec's loop, written out here independently."""
    expected, stored = [], 0
    for layer in range(layers):
        for sublayer in range(2):
            closes = (mode == "full") or (sublayer == 0 and layer % k == 0)
            expected.append((stored, closes))
            stored += closes
    expected.append((stored, False))                                     # the output site
    sites = tiny_config(num_hidden_layers=layers, attn_res_mode=mode, attn_res_block_size=k).depth_sites
    assert [(site.num_stored, site.closes_block) for site in sites] == expected
    assert [site.index for site in sites] == list(range(2 * layers + 1))


@pytest.mark.parametrize("field, value", [
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-6), ("rms_norm_eps", float("inf")),
    ("initializer_range", float("nan")), ("attention_dropout", 1.5), ("max_position_embeddings", 0),
])
def test_non_finite_or_negative_numbers_are_refused_at_load(tmp_path, field, value):
    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data[field] = value
    path.write_text(json.dumps(data))
    # transformers' own field validators check some of them, our `validate_numbers` the rest.
    with pytest.raises((StrictDataclassClassValidationError, StrictDataclassFieldValidationError)) as err:
        AutoConfig.from_pretrained(tmp_path)
    assert field in str(err.value) and str(value) in str(err.value)


def test_rope_theta_must_be_positive_and_finite():
    with pytest.raises(StrictDataclassClassValidationError, match=r"rope_theta'\] must be a finite number > 0, got -1"):
        tiny_config(rope_parameters={"rope_type": "default", "rope_theta": -1.0})


def test_an_activation_transformers_does_not_know_is_refused_at_construction():
    """Not at the first forward, deep in the MLP (`ACT2FN[...]` raises a bare KeyError there)."""
    with pytest.raises(StrictDataclassClassValidationError, match=r"hidden_act 'swish2' is not an activation "
                                                                    r"transformers knows; .*Llama's is 'silu'"):
        tiny_config(hidden_act="swish2")
    assert tiny_config(hidden_act="gelu").hidden_act == "gelu"


def test_depth_sites_are_computed_once_per_shape():
    """Every layer reads the schedule at construction: it must not be rebuilt at each access."""
    config = tiny_config(num_hidden_layers=64)
    assert config.depth_sites is config.depth_sites
    assert tiny_config(num_hidden_layers=64).depth_sites is config.depth_sites


@pytest.mark.parametrize("foreign", [
    {"auto_map": {"AutoConfig": "configuration_attnres_lm.AttnResLMConfig",
                  "AutoModelForCausalLM": "modeling_attnres_lm.BlockAttnResLM"},
     "architectures": ["BlockAttnResLM"], "attn_res_block_size": 4},
    {"architectures": ["AttnResLM"], "n_layer": 12, "n_embd": 768, "block_size": 1024},
], ids=["other-remote-code", "other-fields"])
def test_a_foreign_attnres_checkpoint_is_refused_with_the_two_ways_forward(tmp_path, foreign):
    """A checkpoint from another AttnRes implementation that also says model_type "attnres"."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "attnres", **foreign}))
    with pytest.raises(ValueError) as err:
        AutoConfig.from_pretrained(tmp_path)
    message = str(err.value)
    assert "was written by other AttnRes code" in message
    assert "trust_remote_code=True" in message and "attnres-convert PATH OUT" in message
    assert str(foreign["architectures"]) in message


def test_our_own_saved_config_is_not_foreign(tmp_path):
    config = tiny_config()
    config.auto_map = {"AutoConfig": "configuration_attnres.AttnResConfig"}
    config.save_pretrained(tmp_path)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), AttnResConfig)


@pytest.mark.parametrize("fields, message", [
    (dict(attn_res_blocksize=4), r"AttnResConfig has no field 'attn_res_blocksize'; its depth-attention fields are "
                                 r"attn_res_mode, attn_res_block_size, attn_res_bank_dtype \(did you mean "
                                 r"'attn_res_block_size'\?\)"),
    (dict(num_attention_heads=0), r"AttnResConfig.num_attention_heads must be a positive integer, got 0")])
def test_a_misspelt_depth_field_and_zero_heads_are_refused_by_name(fields, message):
    """A misspelt field would be kept as an attribute nobody reads (the model silently taking the default),
    and zero heads would divide by zero while deriving head_dim."""
    with pytest.raises((ValueError, StrictDataclassError), match=message):
        AttnResConfig(**fields)


def test_a_misspelt_depth_field_set_after_construction_is_refused_before_it_is_saved(tmp_path):
    config = AttnResConfig()
    config.attn_res_stream_scale = 2
    with pytest.raises(StrictDataclassError, match=r"no field 'attn_res_stream_scale'; its depth-attention fields are "
                                         r"attn_res_mode, attn_res_block_size, attn_res_bank_dtype\.$"):
        config.save_pretrained(tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_a_config_json_that_is_not_an_object_is_named():
    with pytest.raises(ValueError, match="config.json holds a JSON list, not an object of config fields"):
        AttnResConfig.from_dict([])


def test_blocks_longer_than_the_model_are_named_in_a_warning(caplog):
    """A block size above the layer count (a context length or block count by mistake) leaves one block:
    valid, so a warning naming both numbers and the paper's recommendation, not an error."""
    configuration_attnres.warn_one_block.cache_clear()
    with caplog.at_level(logging.WARNING, logger=configuration_attnres.__name__):
        tiny_config(num_hidden_layers=4, attn_res_block_size=4)                   # one block, as meant: no word
        tiny_config(num_hidden_layers=4, attn_res_mode="full", attn_res_block_size=99)   # not read
        assert caplog.messages == []
        config = tiny_config(num_hidden_layers=4, attn_res_block_size=99)
    assert caplog.messages == [
        "AttnResConfig.attn_res_block_size 99 is more than num_hidden_layers 4: the model has one block, so every "
        "site mixes only the embedding and the running sum of the layers. If you meant several blocks, the paper "
        "recommends about 8: attn_res_block_size = ceil(num_hidden_layers / 8) = 1."]
    assert config.num_depth_sources == 2                                          # what the warning says


def test_an_older_transformers_is_named_before_a_missing_import(monkeypatch):
    """Hub remote code runs in the user's transformers: a 4.x release gets the requirement, not an ImportError
    on some 5.x-only name."""
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.1")   # what `import transformers` gives
    spec = importlib.util.spec_from_file_location("attnres_version_probe", configuration_attnres.__file__)
    with pytest.raises(ImportError, match=r"AttnRes models need transformers >= 5\.16\.1, found 4\.57\.1; upgrade "):
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("overrides, fragment", [
    (dict(num_attention_heads=4, num_key_value_heads=3), "choose num_key_value_heads among the divisors of 4."),
    (dict(attn_res_block_size=0), "attn_res_block_size = ceil(num_hidden_layers / 8) = 1 here"),   # 5 layers
    (dict(num_hidden_layers=4097), "num_hidden_layers must be a positive integer up to 4096, got 4097"),
])
def test_an_invalid_value_is_refused_with_its_fix(overrides, fragment):
    """The promise of docs/model.md: an invalid value fails with the field, the value and the fix (here the
    fix's numbers, computed from the config: a count rounded the wrong way would tell users to set 0)."""
    with pytest.raises(StrictDataclassClassValidationError) as err:
        tiny_config(**overrides)
    assert fragment in str(err.value)


def test_the_largest_allowed_sizes_are_accepted():
    """The bounds are inclusive: 4096 layers is the documented maximum, not one past it."""
    config = tiny_config(num_hidden_layers=4096, attn_res_block_size=512)
    assert config.num_hidden_layers == 4096 and len(config.depth_sites) == 2 * 4096 + 1


def test_the_defaults_are_the_documented_ones():
    """docs/model.md's table: a config written by hand, or a checkpoint's config.json that leaves a field out,
    takes these values, so changing one silently changes what such a model computes or how it trains."""
    config = AttnResConfig()
    assert (config.attn_res_mode, config.attn_res_block_size, config.attn_res_bank_dtype, config.qk_norm) == (
        "block", 2, "auto", False)
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob, config.decoder_sparse_step,
            config.mlp_only_layers, config.shared_expert_intermediate_size, config.router_aux_loss_coef,
            config.output_router_logits) == (0, 2, True, 1, [], 0, 0.001, False)
    assert config.moe_intermediate_size == config.intermediate_size


def test_a_config_saved_from_a_hub_copy_of_this_code_is_ours(tmp_path):
    """A model loaded from the Hub with trust_remote_code and saved again has an auto_map that names the repository
    (`user/repo--module.Class`): it is this package's code, not another implementation's."""
    tiny_config().save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    data["auto_map"] = {"AutoConfig": "someone/tiny-attnres--configuration_attnres.AttnResConfig",
                        "AutoModelForCausalLM": "someone/tiny-attnres--modeling_attnres.AttnResForCausalLM"}
    path.write_text(json.dumps(data))
    assert AttnResConfig.from_pretrained(tmp_path).attn_res_block_size == 2


def test_a_legacy_rope_scaling_config_loads_with_its_yarn_parameters(tmp_path):
    """A hand-written config.json in the older Llama style (`rope_theta` and a yarn `rope_scaling` at the top level,
    no depth-attention fields: the defaults) reads as this package's, its rope scaling kept."""
    fields = {"model_type": "attnres", "architectures": ["AttnResForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 4, "num_hidden_layers": 3,
              "max_position_embeddings": 128, "rope_theta": 10000.0,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    (tmp_path / "config.json").write_text(json.dumps(fields))
    config = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(config, AttnResConfig) and config.attn_res_block_size == 2
    rope = config.rope_parameters
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"], rope["rope_theta"]) == (
        "yarn", 4.0, 32, 10000.0)


@pytest.mark.parametrize("field, value, cause", [
    ("layer_types", 5, "TypeError: 'int' object is not iterable"),
    ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0}, "KeyError: "),      # yarn without its factor
])
def test_a_field_that_breaks_transformers_parsing_is_one_value_error(field, value, cause):
    """What transformers' own parsing raises on a malformed config.json (a TypeError, a KeyError) reaches the
    user as one ValueError naming the cause and the fix, so that `except ValueError` catches every bad config."""
    data = {**tiny_config().to_dict(), field: value}
    with pytest.raises(ValueError, match="config.json cannot be read as an AttnResConfig") as err:
        AttnResConfig.from_dict(data)
    assert cause in str(err.value) and "compare it with a config written by save_pretrained" in str(err.value)
