"""Llama / Qwen2 / Qwen3 / Mistral checkpoints -> AttnRes: exactness at eps=0, the predicted eps effect otherwise."""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.conversion import ConvertOptions, convert
from attnres.conversion.cli import main
from attnres.conversion.standard import default_block_size, sources_per_site
from attnres.conversion.verify import apply_predicted_eps, compare, prompt_ids
from modeling_attnres import AttnResConfig, AttnResForCausalLM
from tests.conversion.builders import CHAT_TEMPLATE, SOURCES, rel_diff, save_source, source_model, token_ids


def load(path, dtype=torch.float32):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config._attn_implementation = "eager"
    return model.eval()


@pytest.mark.parametrize("name", list(SOURCES))
def test_exact_at_eps_zero(tmp_path, name):
    src = source_model(name, eps=0.0)
    save_source(src, tmp_path / "src")
    # a scaled stream must be exact too (eps = 0 alone would pick s = 1)
    convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False, stream_scale=4.0))
    model = load(tmp_path / "dst")
    assert isinstance(model, AttnResForCausalLM)
    ids = token_ids()
    with torch.no_grad():
        assert rel_diff(model(ids).logits, src(ids).logits) < 1e-5
        kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kwargs), src.generate(ids, **kwargs))
    assert model.config.tie_word_embeddings == src.config.tie_word_embeddings
    if src.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    zero = [p for n, p in model.named_parameters() if n.endswith("_res_proj.weight")]
    assert len(zero) == 2 * src.config.num_hidden_layers + 1 and all(not p.any() for p in zero)
    # and every depth key-norm gain one (a zero gain gives the same forward, and a zero gradient to every query)
    gains = [p for n, p in model.named_parameters() if n.endswith("_res_norm.weight")]
    assert len(gains) == 2 * src.config.num_hidden_layers + 1 and all(torch.equal(p, torch.ones_like(p)) for p in gains)


@pytest.mark.parametrize("name", ["llama_tied_bias", "qwen3"])
def test_eps_deviation_is_exactly_the_predicted_one(tmp_path, name):
    """With the source's eps the converted model equals the source with each site's eps replaced by
    (c/s)^2 * eps, as the spec predicts, and nothing else; calibration scores every candidate s by
    that prediction, so its numbers are the real errors and the chosen s is the best one."""
    src = source_model(name, eps=1e-5)
    save_source(src, tmp_path / "src")
    chosen = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False))
    assert list(chosen.scale_errors) == [1.0, 2.0, 4.0, 8.0]          # up to >= 5 sources (4 blocks + partial)
    assert chosen.stream_scale == min(chosen.scale_errors, key=chosen.scale_errors.get)
    card = (tmp_path / "dst" / "README.md").read_text()
    assert (f"- residual-stream scale s: {chosen.stream_scale:g} (calibrated; predicted relative logit error "
            f"{chosen.calibration_summary()})") in card
    ids, calibration_ids = token_ids(), prompt_ids(None, src.config.vocab_size)
    with torch.no_grad():
        for scale, predicted_error in chosen.scale_errors.items():
            dst = tmp_path / f"dst-{scale:g}"
            result = convert(tmp_path / "src", dst, ConvertOptions(verify=False, stream_scale=scale))
            model = load(dst)
            predicted = source_model(name, eps=1e-5)
            apply_predicted_eps(predicted, result.config, scale)
            assert rel_diff(model(ids).logits, predicted(ids).logits) < 1e-5
            actual = compare([src(x).logits for x in calibration_ids], [model(x).logits for x in calibration_ids])[1]
            assert actual == pytest.approx(predicted_error, rel=1e-3) and actual > 1e-5


def test_weights_are_carried_bit_exactly_with_unit_scale(tmp_path):
    src = source_model("qwen2_tied", eps=0.0)
    save_source(src, tmp_path / "src", shards=False)
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False))
    assert result.stream_scale == 1.0 and not result.scale_errors   # eps = 0: every s is exact, keep weights
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as f:
        converted = {k: f.get_tensor(k) for k in f.keys()}
    for key, tensor in src.state_dict().items():
        if key != "lm_head.weight":  # tied: stored once, as the embedding
            assert torch.equal(converted[key], tensor), key
    # Qwen2's o_proj has no bias; AttnRes's attention_bias covers it, filled with zeros.
    assert not converted["model.layers.0.self_attn.o_proj.bias"].any()


