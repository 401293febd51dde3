"""GGUF files as a conversion source: a tiny Llama written with the `gguf` package's writer (F32, Q8_0 and
Q4_1, the type SmolLM2's GGUF uses) converts and matches its dequantised source; bad files are refused."""

import json
import re

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.conversion import ConversionError, ConvertOptions, convert
from attnres.conversion.cli import main
from modeling_attnres import AttnResForCausalLM
from tests.conversion.builders import hub_cache_snapshot, rel_diff, source_model, token_ids
from tests.conversion.gguf_files import CHAT_TEMPLATE, VOCAB_SIZE, dequantised, tokens_and_merges, write_gguf


def tiny_llama(eps: float = 0.0, tied: bool = True, seed: int = 0):
    """SmolLM2's shape in miniature: GQA, no biases, tied embeddings, the GGUF's vocabulary."""
    return source_model("llama", eps=eps, seed=seed, vocab_size=VOCAB_SIZE, tie_word_embeddings=tied)


def assert_nothing_written(tmp_path):
    assert not (tmp_path / "dst").exists()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]   # no staging or GGUF folder


@pytest.mark.parametrize("qtype,tied,scale", [(Q.F32, False, 1.0), (Q.Q8_0, True, 2.0), (Q.Q4_1, True, 1.0)])
def test_gguf_converts_and_matches_its_dequantised_source(tmp_path, qtype, tied, scale):
    src = tiny_llama(tied=tied, seed=3)
    path = write_gguf(src, tmp_path / "tiny.gguf", qtype)
    result = convert(path, tmp_path / "dst", ConvertOptions(verify=False, stream_scale=scale))
    assert result.layout == "LlamaForCausalLM" and qtype.name in result.origin
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    assert isinstance(model, AttnResForCausalLM) and model.config.tie_word_embeddings == tied
    reference = dequantised(src, qtype)        # independent of transformers' GGUF loader
    ids = token_ids(VOCAB_SIZE)
    with torch.no_grad():
        assert rel_diff(model(ids).logits, reference(ids).logits) < 1e-5
        kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]   # the GGUF's folder is gone


def test_cli_converts_a_folder_with_one_q4_1_gguf_and_keeps_tokenizer_and_chat_template(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    write_gguf(tiny_llama(eps=1e-5, seed=4), tmp_path / "src" / "model-q4_1.gguf", Q.Q4_1)
    assert main([str(tmp_path / "src"), str(tmp_path / "dst")]) == 0
    out = capsys.readouterr().out
    assert "GGUF (Q4_1: 29 tensors, F32: 9 tensors), dequantised to float32" in out
    assert "compared with: the dequantised GGUF" in out and "greedy generation (8 tokens) agrees: yes" in out
    assert "(float noise: the deviation above is the eps effect only)" in out
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "dst")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    tokens = tokens_and_merges()[0]
    # byte-level BPE with the file's merges: " the" is one token, " cat" is " c" + "a" + "t"
    assert tokenizer.encode(" the cat", add_special_tokens=False) == [tokens.index(t) for t in ("Ġthe", "Ġc", "a", "t")]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.convert_tokens_to_ids("<|im_end|>") == VOCAB_SIZE - 1
    assert "Q4_1" in (tmp_path / "dst" / "README.md").read_text()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    # how the file was read here (offline, from a local folder) is not the published tokenizer's setting
    saved = json.loads((tmp_path / "dst" / "tokenizer_config.json").read_text())
    assert not {"local_files_only", "is_local", "gguf_file"} & set(saved), saved


def test_a_transformers_too_old_for_gguf_is_named_before_any_work(tmp_path, monkeypatch):
    """transformers 5.16-5.17 read a GGUF tokenizer's end-of-sequence token wrong (and 5.16 has no GgufConfig)."""
    import transformers

    path = write_gguf(tiny_llama(), tmp_path / "model.gguf")
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(ConversionError, match=r"needs transformers >= 5\.18, found 5\.17\.0: pip install "
                                              r"'attnres\[gguf\]'"):
        convert(path, tmp_path / "dst")
    assert_nothing_written(tmp_path)


