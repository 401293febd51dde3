"""Bad inputs: a clear error naming the value and the fix, and nothing left at DST or beside it."""

import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

import attnres.conversion.converter as converter_module
import modeling_attnres  # noqa: F401  (registers the Auto classes)
from attnres.conversion import ConversionError, ConvertOptions, commands, convert
from attnres.conversion.cli import main
from attnres.conversion.errors import listing
from tests.conversion.builders import edit_config, rel_diff, save_source, source_model, token_ids


@pytest.fixture
def llama_src(tmp_path):
    return save_source(source_model("llama", eps=1e-6), tmp_path / "src")


def assert_nothing_written(tmp_path, dst_name="dst"):
    assert not (tmp_path / dst_name).exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging folder


def refuse(tmp_path, src, pattern, **options):
    with pytest.raises(ConversionError, match=pattern):
        convert(src, tmp_path / "dst", ConvertOptions(verify=False, **options))
    assert_nothing_written(tmp_path)


def test_unsupported_architecture_is_named_with_the_supported_list(tmp_path, capsys):
    config = GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50, n_positions=16)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    assert main([str(tmp_path / "gpt2"), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "Unsupported architecture GPT2LMHeadModel" in err
    assert "LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM" in err
    assert_nothing_written(tmp_path)


QWEN2_SLIDING = {"use_sliding_window": True, "max_window_layers": 2}     # layers 2 and 3 slide (layer_types)


@pytest.mark.parametrize("name, window", [("mistral", {}), ("qwen3_moe", {"use_sliding_window": True}),
                                          ("mixtral", {"layer_types": ["full_attention"] * 4}),   # never read
                                          ("qwen2_tied", QWEN2_SLIDING),
                                          ("qwen2_moe", {"use_sliding_window": True, "max_window_layers": 4})])
def test_a_window_needs_the_clip_flag_and_converts_within_it(tmp_path, name, window):
    """Mistral's and Mixtral's window, and Qwen3-MoE's with use_sliding_window, slide on every layer
    (Mixtral's and Qwen3-MoE's modeling code reads no layer_types, even where a config has them); Qwen2's and
    Qwen2-MoE's on some layers (layer_types: 2 and 3; 0 and 2). Clipped to the window, the converted model
    computes what the source does up to the window, where the two are equal."""
    source = source_model(name, sliding_window=16, **window)
    if "max_window_layers" in window:
        assert "sliding_attention" in source.config.layer_types and "full_attention" in source.config.layer_types
    src = save_source(source, tmp_path / "src", tokenizer=True)
    refuse(tmp_path, src, r"sliding_window=16 is smaller than max_position_embeddings=128.*--clip-to-sliding-window")
    result = convert(src, tmp_path / "dst", ConvertOptions(clip_to_window=True))
    assert result.config.max_position_embeddings == 16 and result.verification.passed
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    with torch.no_grad():
        ids = token_ids(length=16)
        assert rel_diff(converted(ids).logits, source(ids).logits) < 1e-5
        longer = token_ids(length=40)                                  # past the window the source slides
        assert rel_diff(converted(longer).logits, source(longer).logits) > 1e-3


def test_a_window_as_long_as_the_positions_is_full_attention_and_converts_without_the_flag(tmp_path):
    source = source_model("qwen2_tied", sliding_window=128, **QWEN2_SLIDING)
    result = convert(save_source(source, tmp_path / "src", tokenizer=True), tmp_path / "dst", ConvertOptions())
    assert result.config.max_position_embeddings == 128 and result.verification.passed


def test_an_attention_kind_other_than_full_or_sliding_is_refused(tmp_path):
    src = save_source(source_model("qwen2_tied", **QWEN2_SLIDING), tmp_path / "src")
    edit_config(src, layer_types=["full_attention", "chunked_attention", "sliding_attention", "sliding_attention"])
    refuse(tmp_path, src, r"Layers \[1\] use 'chunked_attention' attention, expected full or sliding-window")


def test_clipping_keeps_the_rope_factor_longrope_derives_from_the_positions(tmp_path):
    """longrope (and yarn) without a factor take max_position_embeddings / original_max_position_embeddings:
    cutting max_position_embeddings to the window must not change it (every attention score would)."""
    rope = {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 32,
            "long_factor": [1.0, 2.0, 3.0, 4.0], "short_factor": [1.0, 1.1, 1.2, 1.5]}
    source = source_model("mistral", sliding_window=64, rope_parameters=rope).eval()
    src = save_source(source, tmp_path / "src", tokenizer=True)
    result = convert(src, tmp_path / "dst", ConvertOptions(clip_to_window=True))
    assert result.verification.passed and result.config.rope_parameters["factor"] == 128 / 32
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    with torch.no_grad():
        ids = token_ids(length=40)                      # past the original 32 positions, inside the window
        assert rel_diff(converted(ids).logits, source(ids).logits) < 1e-5


def test_clipping_keeps_an_explicit_yarn_factor(tmp_path):
    """A yarn factor given in the config is the model's own: clipping the positions must not derive another."""
    rope = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 32}
    source = source_model("mistral", sliding_window=64, rope_parameters=rope).eval()
    src = save_source(source, tmp_path / "src", tokenizer=True)
    result = convert(src, tmp_path / "dst", ConvertOptions(clip_to_window=True))
    assert result.verification.passed and result.config.rope_parameters["factor"] == 2.0
    assert result.config.max_position_embeddings == 64


@pytest.mark.parametrize("rope,pattern", [
    ({"rope_type": "mrope", "rope_theta": 1e4, "mrope_section": [2, 2, 4]}, "rope_type 'mrope' is not supported"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
])
def test_rope_that_attnres_cannot_carry(tmp_path, llama_src, rope, pattern):
    edit_config(llama_src, rope_parameters=rope)
    refuse(tmp_path, llama_src, pattern)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_truncated_or_corrupt_safetensors(tmp_path, llama_src, damage):
    shard = sorted(llama_src.glob("*.safetensors"))[1]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"not a safetensors file" * 4)
    refuse(tmp_path, llama_src, rf"Cannot read safetensors file .*{shard.name}.*truncated or corrupt")


@pytest.mark.parametrize("value, dtype, pattern", [
    (float("nan"), None, r"The source holds NaN or infinite values in model\.layers\.0\.mlp\.up_proj\.weight; the "
                         r"checkpoint is damaged"),
    (1e6, "float16", r"model\.layers\.0\.mlp\.up_proj\.weight overflow float16 \(values past its range once "
                     r"converted\); convert with --dtype bfloat16 or float32")])
def test_non_finite_weights_are_named_before_anything_is_written(tmp_path, llama_src, value, dtype, pattern):
    """A damaged source (NaN) or a weight past the output dtype's range: the tensor is named, instead of NaN
    calibration scores and a verification failure that blames the converter."""
    key = "model.layers.0.mlp.up_proj.weight"
    shard = next(p for p in llama_src.glob("*.safetensors") if key in load_file(p))
    weights = load_file(shard)
    weights[key][0, 0] = value
    save_file(weights, str(shard), metadata={"format": "pt"})
    refuse(tmp_path, llama_src, pattern, **({"dtype": dtype} if dtype else {}))


def test_an_index_that_leaves_out_a_stored_tensor_is_named(tmp_path, llama_src):
    index = llama_src / "model.safetensors.index.json"
    saved = json.loads(index.read_text())
    del saved["weight_map"]["model.layers.0.mlp.up_proj.weight"]
    index.write_text(json.dumps(saved))
    refuse(tmp_path, llama_src, r"index\.json does not match the shards: model\.layers\.0\.mlp\.up_proj\.weight\. "
                                r"The shards and the index come from different saves")


def test_missing_shard_is_named(tmp_path, llama_src):
    shard = sorted(llama_src.glob("*.safetensors"))[0]
    shard.unlink()
    refuse(tmp_path, llama_src, rf"names shard\(s\) that are not in .*{shard.name}")


def test_shape_mismatch_lists_tensors(tmp_path, llama_src):
    edit_config(llama_src, intermediate_size=48)
    refuse(tmp_path, llama_src, r"Shape mismatch for 12 tensor\(s\): model\.layers\.0\.mlp\.down_proj\.weight: "
                                r"\(32, 64\) \(expected \(32, 48\)")


def test_leftover_and_unfilled_keys_are_listed(tmp_path):
    src = save_source(source_model("llama"), tmp_path / "src", shards=False)
    weights = load_file(src / "model.safetensors")
    save_file({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)}, src / "model.safetensors")
    refuse(tmp_path, src, r"1 source key\(s\) match no rule of the key map: model\.layers\.0\.mlp\.extra\.weight")
    del weights["model.layers.3.self_attn.k_proj.weight"], weights["model.norm.weight"]
    save_file(weights, src / "model.safetensors")
    refuse(tmp_path, src, r"2 AttnRes parameter\(s\) have no source.*model\.layers\.3\.self_attn\.k_proj\.weight, "
                          r"model\.norm\.weight")


