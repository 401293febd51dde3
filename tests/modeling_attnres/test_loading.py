"""Loading and building as transformers users do it: overrides, subfolders, odd folders, edited configs."""

import json
import re
import shutil

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from modeling_attnres import AttnResConfig, AttnResForCausalLM
from modeling_attnres.configuration_attnres import ForeignCheckpointError
from tests.support.models import TINY, tiny_config, tiny_model


@pytest.mark.parametrize("how", ["keyword", "config"])
def test_fewer_layers_than_the_checkpoint_load_its_first_layers(tmp_path, how):
    """As for Llama (cutting a model down, e.g. for a draft model): the first layers' weights, the rest unused."""
    model = tiny_model(seed=30)                                            # 5 layers
    model.save_pretrained(tmp_path)
    if how == "keyword":
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, num_hidden_layers=3)
    else:
        config = AutoConfig.from_pretrained(tmp_path)
        config.num_hidden_layers = 3
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path, config=config)
    assert len(loaded.model.layers) == 3
    original = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    expected = AttnResForCausalLM(tiny_config(num_hidden_layers=3)).eval()
    expected.load_state_dict({k: v for k, v in original.items() if k in expected.state_dict()})
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, expected(ids).logits, rtol=0, atol=0)


def test_a_checkpoint_in_a_subfolder_loads_and_is_checked_there(tmp_path):
    model = tiny_model(seed=31)
    model.save_pretrained(tmp_path / "weights")
    ids = torch.randint(3, 97, (1, 7))
    for cls in (AttnResForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path, subfolder="weights", attn_implementation="eager")
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    config = json.loads((tmp_path / "weights" / "config.json").read_text())
    config["intermediate_size"] = 48                                       # the weights have 64
    (tmp_path / "weights" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp.gate_proj.weight: checkpoint \(64, 32\), config implies \(48, 32\)"):
        AttnResForCausalLM.from_pretrained(tmp_path, subfolder="weights")


def test_weights_without_a_config_are_refused_and_an_empty_folder_is_not_called_foreign(tmp_path):
    tiny_model(seed=32).save_pretrained(tmp_path / "full")
    (tmp_path / "bare").mkdir()
    for name in ("model.safetensors", "generation_config.json"):   # transformers needs the latter with config=
        shutil.copy(tmp_path / "full" / name, tmp_path / "bare")
    with pytest.raises(ValueError, match="has weights but no config.json"):
        AttnResForCausalLM.from_pretrained(tmp_path / "bare")
    config = AttnResConfig.from_pretrained(tmp_path / "full")
    loaded = AttnResForCausalLM.from_pretrained(tmp_path / "bare", config=config)
    assert torch.equal(loaded.lm_head.weight, load_file(tmp_path / "bare" / "model.safetensors")["lm_head.weight"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(OSError, match="no file named model.safetensors"):         # transformers' own, as for Llama
        AttnResForCausalLM.from_pretrained(tmp_path / "empty")
    assert AttnResConfig.from_pretrained(tmp_path / "empty").to_dict() == AttnResConfig().to_dict()


def test_a_checkpoint_of_another_architecture_is_told_to_convert(tmp_path):
    LlamaForCausalLM(LlamaConfig(**{k: TINY[k] for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_hidden_layers", "num_attention_heads")})
                     ).save_pretrained(tmp_path)
    fix = r"not an AttnRes one\. Convert it: attnres-convert PATH OUT"
    llama = r"'llama' checkpoint \(architectures \['LlamaForCausalLM'\]\), "
    with pytest.raises(ForeignCheckpointError, match=llama + fix):
        AttnResForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(ForeignCheckpointError, match=fix):
        AttnResConfig.from_dict(LlamaConfig().to_dict())


def test_a_config_json_without_this_packages_fields_takes_the_defaults_unless_it_names_others(tmp_path):
    """A hand-written config of AttnResConfig's keys alone takes the defaults, as a Llama one does; one
    that also names fields or classes of its own is another implementation's."""
    sizes = {"model_type": "attnres", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
             "num_hidden_layers": 3, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps({**sizes, "architectures": ["AttnResForCausalLM"]}))
    config = AutoConfig.from_pretrained(tmp_path)
    assert (config.hidden_size, config.num_hidden_layers, config.attn_res_mode, config.attn_res_block_size) == (
        64, 3, "block", 2)
    for extra in ({"n_blocks": 4}, {"architectures": ["BlockAttnResLM"]}):
        (tmp_path / "config.json").write_text(json.dumps({**sizes, **extra}))
        with pytest.raises(ForeignCheckpointError, match="written by other AttnRes code") as err:
            AttnResConfig.from_pretrained(tmp_path)
        assert "add them" in str(err.value)
    assert "fields it has that AttnResConfig has not: n_blocks" in str(
        pytest.raises(ForeignCheckpointError, AttnResConfig.from_dict, {**sizes, "n_blocks": 4}).value)


@pytest.mark.parametrize("field, value, fragment", [
    ("attn_res_block_size", 0, "must be >= 1, got 0"),
    ("attn_res_mode", "nope", "must be one of ('block', 'full'), got 'nope'"),
    ("attn_res_bank_dtype", "int8", "must be one of ('auto', 'float32'), got 'int8'"),
])
def test_a_config_edited_after_construction_is_checked_when_a_model_is_built(field, value, fragment):
    """Assignments are type-checked only; building a model checks the values, as construction does."""
    config = tiny_config()
    setattr(config, field, value)
    with pytest.raises(StrictDataclassClassValidationError) as err:
        AttnResForCausalLM(config)
    assert fragment in str(err.value)


def test_weights_renamed_to_fewer_layers_still_match_the_first_layers(tmp_path):
    """A checkpoint trimmed by hand to 2 layers with a 2-layer config.json loads: the check compares the
    folder's own config.json with its weights."""
    tiny_model(seed=33).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if not k.startswith(tuple(f"model.layers.{i}." for i in (2, 3, 4)))},
              tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(ValueError, match="has 2 layers but its config.json says num_hidden_layers=5"):
        AutoModelForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    assert len(AutoModelForCausalLM.from_pretrained(tmp_path).model.layers) == 2


def test_a_truncated_weights_file_is_named_with_the_fix(tmp_path):
    tiny_model(seed=2).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    message = rf"Cannot read the safetensors file {re.escape(str(weights))} \(.*\): it is truncated or corrupt; "
    with pytest.raises(ValueError, match=message + r"download or copy it again\."):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_from_pretrained_keeps_transformers_options_of_its_own(tmp_path):
    """The override hands on what transformers users pass: `output_loading_info=True` returns `(model, info)`,
    and a `key_mapping` of their own renames checkpoint keys alongside the seed aliases."""
    model = tiny_model(seed=34)
    model.save_pretrained(tmp_path)
    loaded, info = AttnResForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert isinstance(loaded, AttnResForCausalLM) and not info["missing_keys"] and not info["unexpected_keys"]
    weights = load_file(tmp_path / "model.safetensors")
    weights["output.weight"] = weights.pop("lm_head.weight")                      # another tool's name
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    renamed = AttnResForCausalLM.from_pretrained(tmp_path, key_mapping={r"^output\.": "lm_head."})
    assert torch.equal(renamed.lm_head.weight, model.lm_head.weight)