def test_float16_output_is_not_calibrated_even_with_eps(tmp_path):
    """float16 ends at 65504 and real residual streams have outliers in the thousands: s = 1 unless asked."""
    save_source(source_model("llama", eps=1e-5), tmp_path / "src", shards=False)
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False, dtype="float16"))
    assert result.stream_scale == 1.0 and not result.scale_errors


def test_the_default_dtype_is_the_sources_and_its_token_ids_are_kept(tmp_path):
    """`--dtype auto`: a bfloat16 source stays bfloat16 (weights and config); bos/eos/pad ids other than the
    defaults carry over."""
    src = source_model("llama", eps=0.0, bos_token_id=4, eos_token_id=5, pad_token_id=6).to(torch.bfloat16)
    save_source(src, tmp_path / "src", shards=False)
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False))
    assert result.dtype == torch.bfloat16
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (4, 5, 6)


def test_float16_output_is_not_scaled_by_default(tmp_path):
    src = source_model("mistral", eps=0.0)
    save_source(src, tmp_path / "src", shards=False)
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False, dtype="float16"))
    assert result.stream_scale == 1.0  # float16 overflows at 65504: no default scaling
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.float16 and torch.equal(embed, src.model.embed_tokens.weight.half())


def test_cli_verifies_and_keeps_tokenizer_chat_template_and_generation_config(tmp_path, capsys):
    src = source_model("llama_tied_bias", eps=1e-6)
    src.generation_config.temperature, src.generation_config.do_sample = 0.7, True
    save_source(src, tmp_path / "src", tokenizer=True)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst"), "--dtype", "bfloat16", "--block-size", "3"]) == 0
    out = capsys.readouterr().out
    assert "max |logit difference|" in out and "verdict: passed" in out
    assert "greedy generation (8 tokens) agrees: yes (with the source with weights rounded to bfloat16)" in out
    assert "eps prediction with weights rounded to bfloat16: " in out
    assert "(float noise: the deviation above is the eps effect only)" in out
    dst = tmp_path / "dst"
    config = json.loads((dst / "config.json").read_text())
    assert config["model_type"] == "attnres" and config["attn_res_block_size"] == 3 and config["dtype"] == "bfloat16"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_attnres.AttnResForCausalLM"
    assert json.loads((dst / "generation_config.json").read_text())["temperature"] == 0.7
    assert AutoTokenizer.from_pretrained(dst).chat_template == CHAT_TEMPLATE
    with safe_open(dst / "model.safetensors", "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    card = (dst / "README.md").read_text()
    assert "LlamaForCausalLM" in card and "max |logit difference|" in card and "3 layer(s) per block" in card
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging folder left
    (tmp_path / "plain.txt").write_text("x")          # the mode any file the user writes gets
    assert {p.stat().st_mode & 0o777 for p in dst.iterdir()} == {(tmp_path / "plain.txt").stat().st_mode & 0o777}


def test_sharded_bin_checkpoint_converts_and_verifies(tmp_path):
    """`pytorch_model.bin.index.json` and its shards (what transformers wrote before safetensors): every
    shard is read, as transformers reads them."""
    src, model = tmp_path / "src", source_model("llama", eps=1e-6)
    model.config.save_pretrained(src)
    state_dict, weight_map = model.state_dict(), {}
    keys = list(state_dict)
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        shard = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: state_dict[k] for k in part}, src / shard)
        weight_map |= dict.fromkeys(part, shard)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    result = convert(src, tmp_path / "dst", ConvertOptions())
    assert result.verification.passed, result.verification.lines()
    assert not (tmp_path / "dst" / "pytorch_model-00001-of-00002.bin").exists()


