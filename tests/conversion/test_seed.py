"""Seed-layout AttnRes checkpoints (pseudo-code names, block size in sublayers) -> ours, against the oracle."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from attnres.conversion import ConversionError, ConvertOptions, convert
from tests.conversion.builders import TINY, token_ids
from tests.oracle import naive_forward
from tests.support.models import oracle_state_dict, tiny_model

SEED_NAMES = {".self_attention_res_": ".attn_res_", "model.output_attn_res_": "model.final_attn_res_"}


def seed_state_dict(model, training_script: bool = True) -> dict[str, torch.Tensor]:
    """`model`'s weights with the seed names; as a from-scratch training script would save them
    (`training_script`): no `model.` prefix, a DDP `module.` wrapper, pseudo-queries as bare [d]."""
    out = {}
    for key, tensor in model.state_dict().items():
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        for ours, theirs in SEED_NAMES.items():
            key = key.replace(ours, theirs)
        if training_script and key.endswith("attn_res_proj.weight"):
            tensor = tensor[0]
        out["module." + key.removeprefix("model.") if training_script else key] = tensor.clone()
    return out


def seed_config(model, sublayers: int, model_type: str | None = None) -> dict:
    """A training script's config; one made from a `LlamaConfig.to_dict()` says `model_type: llama`."""
    fields = {k: getattr(model.config, k) for k in TINY} | {"rms_norm_eps": model.config.rms_norm_eps}
    fields |= {"model_type": model_type} if model_type else {}
    return fields | {"block_size": sublayers, "rope_parameters": model.config.rope_parameters}


@pytest.mark.parametrize("sublayers,mode,tied", [(4, "block", False), (6, "block", True), (1, "full", False)])
def test_seed_state_dict_matches_oracle(tmp_path, sublayers, mode, tied):
    overrides = dict(attn_res_mode=mode, tie_word_embeddings=tied)
    if mode == "block":
        overrides["attn_res_block_size"] = sublayers // 2
    model = tiny_model(seed=7, **overrides)
    path = tmp_path / "ckpt.pt"
    config = seed_config(model, sublayers, model_type="llama" if tied else None)
    torch.save({"model": seed_state_dict(model), "config": config, "step": 10}, path)
    result = convert(path, tmp_path / "dst", ConvertOptions(verify=False))
    assert (result.layout, result.config.attn_res_mode) == ("attnres", mode)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float64).eval()
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        got = converted(ids).logits
    # the oracle runs on the original (our-named) weights: the renaming is tested, not assumed
    want = naive_forward(oracle_state_dict(model), model.config, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert converted.config.tie_word_embeddings == tied


@pytest.mark.parametrize("saved_as", ["lightning", "model_state_dict", "ddp-over-compile"])
def test_training_frameworks_checkpoints_convert(tmp_path, saved_as):
    """Lightning's `state_dict` key, a `model_state_dict` key, DDP over torch.compile (`module._orig_mod.`);
    biases the config does not mention are read from the keys."""
    model = tiny_model(seed=13, attn_res_block_size=2, attention_bias=True, mlp_bias=True)
    state = seed_state_dict(model)
    if saved_as == "ddp-over-compile":
        state = {"module._orig_mod." + k.removeprefix("module."): v for k, v in state.items()}
    key = {"lightning": "state_dict", "model_state_dict": "model_state_dict"}.get(saved_as, "model")
    torch.save({key: state, "config": seed_config(model, 4), "epoch": 3}, tmp_path / "ckpt.pt")
    convert(tmp_path / "ckpt.pt", tmp_path / "dst", ConvertOptions(verify=False))
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float64).eval()
    assert converted.config.attention_bias and converted.config.mlp_bias
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, naive_forward(oracle_state_dict(model), model.config, ids),
                                   rtol=1e-5, atol=1e-5)