def test_a_bias_the_config_turns_off_is_named_not_a_traceback(tmp_path):
    src = save_source(source_model("llama", attention_bias=True), tmp_path / "src", shards=False)
    edit_config(src, attention_bias=False)
    refuse(tmp_path, src, r"Source key\(s\) map to target keys the AttnRes model does not have: .*"
                          r"model\.layers\.0\.self_attn\.k_proj\.bias")


def test_stored_tied_head_must_equal_the_embedding(tmp_path):
    src = save_source(source_model("qwen2_tied"), tmp_path / "src", shards=False)
    weights = load_file(src / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embed.clone()}, src / "model.safetensors")
    convert(src, tmp_path / "ok", ConvertOptions(verify=False))        # an export that stores the tied head
    # A key that only starts like a mapped one (a quantizer's scale beside the head) matches no rule: listed.
    save_file({**weights, "lm_head.weight": embed.clone(), "lm_head.weight_scale": torch.ones(1)},
              src / "model.safetensors")
    refuse(tmp_path, src, r"1 source key\(s\) match no rule of the key map: lm_head\.weight_scale")
    save_file({**weights, "lm_head.weight": embed + 1}, src / "model.safetensors")
    refuse(tmp_path, src, "tie_word_embeddings is true but the checkpoint stores an lm_head.weight that differs")