def test_unsupported_gguf_architecture_is_named(tmp_path, capsys):
    write_gguf(tiny_llama(), tmp_path / "gpt.gguf", arch="gpt2")
    assert main([str(tmp_path / "gpt.gguf"), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "Unsupported GGUF architecture 'gpt2' in gpt.gguf" in err and "of architecture 'llama'" in err
    assert_nothing_written(tmp_path)


def test_mixture_of_experts_gguf_is_refused(tmp_path):
    path = write_gguf(tiny_llama(), tmp_path / "mixtral.gguf", expert_count=8)
    with pytest.raises(ConversionError, match=r"mixtral\.gguf is a mixture of experts \(llama\.expert_count = 8\).*"
                                              r"Convert the original transformers checkpoint"):
        convert(path, tmp_path / "dst")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("case", ["rope_freqs", "linear_scaling", "split"])
def test_what_transformers_gguf_reader_would_drop_is_refused(tmp_path, case):
    """A Llama 3.1+ export's `rope_freqs.weight`, rope scaling metadata, or one part of a split file: the
    reader would build (and the verification would compare against) another model than the file's."""
    model = tiny_llama()
    if case == "rope_freqs":
        path = write_gguf(model, tmp_path / "llama3.gguf", extra={"rope_freqs.weight": np.full(8, 2.0, np.float32)})
        match = r"llama3\.gguf holds what transformers' GGUF reader drops: rope_freqs\.weight \(Llama 3\.1\+ rope"
    elif case == "linear_scaling":
        path = write_gguf(model, tmp_path / "linear.gguf", rope_scaling=("linear", 4.0))
        match = r"drops: llama\.rope\.scaling\.type = linear, factor 4\.0 \(rope scaling\)"
    else:
        write_gguf(model, tmp_path / "tiny.gguf", split_max_tensors=10)
        path = tmp_path / "tiny-00001-of-00004.gguf"
        assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
        match = r"tiny-00001-of-00004\.gguf is one of 4 parts of a split GGUF .*llama-gguf-split --merge"
    with pytest.raises(ConversionError, match=match):
        convert(path, tmp_path / "dst")
    assert_nothing_written(tmp_path)


def test_unsupported_tensor_type_is_named(tmp_path):
    norm = tiny_llama().model.norm.weight.detach().numpy().astype(np.float64)
    path = write_gguf(tiny_llama(), tmp_path / "f64.gguf", raw={"output_norm.weight": norm})
    with pytest.raises(ConversionError, match=r"cannot be dequantised: F64 \(output_norm\.weight\)\. "
                                              r"Supported: F32, F16, Q4_0, Q4_1, .*Q8_0"):
        convert(path, tmp_path / "dst")
    assert_nothing_written(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncate"])
def test_corrupt_gguf_is_refused(tmp_path, damage):
    path = write_gguf(tiny_llama(), tmp_path / "bad.gguf")
    data = path.read_bytes()
    path.write_bytes(b"not a gguf file" * 8 if damage == "garbage" else data[: len(data) // 3])
    with pytest.raises(ConversionError, match=r"Cannot read .*bad\.gguf as a GGUF file: .*download or copy it again"):
        convert(path, tmp_path / "dst")
    assert_nothing_written(tmp_path)


def test_folder_with_two_ggufs_and_seed_options_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.gguf", "b.gguf"):
        write_gguf(tiny_llama(), src / name)
    with pytest.raises(ConversionError, match=r"holds 2 GGUF files \(a\.gguf, b\.gguf\); pass the one"):
        convert(src, tmp_path / "dst")
    with pytest.raises(ConversionError, match=r"--seed-block-size do\(es\) not apply here: a\.gguf is a GGUF"):
        convert(src / "a.gguf", tmp_path / "dst", ConvertOptions(seed_block_size=4))
    assert_nothing_written(tmp_path)


@pytest.fixture
def two_ggufs(tmp_path):
    """A folder holding two GGUFs of different models, as a Hub GGUF repo holds a model's quantisations."""
    src = tmp_path / "src"
    src.mkdir()
    models = {"tiny-Q8_0.gguf": tiny_llama(seed=5), "tiny-F32.gguf": tiny_llama(seed=6)}
    for name, model in models.items():
        write_gguf(model, src / name, Q.Q8_0 if "Q8_0" in name else Q.F32)
    return src, models


def converted_matches(dst, model, qtype) -> bool:
    converted, ids = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval(), token_ids(VOCAB_SIZE)
    with torch.no_grad():
        return rel_diff(converted(ids).logits, dequantised(model, qtype)(ids).logits) < 1e-5


def test_gguf_file_picks_one_of_a_folders_ggufs(two_ggufs, tmp_path, capsys):
    src, models = two_ggufs
    assert main([str(src), str(tmp_path / "dst"), "--gguf-file", "tiny-F32.gguf", "--no-verify"]) == 0
    assert "(LlamaForCausalLM; file tiny-F32.gguf, GGUF (F32" in capsys.readouterr().out
    assert converted_matches(tmp_path / "dst", models["tiny-F32.gguf"], Q.F32)
    assert not converted_matches(tmp_path / "dst", models["tiny-Q8_0.gguf"], Q.Q8_0)     # the two differ
    assert "file tiny-F32.gguf" in (tmp_path / "dst" / "README.md").read_text()


def test_gguf_file_of_a_hub_repo_offline(two_ggufs, tmp_path, monkeypatch):
    from huggingface_hub import constants

    src, models = two_ggufs
    hub_cache_snapshot(src, tmp_path / "cache", "tiny-org/tiny-GGUF")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    options = ConvertOptions(gguf_file="tiny-Q8_0.gguf", verify=False, stream_scale=1.0)
    result = convert("tiny-org/tiny-GGUF", tmp_path / "dst", options)
    assert result.src == "tiny-org/tiny-GGUF" and result.origin.startswith("file tiny-Q8_0.gguf, GGUF (Q8_0")
    assert converted_matches(tmp_path / "dst", models["tiny-Q8_0.gguf"], Q.Q8_0)
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "base_model: tiny-org/tiny-GGUF" in card and "file tiny-Q8_0.gguf" in card


@pytest.mark.parametrize("name, src_kind, message", [
    ("tiny-Q4_K_M.gguf", "folder", r"--gguf-file 'tiny-Q4_K_M.gguf' is not a file of .* \(its GGUF files: "
                                   r"tiny-F32\.gguf, tiny-Q8_0\.gguf\); pass one of those"),
    ("tiny-F32.gguf", "file", r"SRC .* is already a file; drop --gguf-file"),
    ("../src/tiny-F32.gguf", "folder", r"is not a \.gguf file's path inside SRC"),
    ("config.json", "folder", r"is not a \.gguf file's path inside SRC"),
])
def test_a_wrong_gguf_file_is_named(two_ggufs, tmp_path, capsys, name, src_kind, message):
    src = two_ggufs[0] if src_kind == "folder" else two_ggufs[0] / "tiny-F32.gguf"
    status = main([str(src), str(tmp_path / "dst"), "--gguf-file", name])
    assert status == (1 if "pass one of those" in message else 2)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("attnres-convert: error: ") and re.search(message, err), err
    assert not (tmp_path / "dst").exists()


def test_one_part_of_a_gguf_split_in_two_is_refused(tmp_path):
    """A split GGUF's first part holds only some tensors, however few the parts."""
    write_gguf(tiny_llama(), tmp_path / "tiny.gguf", split_max_tensors=30)
    path = tmp_path / "tiny-00001-of-00002.gguf"
    assert path.exists(), sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConversionError, match=r"tiny-00001-of-00002\.gguf is one of 2 parts of a split GGUF"):
        convert(path, tmp_path / "dst")
    assert_nothing_written(tmp_path)