def test_a_tied_models_state_dict_converts_with_its_stored_head_and_a_differing_head_is_refused(tmp_path):
    """`torch.save(model.state_dict())` of a tied model stores `lm_head.weight` (the embedding again): it is
    dropped once checked equal, as the standard path does; a head that differs means the tie flag is wrong."""
    model = tiny_model(seed=9, tie_word_embeddings=True, attn_res_block_size=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in state                                   # what the user saves
    torch.save({"model": state, "config": model.config.to_dict()}, tmp_path / "ckpt.pt")
    convert(tmp_path / "ckpt.pt", tmp_path / "dst", ConvertOptions(verify=False))
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float64).eval()
    assert converted.config.tie_word_embeddings
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, naive_forward(oracle_state_dict(model), model.config, ids),
                                   rtol=1e-5, atol=1e-5)
    state["lm_head.weight"] = state["lm_head.weight"] + 1
    torch.save({"model": state, "config": model.config.to_dict()}, tmp_path / "differs.pt")
    with pytest.raises(ConversionError, match="stores an lm_head.weight that differs from model.embed_tokens.weight"):
        convert(tmp_path / "differs.pt", tmp_path / "dst2", ConvertOptions(verify=False))
    assert not (tmp_path / "dst2").exists()


def test_reconverting_a_converted_folder_keeps_its_cards_stream_scale_and_base_model(tmp_path, capsys):
    """A converted folder's weights carry the stream scale s of its conversion, which its card records (the
    fine-tuning notes depend on it): converting it again (to bfloat16, say) changes no value, and its card
    and summary still say s, with the base model, instead of s = 1."""
    from attnres.conversion.cli import main
    from tests.conversion.builders import save_source, source_model

    src = save_source(source_model("llama", eps=1e-6), tmp_path / "llama")
    assert main([str(src), str(tmp_path / "first"), "--stream-scale", "4", "--no-verify"]) == 0
    card = (tmp_path / "first" / "README.md").read_text()
    assert "- residual-stream scale s: 4" in card
    (tmp_path / "first" / "README.md").write_text(card.replace("tags:", "base_model: org/tiny-llama\ntags:", 1))
    capsys.readouterr()
    assert main([str(tmp_path / "first"), str(tmp_path / "again"), "--dtype", "bfloat16", "--no-verify"]) == 0
    assert "stream scale=unchanged (4, from the source's model card)" in capsys.readouterr().out
    again = (tmp_path / "again" / "README.md").read_text()
    assert "- residual-stream scale s: 4 (applied when the source was converted" in again, again
    assert "\nbase_model: org/tiny-llama\n" in again.split("\n---", 1)[0] + "\n", again
    from attnres.conversion.quantize import quantize_checkpoint

    quantize_checkpoint(tmp_path / "first", tmp_path / "w8a8")                   # its card carries s too
    from safetensors import safe_open

    with safe_open(tmp_path / "first" / "model.safetensors", "pt") as first, \
            safe_open(tmp_path / "w8a8" / "model.safetensors", "pt") as quantized:     # untied: its own head kept
        assert torch.equal(quantized.get_tensor("lm_head.weight"), first.get_tensor("lm_head.weight"))
    assert "- residual-stream scale s: 4 (applied when the source was converted" in (
        tmp_path / "w8a8" / "README.md").read_text()


def test_attnres_folder_with_seed_names_and_verify(tmp_path):
    """A transformers-style AttnRes folder (model_type attnres) that uses the seed names."""
    model = tiny_model(seed=8, attn_res_block_size=2)
    src = tmp_path / "src"
    src.mkdir()
    save_file(seed_state_dict(model, training_script=False), src / "model.safetensors")
    config = model.config.to_dict() | {"attn_res_block_size": 2}
    (src / "config.json").write_text(json.dumps(config))
    result = convert(src, tmp_path / "dst", ConvertOptions(dtype="float32"))
    assert result.config.attn_res_block_size == 2
    assert result.verification.max_abs_diff == 0 and result.verification.greedy_agree
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float64).eval()
    ids = token_ids(model.config.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, naive_forward(oracle_state_dict(model), model.config, ids),
                                   rtol=1e-5, atol=1e-5)