def test_existing_destination_needs_overwrite_and_overwrite_replaces_only_a_checkpoint(tmp_path, llama_src, capsys):
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    assert main([str(llama_src), str(dst), "--no-verify"]) == 1
    assert "exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert main([str(llama_src), str(dst), "--no-verify", "--overwrite"]) == 1
    assert ("holds files that are not a checkpoint (no config.json beside weights; keep.txt), and --overwrite "
            "replaces only a checkpoint folder") in capsys.readouterr().err
    (dst / "config.json").write_text("{}")                          # an application's config, no weights
    assert main([str(llama_src), str(dst), "--no-verify", "--overwrite"]) == 1
    assert "holds files that are not a checkpoint" in capsys.readouterr().err
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "keep.txt"]
    (dst / "keep.txt").unlink()
    (dst / "config.json").unlink()
    assert main([str(llama_src), str(dst), "--no-verify"]) == 0           # an empty folder needs no --overwrite
    (dst / "stale.txt").write_text("from an earlier run")
    assert main([str(llama_src), str(dst), "--no-verify", "--overwrite"]) == 0
    assert not (dst / "stale.txt").exists() and (dst / "config.json").exists()
    for weights in dst.glob("*.safetensors*"):                            # a PyTorch-pickle checkpoint
        weights.unlink()
    (dst / "pytorch_model.bin").write_bytes(b"")
    assert main([str(llama_src), str(dst), "--no-verify", "--overwrite"]) == 0
    assert not (dst / "pytorch_model.bin").exists() and (dst / "config.json").exists()