def test_the_card_names_a_hub_base_model_never_a_local_path(tmp_path, monkeypatch):
    """`base_model` in the card's front matter is a Hub repo id; a local SRC that looks like one is not.
    Weights of other formats beside the checkpoint (a GGUF export) are not carried over as side files."""
    monkeypatch.chdir(tmp_path)
    src = save_source(source_model("llama", eps=0.0), tmp_path / "org" / "model", shards=False)
    (src / "model-Q4_K_M.gguf").write_bytes(b"GGUF")
    convert("org/model", tmp_path / "dst", ConvertOptions(verify=False))              # a repo id's shape
    assert "base_model" not in (tmp_path / "dst" / "README.md").read_text()
    assert not (tmp_path / "dst" / "model-Q4_K_M.gguf").exists()


def test_default_block_size_and_source_counts():
    assert [default_block_size(n) for n in (1, 8, 9, 32, 93)] == [1, 1, 2, 4, 12]
    config = AttnResConfig(num_hidden_layers=5, attn_res_block_size=2, hidden_size=32, intermediate_size=64,
                           num_attention_heads=4)
    # layer 0: attn mixes only the embedding; the partial becomes block 1 at layers 0, 2, 4
    assert sources_per_site(config) == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]
    assert sources_per_site(config)[-1] == config.num_depth_sources


def test_a_model_of_ten_or_more_layers_converts_every_layer(tmp_path):
    """Layer indices of two digits and more (every real model) are matched by the key map like 0-9."""
    model = source_model("llama", num_hidden_layers=11)
    src = save_source(model, tmp_path / "src", shards=False)
    convert(src, tmp_path / "dst", ConvertOptions(verify=False))
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "dst").eval()
    with torch.no_grad():
        assert rel_diff(converted(token_ids()).logits, model(token_ids()).logits) < 1e-5


def test_the_card_says_the_output_dtype_what_was_kept_and_how_a_tied_head_was_scaled(tmp_path):
    """The model card is what Hub users read: the dtype written (not the source's), the side files carried
    over, and for a tied model only, that the final norm's gain carries 1/s."""
    tied = save_source(source_model("qwen2_tied", eps=1e-6), tmp_path / "tied", shards=False, tokenizer=True)
    (tied / "README.md").write_text("# The source's own card\n")                  # replaced, never "kept"
    convert(tied, tmp_path / "tied_out", ConvertOptions(verify=False, dtype="bfloat16", stream_scale=2.0))
    card = (tmp_path / "tied_out" / "README.md").read_text()
    assert "- dtype: bfloat16\n" in card
    kept = card.split("- kept from the source: ")[1].split("\n")[0]
    assert "`tokenizer.json`" in kept and "README" not in kept and "source's own card" not in card
    assert "final norm's gain divided by `s` because lm_head is tied" in card
    untied = save_source(source_model("llama", eps=1e-6), tmp_path / "untied", shards=False)
    convert(untied, tmp_path / "untied_out", ConvertOptions(verify=False, stream_scale=2.0))
    card = (tmp_path / "untied_out" / "README.md").read_text()
    assert "- dtype: float32\n" in card
    assert "lm_head is tied" not in card


def test_the_summary_prints_the_calibration_it_chose_the_scale_from(tmp_path, capsys):
    """Without --stream-scale the scale is calibrated on the source; the summary shows the predicted error of
    each scale tried, so the user can see why this s was chosen."""
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--no-verify"]) == 0
    out = capsys.readouterr().out
    assert "  stream scale calibration (predicted relative logit error): s=1: " in out, out


def test_the_eps_report_measures_the_converted_model_at_each_scale(tmp_path):
    """`python -m attnres.conversion.eps_report` is the docs' eps table: at eps 0 every conversion is exact, with
    eps each scale asked for is the one measured (their errors differ), and the calibrated cell names its s."""
    from attnres.conversion.eps_report import measure

    exact = measure("Llama", 2, 0.0, [1.0, 2.0, None], None, tmp_path / "zero")
    assert all(float(cell.split()[0]) < 1e-6 for cell in exact), exact                # float32 round-off only
    cells = measure("Llama", 2, 1e-5, [1.0, 2.0, None], None, tmp_path / "eps")
    errors = [float(cell.split()[0]) for cell in cells]
    assert errors[0] > errors[1] > 1e-4 and errors[2] <= min(errors[:2]), cells      # random init: eps costs
    assert cells[2].split()[1].startswith("(s=")