def test_odd_sublayer_block_size_is_refused(tmp_path):
    model = tiny_model(seed=9)
    path = tmp_path / "ckpt.pt"
    torch.save(seed_state_dict(model), path)
    (tmp_path / "config.json").write_text(json.dumps(seed_config(model, 3)))
    with pytest.raises(ConversionError, match=r"Seed block size 3 .* expected 1 \(Full AttnRes\) or an even"):
        convert(path, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_missing_block_size_and_unknown_keys_are_refused(tmp_path):
    model = tiny_model(seed=10)
    sd = seed_state_dict(model)
    config = seed_config(model, 4)
    del config["block_size"]
    torch.save({"model": sd, "config": config}, tmp_path / "a.pt")
    with pytest.raises(ConversionError, match="--seed-block-size"):
        convert(tmp_path / "a.pt", tmp_path / "dst")
    sd["module.layers.0.extra_gate.weight"] = torch.zeros(3)
    torch.save({"model": sd, "config": config}, tmp_path / "b.pt")
    with pytest.raises(ConversionError, match=r"1 source key\(s\) match no rule.*model\.layers\.0\.extra_gate\.weight"):
        convert(tmp_path / "b.pt", tmp_path / "dst", ConvertOptions(seed_block_size=4))
    assert not (tmp_path / "dst").exists()


def test_a_seed_block_size_that_overrides_the_checkpoints_own_is_said(tmp_path):
    """The flag wins over the config's block_size (a training script's may be its context length), with a word:
    verification reads the same schedule, so a wrong one would pass it. A block_size that is not a number
    is named, with the flag as the fix."""
    model = tiny_model(seed=12)
    torch.save({"model": seed_state_dict(model), "config": seed_config(model, 8)}, tmp_path / "a.pt")
    with pytest.warns(UserWarning, match=r"--seed-block-size 4 overrides the checkpoint's own block_size 8"):
        result = convert(tmp_path / "a.pt", tmp_path / "dst", ConvertOptions(seed_block_size=4))
    assert result.config.attn_res_block_size == 2
    torch.save({"model": seed_state_dict(model), "config": seed_config(model, "auto")}, tmp_path / "b.pt")
    with pytest.raises(ConversionError, match=r"block_size 'auto' is not a number of sublayers per block; pass "
                                              r"--seed-block-size N"):
        convert(tmp_path / "b.pt", tmp_path / "dst2")
    assert not (tmp_path / "dst2").exists()


def test_training_config_junk_is_dropped_and_inapplicable_options_refused(tmp_path):
    model = tiny_model(seed=11, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    config = seed_config(model, 4)
    del config["rope_parameters"]
    config |= {"rope_theta": 5e5, "lr": 3e-4, "batch_size": 8}        # legacy rope key, training knobs
    torch.save({"model": seed_state_dict(model), "config": config}, tmp_path / "ckpt.pt")
    with pytest.raises(ConversionError, match=r"--block-size, --stream-scale do\(es\) not apply here"):
        convert(tmp_path / "ckpt.pt", tmp_path / "dst", ConvertOptions(block_size=3, stream_scale=2.0))
    with pytest.raises(ConversionError, match=r"--mode do\(es\) not apply here"):
        convert(tmp_path / "ckpt.pt", tmp_path / "dst", ConvertOptions(mode="full"))
    with pytest.warns(UserWarning, match="ignored: batch_size, lr"):
        convert(tmp_path / "ckpt.pt", tmp_path / "dst", ConvertOptions(verify=False))
    saved = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert "lr" not in saved and saved["rope_parameters"]["rope_theta"] == 5e5


def test_a_files_own_config_comes_before_a_config_json_beside_it(tmp_path):
    """`{"model", "config"}` in a run folder whose config.json lacks the block size: the file's config is
    read (it converts, block size 4); `--config` still comes first."""
    model = tiny_model(seed=13)
    config = seed_config(model, 4)
    torch.save({"model": seed_state_dict(model), "config": config}, tmp_path / "ckpt.pt")
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "block_size"}))
    convert(tmp_path / "ckpt.pt", tmp_path / "dst", ConvertOptions(verify=False))
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["attn_res_block_size"] == 4 // 2
    with pytest.raises(ConversionError, match="block size is unknown"):
        convert(tmp_path / "ckpt.pt", tmp_path / "dst2", ConvertOptions(config_path=tmp_path / "config.json"))


def test_two_naming_variants_of_one_tensor_are_refused(tmp_path):
    model = tiny_model(seed=12)
    sd = seed_state_dict(model)
    sd["module.layers.1.self_attention_res_norm.weight"] = sd["module.layers.1.attn_res_norm.weight"].clone()
    torch.save({"model": sd, "config": seed_config(model, 4)}, tmp_path / "ckpt.pt")
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.self_attention_res_norm\.weight <- "
                                              r"model\.layers\.1\.(attn_res|self_attention_res)_norm\.weight and"):
        convert(tmp_path / "ckpt.pt", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()