@pytest.mark.parametrize("empty", ["src", "dst"])
def test_an_empty_path_is_refused_not_read_as_the_current_folder(tmp_path, llama_src, capsys, monkeypatch, empty):
    """`attnres-convert SRC "$OUT" --overwrite` with OUT unset: "" would be the current folder, replaced."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")                        # a folder --overwrite would replace
    (tmp_path / "precious.txt").write_text("mine")
    argv = {"src": ["", "out"], "dst": [str(llama_src), ""]}[empty]
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--no-verify", "--overwrite"])
    assert exited.value.code == 2
    assert f"argument {empty}: is empty ('')" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(ConversionError, match=f"{empty.upper()} is empty"):
        convert(*argv, ConvertOptions(verify=False, overwrite=True))
    assert (tmp_path / "precious.txt").read_text() == "mine"


@pytest.mark.parametrize("dst", [".", ".."])
def test_the_current_folder_or_one_above_it_is_refused_as_dst(tmp_path, llama_src, capsys, monkeypatch, dst):
    """DST is replaced whole by a rename: the current folder (even empty) would be pulled out from under the
    shell that ran the command."""
    here = tmp_path / "out" / "here"
    here.mkdir(parents=True)
    monkeypatch.chdir(here)
    assert main([str(llama_src), dst, "--no-verify"]) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"DST {(here / dst).resolve()} is the current folder" in line and "Choose a new folder" in line
    assert here.is_dir() and not any(here.iterdir())


def test_a_mount_point_as_dst_is_refused_before_any_work(tmp_path, llama_src, capsys, monkeypatch):
    """A mount point (a container's volume, say) cannot be renamed over: refused up front, with a folder inside
    it to use instead, not after the conversion with the rename's 'Device or resource busy'. (Mounting needs
    root: the check's view of the file system is patched.)"""
    volume = tmp_path / "volume"
    volume.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == volume or real(path))
    monkeypatch.setattr(converter_module, "plan_conversion", None)       # any work would fail with a TypeError
    assert main([str(llama_src), str(volume), "--no-verify"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"attnres-convert: error: DST {volume} is a mount point, which cannot be replaced whole (the output is "
        f"written beside DST and renamed into place); choose a folder inside it, e.g. {volume / 'model'}.")


@pytest.mark.parametrize("change, message", [
    ({"rms_norm_eps": 0}, "config.json is not a valid llama config: Validation error for field 'rms_norm_eps': "
                          "TypeError: Field 'rms_norm_eps' expected float, got int (value: 0). Fix that value"),
    ({"num_attention_heads": 3}, "The hidden size (32) is not a multiple of the number of attention heads (3). Fix"),
    ({"model_type": "gpt2"}, "The source config says architectures=['LlamaForCausalLM'] but model_type='gpt2' (a "
                             "LlamaForCausalLM checkpoint has model_type 'llama')"),
])
def test_config_values_transformers_refuses_are_one_line(tmp_path, llama_src, capsys, change, message):
    edit_config(llama_src, **change)
    assert main([str(llama_src), str(tmp_path / "dst"), "--no-verify"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
    assert_nothing_written(tmp_path)


def test_an_index_whose_weight_map_is_not_an_object_is_named(tmp_path, llama_src):
    index = llama_src / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": ["model-00001.safetensors"]}))
    refuse(tmp_path, llama_src, r"index\.json is not a valid checkpoint index \(its weight_map is a list, expected "
                                r"an object of tensor name -> shard file name\)")
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    refuse(tmp_path, llama_src, r"index\.json is not a valid checkpoint index \(its weight_map gives "
                                r"'model\.norm\.weight' the shard 3, expected a file name\)")


def test_interrupted_conversion_leaves_nothing(tmp_path, llama_src, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(converter_module, "write_model_card", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(llama_src, tmp_path / "dst", ConvertOptions(verify=False))
    assert_nothing_written(tmp_path)


def test_bad_dtype_and_scale_and_missing_source(tmp_path, llama_src):
    refuse(tmp_path, llama_src, "--stream-scale must be a positive finite number, got -2", stream_scale=-2.0)
    refuse(tmp_path, llama_src, "--dtype 'int8' is not supported; expected auto, float32", dtype="int8")
    refuse(tmp_path, llama_src, r"--block-size must be at least 1 \(layers per block\), got 0", block_size=0)
    refuse(tmp_path, tmp_path / "nowhere" / "x", "is not an existing path and not a Hub repo id")
    (tmp_path / "notes.txt").write_text("x")
    refuse(tmp_path, tmp_path / "notes.txt", "is not a state dict")
    assert json.loads((llama_src / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize("argv, message", [
    (["--stream-scale", "inf"], "--stream-scale must be a positive finite number, got inf"),
    (["--stream-scale", "nan"], "--stream-scale must be a positive finite number, got nan"),
    (["--block-size", "-2"], "--block-size must be at least 1 (layers per block), got -2"),
    (["--mode", "full", "--block-size", "2"], "--block-size does not apply with --mode full"),
    (["--max-shard-size", "abc"], "--max-shard-size 'abc' is not a size: expected a positive number with a unit"),
    (["--max-shard-size", "0GB"], "--max-shard-size '0GB' is not a size"),
    (["--keep-failed", "--no-verify"], "--keep-failed does nothing with --no-verify"),
    (["--revision", "main"], "--revision applies to a Hub repo id, but SRC"),
    (["--private"], "--private applies to the Hub repo that --push-to-hub creates"),
    (["--stream-scale", "3"], "--stream-scale must be a power of two, got 3: other scales round every scaled "
                              "weight, and verification would fail; use 4."),
    (["--stream-scale", "131072"], "--stream-scale 131072 is far past any useful scale (the calibration tries 1 "
                                   "up to the number of depth sources"),
    (["--stream-scale", "1e301"], "use a power of two from 1/65536 to 65536."),
    (["--seed-block-size", "0"], "--seed-block-size must be 1 (Full AttnRes) or an even number of sublayers"),
    (["--seed-block-size", "3"], "(2 per layer: AttnRes blocks hold whole layers), got 3."),
    (["--push-to-hub", "not a repo"], "--push-to-hub 'not a repo' is not a Hub repo id"),
    (["--config", "nope.json"], "--config nope.json is not a file; pass the config.json of the state dict"),
])
def test_wrong_options_exit_2_before_any_work(tmp_path, llama_src, capsys, monkeypatch, argv, message):
    """A wrong option is a usage error (exit 2, one message naming it), found before SRC is even read."""
    def read(*args):
        raise AssertionError("SRC was read before the options were checked")
    monkeypatch.setattr(converter_module, "resolve_source", read)
    try:
        status = main([str(llama_src), str(tmp_path / "dst"), *argv])
    except SystemExit as exit:                                     # argparse's own errors
        status = exit.code
    assert status == 2 and message in capsys.readouterr().err
    assert_nothing_written(tmp_path)


def test_a_destination_filled_during_the_run_is_kept(tmp_path, llama_src, monkeypatch):
    """DST is checked empty at the start; if another writer fills it meanwhile, this run publishes nothing
    over it (the check and the rename are one step), unless --overwrite."""
    dst, card = tmp_path / "dst", converter_module.write_model_card

    def another_writer(folder, result):
        dst.mkdir(exist_ok=True)
        (dst / "theirs.txt").write_text("theirs")
        card(folder, result)
    monkeypatch.setattr(converter_module, "write_model_card", another_writer)
    with pytest.raises(ConversionError, match="was filled while this run was writing"):
        convert(llama_src, dst, ConvertOptions(verify=False))
    assert [p.name for p in tmp_path.iterdir() if p.name != "src"] == ["dst"]         # no staging left
    assert [p.name for p in dst.iterdir()] == ["theirs.txt"]
    monkeypatch.undo()                                           # no other writer from here on
    dst.joinpath("theirs.txt").unlink()                          # an empty folder is taken, as at the start
    convert(llama_src, dst, ConvertOptions(verify=False))
    assert (dst / "config.json").exists() and not (dst / "theirs.txt").exists()
    convert(llama_src, dst, ConvertOptions(verify=False, overwrite=True))
    assert (dst / "config.json").exists() and not (dst / "theirs.txt").exists()


def test_a_transformers_models_state_dict_file_points_to_its_folder(tmp_path):
    src = tmp_path / "src"
    model = source_model("llama")
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    refuse(tmp_path, src / "pytorch_model.bin", r"holds no depth-attention parameters \(\*_res_proj / \*_res_norm\): "
           f"it is not an AttnRes checkpoint, .* Convert its folder, {src}, instead")
    convert(src, tmp_path / "dst", ConvertOptions(verify=False))                   # as its folder, it converts


def test_a_quantized_checkpoint_is_named_as_such(tmp_path, llama_src):
    edit_config(llama_src, quantization_config={"quant_method": "compressed-tensors"})
    refuse(tmp_path, llama_src, r"is a quantized checkpoint \(quantization_config: compressed-tensors\); the "
           "converter reads unquantized weights")


def test_interrupting_the_command_prints_one_line(tmp_path, llama_src, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(converter_module, "write_model_card", interrupted)
    assert main([str(llama_src), str(tmp_path / "dst"), "--no-verify"]) == 130
    last = capsys.readouterr().err.strip().splitlines()[-1]                   # after the progress bars
    assert last == f"attnres-convert: error: interrupted; nothing half-written is left at {tmp_path / 'dst'}."
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("command", ["convert", "quantize", "retrofit"])
def test_an_interrupt_past_the_commands_own_handler_prints_one_line(command, capsys, monkeypatch):
    """Ctrl-C in the instant after a command published its output (outside the handler around its work, e.g.
    while printing its summary) ends in exit 130 and one line, not a traceback."""
    module = {"convert": "cli"}.get(command, command)
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(importlib.import_module(f"attnres.conversion.{module}"), "main", interrupted)
    assert getattr(commands, command)() == 130
    assert capsys.readouterr().err.splitlines() == [
        f"attnres-{command}: error: interrupted; every output is published whole or not at all (staged, then renamed)."]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["attnres-convert", "attnres-quantize", "attnres-retrofit"])
def test_ctrl_c_while_the_command_loads_torch_prints_one_line(tmp_path, command):
    """SIGINT during the first seconds of a console script (importing torch and transformers): exit 130
    with the one line every later interrupt gives, not a traceback."""
    script = Path(sys.executable).parent / command
    assert "attnres.conversion.commands" in script.read_text()         # what pyproject's [project.scripts] made
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-X", "importtime", str(script), "--help"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # even if we ignore it
    try:
        for line in proc.stderr:                           # -X importtime: one line per finished import
            if line.split("|")[-1].strip().startswith("torch"):
                proc.send_signal(signal.SIGINT)            # torch's first module: seconds before --help could print
                break
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 130, err[-2000:]
    finally:
        proc.kill()
    lines = [line for line in err.splitlines() if not line.startswith("import time:")]
    assert lines == [f"{command}: error: interrupted while starting; nothing was read or written."], err[-2000:]
    assert proc.stdout.read() == ""                        # no --help: the command never started


def test_side_files_are_copied_only_from_inside_the_checkpoint(tmp_path, llama_src):
    """A side file that links outside SRC is refused (its target would be published and pushed); a link
    inside SRC, or into the Hub cache's own blobs, is copied by content."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    (llama_src / "notes.txt").symlink_to(secret)
    refuse(tmp_path, llama_src, r"notes\.txt is a symlink to .*secret\.txt, outside the checkpoint folder")
    (llama_src / "notes.txt").unlink()
    (llama_src / "tokenizer.json").symlink_to(llama_src / "gone.json")       # a download that never finished
    with pytest.MonkeyPatch.context() as patch:                              # refused before the model is written
        patch.setattr(converter_module, "write_model", None)
        refuse(tmp_path, llama_src, r"tokenizer\.json is a broken symlink \(to .*gone\.json, which does not exist\)")
    (llama_src / "tokenizer.json").unlink()
    (llama_src / "inside.txt").write_text("kept")
    (llama_src / "alias.txt").symlink_to(llama_src / "inside.txt")
    convert(llama_src, tmp_path / "dst", ConvertOptions(verify=False))
    assert (tmp_path / "dst" / "alias.txt").read_text() == "kept" and not (tmp_path / "dst" / "alias.txt").is_symlink()
    repo = tmp_path / "hub" / "models--me--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    snapshot = repo / "snapshots" / "abc"
    shutil.copytree(llama_src, snapshot)
    (repo / "blobs" / "1234").write_text("from the blob")
    (snapshot / "inside.txt").unlink()
    (snapshot / "inside.txt").symlink_to(Path("../../blobs/1234"))
    convert(snapshot, tmp_path / "dst2", ConvertOptions(verify=False))
    assert (tmp_path / "dst2" / "inside.txt").read_text() == "from the blob"


def test_options_that_do_not_apply_are_named_as_typed(tmp_path, llama_src, capsys):
    (tmp_path / "c.json").write_text("{}")
    assert main([str(llama_src), str(tmp_path / "dst"), "--config", str(tmp_path / "c.json")]) == 2
    assert "--config do(es) not apply here" in capsys.readouterr().err
    assert main([str(llama_src), str(tmp_path / "a"), "--no-verify"]) == 0
    capsys.readouterr()
    assert main([str(tmp_path / "a"), str(tmp_path / "b"), "--clip-to-sliding-window"]) == 2
    assert "--clip-to-sliding-window do(es) not apply here" in capsys.readouterr().err
    assert main([str(llama_src), str(tmp_path / "c"), "--clip-to-sliding-window"]) == 2      # no window to clip
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "attnres-convert: error: --clip-to-sliding-window does not apply: this llama model has no sliding window "
        "shorter than its max_position_embeddings (128; sliding_window=None), so it converts exactly as it is; drop "
        "the option.")
    assert not (tmp_path / "c").exists()


def test_a_destination_inside_a_file_is_refused_in_one_line(tmp_path, llama_src, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert main([str(llama_src), str(tmp_path / "notes.txt" / "dst"), "--no-verify"]) == 1
    assert capsys.readouterr().err.strip().endswith("is inside a file, not a folder; choose a folder path.")
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_full_disk_or_a_read_only_destination_is_one_line_naming_dst(tmp_path, llama_src, capsys, monkeypatch):
    """The output cannot be written: one line naming DST, the cause and the fix (not safetensors' wording, a
    traceback, or the path of a staging file), and nothing left behind."""
    from safetensors import SafetensorError

    import attnres.conversion.publish as publish

    def full_disk(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(converter_module, "write_model", full_disk)
    assert main([str(llama_src), str(tmp_path / "dst"), "--no-verify"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"attnres-convert: error: Cannot write DST {tmp_path / 'dst'}: no space is left on its device; free some "
        "space, or choose another location. DST is as it was.")
    assert_nothing_written(tmp_path)
    monkeypatch.undo()
    real_open = os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".locking"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(publish.os, "open", read_only)
    assert main([str(llama_src), str(tmp_path / "dst"), "--no-verify"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"attnres-convert: error: Cannot write DST {tmp_path / 'dst'}: its file system is read-only; choose a "
        "writable location. DST is as it was.")
    assert_nothing_written(tmp_path)
    monkeypatch.undo()

    def unreadable_source(src, dst):                        # reading SRC fails: not blamed on DST
        raise PermissionError(errno.EACCES, "Permission denied", str(src / "tokenizer.json"))

    monkeypatch.setattr(converter_module, "copy_side_files", unreadable_source)
    assert main([str(llama_src), str(tmp_path / "dst"), "--no-verify"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"attnres-convert: error: [Errno 13] Permission denied: '{llama_src / 'tokenizer.json'}'")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("content", ["garbage", "pickle"])
def test_an_unloadable_state_dict_file_is_one_line_without_torchs_advice(tmp_path, capsys, content):
    """torch's own error spans lines and advises weights_only=False (which would run the file's code)."""
    path = tmp_path / "model.pt"
    if content == "garbage":
        path.write_bytes(b"\x80\x02garbage that is no pickle")
    else:
        torch.save({"weights": torch.zeros(2), "optimizer": GPT2Config()}, path)      # an object, not a tensor
    assert main([str(path), str(tmp_path / "dst"), "--no-verify"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attnres-convert: error: Cannot load {path} as a PyTorch state "
                                                   "dict ("), lines
    assert "save model.state_dict()" in lines[0] and "weights_only=False" not in lines[0]
    assert "add_safe_globals" not in lines[0]                      # torch's advice to trust the file's classes
    assert_nothing_written(tmp_path, "dst")


def test_a_listing_in_an_error_is_sorted_and_cut_only_past_its_limit():
    """Every error that lists keys lists them all, sorted, up to its limit, then says how many more there are:
    a user fixing a checkpoint must see every problem in one run."""
    keys = [f"k{i:02d}" for i in range(20)]
    assert listing(reversed(keys)) == ", ".join(keys)                          # exactly the limit: all of them
    assert listing([*keys, "k20"]) == ", ".join(keys) + ", ... (1 more)"
    assert listing(["b", "a", "c"], limit=2) == "a, b, ... (1 more)"


def test_an_index_that_puts_a_tensor_in_another_shard_is_named(tmp_path):
    """An index from another save that names the wrong shard for a tensor means the shards and the index
    disagree: refused naming the tensor, where the index says it is and where it was found."""
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    index = src / "model.safetensors.index.json"
    saved = json.loads(index.read_text())
    shards = sorted(set(saved["weight_map"].values()))
    key = next(k for k, f in saved["weight_map"].items() if f == shards[0])
    saved["weight_map"][key] = shards[1]
    index.write_text(json.dumps(saved))
    refuse(tmp_path, src, rf"index\.json does not match the shards: {key.replace('.', '[.]')} \(index: {shards[1]}, "
                          rf"found in: {shards[0]}\)")


def test_every_missing_shard_is_named(tmp_path):
    """An incomplete download lacks several shards: all are named at once, not one per run."""
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    first, second = sorted(src.glob("*.safetensors"))[:2]
    first.unlink()
    second.unlink()
    refuse(tmp_path, src, rf"names shard\(s\) that are not in .*: {first.name}, {second.name}\. Download the complete")


def test_every_key_the_config_turns_off_is_listed(tmp_path):
    """A bias the config turns off is named for every layer and projection that stores one, not only the first."""
    src = save_source(source_model("llama", attention_bias=True), tmp_path / "src", shards=False)
    path = src / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "attention_bias": False}))
    with pytest.raises(ConversionError) as err:
        convert(src, tmp_path / "dst", ConvertOptions(verify=False))
    for i in range(4):
        for proj in "qkvo":
            assert f"model.layers.{i}.self_attn.{proj}_proj.bias -> " in str(err.value), str(err.value)


def test_a_blank_path_is_refused_like_an_empty_one():
    """`"$OUT "` with OUT unset is as empty as `"$OUT"`."""
    from attnres.conversion.checkpoint_io import require_path
    from attnres.conversion.errors import UsageError

    with pytest.raises(UsageError, match=r"DST is empty \(' '\); pass a path"):
        require_path(" ", "DST")


def test_hidden_files_of_the_source_are_not_carried_over(tmp_path):
    """Only the model's side files are published (and pushed): a source's hidden files (`.gitattributes` of a
    clone, an editor's or a tool's state) are not."""
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src", tokenizer=True)
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src / ".notes").write_text("private")
    result = convert(src, tmp_path / "dst", ConvertOptions(verify=False))
    assert not [p.name for p in (tmp_path / "dst").iterdir() if p.name.startswith(".")]
    assert "tokenizer.json" in result.copied_files
