"""`attnres-quantize` on tiny models built in code (no vLLM, no shipped model): what it writes for a
bfloat16 source, the card of `--reduce-range`, and an integer weight without its config."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from attnres.conversion import ConversionError, ConvertOptions, convert
from attnres.conversion.quantize import main, quantize_checkpoint
from tests.conversion.builders import save_source, source_model


@pytest.fixture(scope="module")
def bf16_attnres(tmp_path_factory):
    """A tiny converted AttnRes checkpoint in bfloat16 (a dtype other than the scales' float32)."""
    tmp = tmp_path_factory.mktemp("quantize")
    src = save_source(source_model("llama", eps=1e-6), tmp / "src", shards=False, tokenizer=True)
    convert(src, tmp / "attnres", ConvertOptions(verify=False, dtype="bfloat16"))
    return tmp / "attnres"


def read(folder):
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_a_bfloat16_source_gets_float32_per_row_scales_and_keeps_its_other_tensors(bf16_attnres, tmp_path):
    """vLLM's W8A8 scheme reads `weight_scale` as float32 `[out, 1]` whatever the model's dtype; everything that
    is not a projection keeps the source's dtype and values."""
    quantize_checkpoint(bf16_attnres, tmp_path / "w8a8")
    original, stored = read(bf16_attnres), read(tmp_path / "w8a8")
    key = "model.layers.0.mlp.gate_proj.weight"
    w, scale = stored[key], stored[key.replace(".weight", ".weight_scale")]
    assert w.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1)
    assert bool(((w.float() * scale - original[key].float()).abs() <= scale / 2 + 1e-7).all())
    norm = "model.layers.0.input_layernorm.weight"
    assert stored[norm].dtype == torch.bfloat16 and torch.equal(stored[norm], original[norm])


def test_the_card_of_a_reduced_range_checkpoint_names_its_range(bf16_attnres, tmp_path, capsys):
    """The card says what the weights are: [-63, 63] with `--reduce-range` (for CPUs without VNNI)."""
    assert main([str(bf16_attnres), str(tmp_path / "reduced"), "--reduce-range"]) == 0
    card = (tmp_path / "reduced" / "README.md").read_text()
    assert "int8 in [-63, 63] (`--reduce-range`" in card and "127" not in card
    assert int(read(tmp_path / "reduced")["model.layers.0.self_attn.q_proj.weight"].abs().max()) == 63


def test_integer_weights_without_a_quantization_config_are_refused(bf16_attnres, tmp_path):
    """A checkpoint whose projections are already integers (its quantization_config lost) is not quantized
    again as if the integers were weights: refused naming the tensor, nothing written."""
    import shutil

    src = shutil.copytree(bf16_attnres, tmp_path / "src")
    weights = load_file(src / "model.safetensors")
    key = "model.layers.1.self_attn.k_proj.weight"
    weights[key] = weights[key].to(torch.int8)
    save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConversionError, match=rf"{key.replace('.', '[.]')} is torch\.int8 .*expected a floating-point "
                                              r"\[out, in\] weight; is the checkpoint already quantized\?"):
        quantize_checkpoint(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_card_keeps_the_base_model_of_a_converted_source(tmp_path):
    """A quantization of a model converted from the Hub names the same base model, as a quantization, so the
    Hub lists it under that model; a source whose card names none gets no such line."""
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src", shards=False, tokenizer=True)
    convert(src, tmp_path / "attnres", ConvertOptions(verify=False))
    card = tmp_path / "attnres" / "README.md"
    quantize_checkpoint(tmp_path / "attnres", tmp_path / "plain")
    assert "base_model" not in (tmp_path / "plain" / "README.md").read_text()
    card.write_text(card.read_text().replace("tags:", "base_model: org/tiny-llama\ntags:", 1))
    quantize_checkpoint(tmp_path / "attnres", tmp_path / "w8a8")
    front = (tmp_path / "w8a8" / "README.md").read_text().split("\n---", 1)[0]
    assert "\nbase_model: org/tiny-llama\nbase_model_relation: quantized" in front, front
