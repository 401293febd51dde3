"""attnres-retrofit: training the depth parameters of a zero-query model lowers held-out loss, the
backbone stays frozen, a resumed run equals an uninterrupted one, and bad input gets a clear error.

The model is the shipped `models/attnres-tiny` with its pseudo-queries zeroed and key-norm gains set
to one: exactly what a conversion produces (uniform depth mixing), on a model whose backbone was
trained to use depth attention, so the depth parameters have something to learn in a few steps.
"""

import hashlib
import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from attnres.conversion import retrofit, retrofit_work
from attnres.conversion.errors import UsageError
from modeling_attnres.configuration_attnres import is_depth_parameter
from tests.support.models import perturbed_copy, tiny_model
from tests.support.training import RETROFIT_ARGS, write_corpus, write_zeroed

HELDOUT_MODULES = ("contextlib", "dataclasses")          # not in the corpus at all: an independent held-out text


def site_index(name: str, num_sites: int) -> int:
    """docs/spec.md section 6: layer i's attention site is 2i, its MLP site 2i + 1, the output site last."""
    if name.startswith("model.output_"):
        return num_sites - 1
    layer = int(name.split(".")[2])
    return 2 * layer + (".mlp_res_" in name)


@pytest.fixture(scope="module")
def zeroed(tmp_path_factory) -> Path:
    return write_zeroed(tmp_path_factory.mktemp("zeroed"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def reference_loss(folder: Path) -> float:
    """transformers' own LM loss on held-out stdlib modules (not retrofit's evaluation code)."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids = tok("".join((stdlib / f"{m}.py").read_text() for m in HELDOUT_MODULES), return_tensors="pt").input_ids
    windows = ids[0, : (ids.shape[1] // 64) * 64].view(-1, 64)[:24]
    with torch.no_grad():
        return model(input_ids=windows, labels=windows).loss.item()


def run(model, corpus, work, *extra):
    args = retrofit.parse_args([str(model), str(corpus), "--work-dir", str(work), *RETROFIT_ARGS, *extra])
    return retrofit.retrofit(args)


@pytest.mark.timeout(240)
def test_retrofit_lowers_heldout_loss_and_keeps_the_backbone(zeroed, corpus, tmp_path):
    out, depth = tmp_path / "out", tmp_path / "depth.safetensors"
    metrics = run(zeroed, corpus, tmp_path / "work", "--steps", "12", "--out", str(out), "--export-depth", str(depth))
    before, after = reference_loss(zeroed), reference_loss(out)
    assert after < before - 0.5, (before, after)
    assert metrics["heldout_loss_after"] < metrics["heldout_loss_before"]
    old, new = load_file(zeroed / "model.safetensors"), load_file(out / "model.safetensors")
    sites = AutoConfig.from_pretrained(zeroed).depth_sites
    assert old.keys() == new.keys()
    for name in old:
        moved = not torch.equal(old[name], new[name])
        if "_res_proj." in name:          # a site that sees one source has nothing to choose: no gradient
            assert moved == (sites[site_index(name, len(sites))].num_stored > 0), name
        elif not is_depth_parameter(name):
            assert not moved, f"{name} moved: the backbone must stay frozen"
    exported = load_file(depth)
    assert sorted(exported) == sorted(n for n in new if is_depth_parameter(n))
    assert metrics["trained_parameters"] == sum(v.numel() for v in exported.values())
    for name, tensor in exported.items():
        torch.testing.assert_close(tensor, new[name].float(), rtol=0, atol=0)
    # Applying the file to the zero-query model reproduces the retrofitted one.
    fresh = AutoModelForCausalLM.from_pretrained(zeroed, dtype=torch.float32)
    retrofit.apply_depth_parameters(fresh, depth)
    for name, param in fresh.named_parameters():
        torch.testing.assert_close(param.detach(), new[name], rtol=0, atol=0)
    assert json.loads((out / "retrofit.json").read_text())["steps"] == 12
    assert not list(tmp_path.glob(".out*"))                             # nothing left of the atomic write


@pytest.mark.timeout(240)
def test_resume_equals_an_uninterrupted_run(zeroed, corpus, tmp_path):
    common = ("--steps", "6", "--save-every", "3")
    straight = run(zeroed, corpus, tmp_path / "a", *common, "--out", str(tmp_path / "out_a"))
    first = run(zeroed, corpus, tmp_path / "b", *common, "--stop-after", "3")
    assert first["interrupted_at"] == 3 and not (tmp_path / "b" / "final").exists()
    resumed = run(zeroed, corpus, tmp_path / "b", *common, "--resume", "--out", str(tmp_path / "out_b"))
    assert resumed["history"] == straight["history"] and len(straight["history"]) == 6
    assert resumed["heldout_loss_after"] == straight["heldout_loss_after"]
    a, b = load_file(tmp_path / "out_a" / "model.safetensors"), load_file(tmp_path / "out_b" / "model.safetensors")
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.timeout(240)
def test_resume_passes_over_a_checkpoint_cut_short_and_still_equals_an_uninterrupted_run(zeroed, corpus, tmp_path):
    """A run killed while saving leaves a checkpoint without its completion marker (or with a file the
    marker does not describe): --resume takes the newest complete one instead."""
    common = ("--steps", "6", "--save-every", "2")
    straight = run(zeroed, corpus, tmp_path / "a", *common, "--out", str(tmp_path / "out_a"))
    run(zeroed, corpus, tmp_path / "b", *common, "--stop-after", "4")
    assert all(retrofit_work.is_complete(tmp_path / "b" / f"checkpoint-{step}") for step in (2, 4))
    weights = tmp_path / "b" / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])          # torn by a kill
    assert not retrofit_work.is_complete(tmp_path / "b" / "checkpoint-4")
    assert retrofit.last_checkpoint(tmp_path / "b", log=lambda _: None).endswith("checkpoint-2")
    resumed = run(zeroed, corpus, tmp_path / "b", *common, "--resume", "--out", str(tmp_path / "out_b"))
    assert resumed["history"] == straight["history"]
    a, b = load_file(tmp_path / "out_a" / "model.safetensors"), load_file(tmp_path / "out_b" / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_builtin_model_is_retrofitted_from_its_folder_and_an_unknown_name_is_a_usage_error(corpus, tmp_path,
                                                                                              capsys):
    """MODEL may name a built-in model as attnres-serve and attnres-quantize take it (`builtin:attnres-tiny`):
    its folder is trained from, and left as it was; the default work dir is named after it."""
    from attnres.models import shipped_model_path
    from attnres.serving.defaults import BUILTIN_MODELS

    shipped = shipped_model_path()
    before = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in shipped.iterdir()}
    assert retrofit.parse_args(["builtin:attnres-tiny", str(corpus)]).work_dir.name == "attnres-tiny"
    capsys.readouterr()
    assert retrofit.main(["builtin:attnres-tiny", str(corpus), "--work-dir", str(tmp_path / "w"), *RETROFIT_ARGS,
                          "--steps", "2", "--save-every", "1", "--out", str(tmp_path / "out")]) == 0
    metrics = json.loads(capsys.readouterr().out)          # stdout is the summary alone (the Trainer logs to stderr)
    assert metrics["model"] == str(shipped) and metrics["steps"] == 2, metrics
    assert AutoConfig.from_pretrained(tmp_path / "out").num_hidden_layers == AutoConfig.from_pretrained(
        shipped).num_hidden_layers
    assert {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in shipped.iterdir()} == before
    capsys.readouterr()
    assert retrofit.main(["builtin:attnres-huge", str(corpus), "--work-dir", str(tmp_path / "w2")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"attnres-retrofit: error: unknown built-in model 'builtin:attnres-huge'; the built-in models are "
        f"{', '.join(BUILTIN_MODELS)}"]
    assert not (tmp_path / "w2").exists()


def test_resume_takes_the_highest_step_not_the_last_name_in_sorted_order(tmp_path):
    """checkpoint-10 comes after checkpoint-9 (not before it, as the names sort): --resume continues from the
    newest step."""
    for step in (9, 10):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        (folder / retrofit_work.COMPLETE_MARKER).write_text(json.dumps(
            {"step": step, "files": retrofit_work.checkpoint_files(folder)}))
        assert retrofit_work.is_complete(folder)
    assert retrofit.last_checkpoint(tmp_path, log=lambda _: None) == str(tmp_path / "checkpoint-10")


def test_two_runs_in_one_work_dir_are_refused(zeroed, corpus, tmp_path):
    with retrofit.work_dir_lock(tmp_path / "w"):
        with pytest.raises(retrofit.RetrofitError, match="is in use by another attnres-retrofit run"):
            run(zeroed, corpus, tmp_path / "w", "--steps", "2")


def error_of(capsys, *argv) -> str:
    """The one-line error of a run whose inputs cannot be used (exit status 1: failed work)."""
    assert retrofit.main([str(a) for a in argv]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]     # earlier lines: progress bars of the fixtures
    assert last.startswith("attnres-retrofit: error: "), last
    return last


def test_ctrl_c_prints_one_line_naming_what_resume_would_continue_from(zeroed, corpus, tmp_path, capsys,
                                                                        monkeypatch):
    out, work = tmp_path / "out", tmp_path / "work"
    argv = [str(zeroed), str(corpus), "--out", str(out), "--work-dir", str(work), *RETROFIT_ARGS, "--steps", "4"]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    with monkeypatch.context() as patch:                  # before any checkpoint: nothing to resume from
        patch.setattr(retrofit, "train", interrupted)
        assert retrofit.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"attnres-retrofit: error: interrupted; nothing half-written is left at {out}; no checkpoint was saved "
        "yet, so run it again from the start.")
    assert retrofit.main([*argv, "--save-every", "2", "--stop-after", "2"]) == 0     # checkpoint-2, then stops
    with monkeypatch.context() as patch:                  # interrupted later in the resumed run
        patch.setattr(retrofit, "heldout_metrics", interrupted)
        assert retrofit.main([*argv, "--save-every", "2", "--resume"]) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"attnres-retrofit: error: interrupted; nothing half-written is left at {out}; run the same command with "
        f"--resume to continue from {work / 'checkpoint-2'}.")
    assert not out.exists()


def test_errors_name_the_problem(zeroed, corpus, tmp_path, capsys):
    llama = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2)).save_pretrained(llama)
    assert "holds a 'llama' model, not an AttnRes one; convert it first" in error_of(capsys, llama, corpus)
    assert "no config.json" in error_of(capsys, tmp_path / "nowhere", corpus)
    untokenized = tmp_path / "untokenized"
    shutil.copytree(zeroed, untokenized, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "vocab*",
                                                                        "merges*", "chat_template*"))
    assert f"{untokenized} has no tokenizer that transformers can load" in error_of(capsys, untokenized, corpus,
                                                                                   *RETROFIT_ARGS)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no files matching *.py" in error_of(capsys, zeroed, empty, "--pattern", "*.py")
    (empty / "blank.txt").write_text("  \n")
    assert "is empty: every matching file is blank" in error_of(capsys, zeroed, empty)
    assert "does not exist" in error_of(capsys, zeroed, tmp_path / "missing")
    assert "no validation files" in error_of(capsys, zeroed, corpus, "--pattern", "*.py",
                                              "--validation-percent", "1")
    for letter in "abcdefghijklmnop":                   # short files: a few tokens in either split
        (empty / f"{letter}.txt").write_text(f"def {letter}(): pass\n")
    assert "shorter than one window of --seq-len 200" in error_of(capsys, zeroed, empty, "--validation-percent", "50",
                                                                    "--seq-len", "200")
    assert retrofit.main([str(zeroed), str(corpus), "--seq-len", "257"]) == 2       # bad usage, before any work
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "attnres-retrofit: error: --seq-len 257 is longer than the model's max_position_embeddings (256); "
        "pass --seq-len 256 or less")
    assert "no complete checkpoint-* folder" in error_of(capsys, zeroed, corpus, *RETROFIT_ARGS, "--resume",
                                                "--work-dir", tmp_path / "none")
    assert "--batch-size 3 (the global batch) must be a multiple of the 2 processes" in str(
        pytest.raises(UsageError, retrofit.check_args, retrofit.parse_args(
            [str(zeroed), str(corpus), "--batch-size", "3"]), 2).value)
    assert retrofit.main([str(zeroed), str(corpus), "--steps", "0"]) == 2          # bad usage
    assert capsys.readouterr().err.strip().splitlines()[-1] == "attnres-retrofit: error: --steps must be >= 1, got 0"
    assert retrofit.main([str(zeroed), str(corpus), "--stop-after", "-1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith("--stop-after must be a step >= 1, got -1; drop "
                                                                     "it to train all --steps")
    (tmp_path / "afile").write_text("")
    assert "--work-dir" in error_of(capsys, zeroed, corpus, "--work-dir", tmp_path / "afile")
    broken = Path(shutil.copytree(zeroed, tmp_path / "broken"))
    (broken / "config.json").write_text("{bad json")
    assert "broken/config.json as JSON (Expecting property name" in error_of(capsys, broken, corpus)
    config = json.loads((zeroed / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "attn_res_block_size": 0}))
    assert "broken/config.json is not a valid AttnRes config: " in error_of(capsys, broken, corpus)
    for option in ("--out", "--work-dir", "--export-depth"):                      # an unset shell variable
        with pytest.raises(SystemExit) as exited:
            retrofit.main([str(zeroed), str(corpus), option, "", "--overwrite"])
        assert exited.value.code == 2
        assert f"argument {option}: is empty ('')" in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_corpus_of_one_file_holds_out_its_last_lines(tmp_path):
    """One file (given itself, or alone in a folder) is split by position: a hash of its path would put the
    whole corpus on one side, and the run could never start."""
    lines = [f"line {i}\n" for i in range(20)]
    (tmp_path / "folder").mkdir()
    for corpus in (tmp_path / "one.txt", tmp_path / "folder" / "only.txt"):
        corpus.write_text("".join(lines))
        assert retrofit.read_corpus(corpus, ("*.txt",), 10) == {"train": ["".join(lines[:18])],
                                                                "validation": ["".join(lines[18:])]}
    assert retrofit.read_corpus(tmp_path / "folder", ("*.txt",), 25)["validation"] == ["".join(lines[15:])]
    assert retrofit.read_corpus(tmp_path / "one.txt", ("*.txt",), 99)["train"] == [lines[0]]   # a line each, at least
    (tmp_path / "long.txt").write_text("x" * 90 + "y" * 10)
    assert retrofit.read_corpus(tmp_path / "long.txt", ("*.txt",), 10) == {"train": ["x" * 90],
                                                                           "validation": ["y" * 10]}
    (tmp_path / "short.txt").write_text("z")
    with pytest.raises(retrofit.RetrofitError, match=r"short\.txt, its only non-blank file\) is too short to split"):
        retrofit.read_corpus(tmp_path / "short.txt", ("*.txt",), 10)


def test_a_checkpoint_whose_weights_disagree_with_its_config_is_refused_before_training(zeroed, corpus, tmp_path,
                                                                                        capsys):
    """A tensor missing (transformers would start it from random values, which the default --train depth
    keeps frozen and publishes), one the model does not have, a layer more in config.json than in the
    weights, and a truncated weights file: each named in one line, before any training."""
    from safetensors.torch import save_file

    def damaged(name: str, edit) -> Path:
        folder = Path(shutil.copytree(zeroed, tmp_path / name))
        weights = load_file(folder / "model.safetensors")
        edit(weights)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder

    out = tmp_path / "out"
    dropped = damaged("dropped", lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    assert ("does not hold the weights its config.json describes (missing: model.layers.1.mlp.down_proj.weight; "
            "not in the model: none); retrofitting would train and publish random values") in error_of(
        capsys, dropped, corpus, "--out", out, *RETROFIT_ARGS)
    extra = damaged("extra", lambda w: w.update({"model.bogus.weight": torch.zeros(2)}))
    assert "(missing: none; not in the model: model.bogus.weight)" in error_of(capsys, extra, corpus, "--out", out,
                                                                               *RETROFIT_ARGS)
    deeper = Path(shutil.copytree(zeroed, tmp_path / "deeper"))
    config = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    assert "has 8 layers but its config.json says num_hidden_layers=9" in error_of(capsys, deeper, corpus, "--out",
                                                                                   out, *RETROFIT_ARGS)
    cut = Path(shutil.copytree(zeroed, tmp_path / "cut"))
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "model.safetensors (Error while deserializing header" in error_of(capsys, cut, corpus, "--out", out,
                                                                             *RETROFIT_ARGS)
    assert not out.exists()


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_outputs_that_would_lose_data_are_refused_before_any_work(zeroed, corpus, tmp_path, capsys):
    """As attnres-convert refuses its DST: nothing is read, trained or written, and what was there stays."""
    before = folder_bytes(zeroed)
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    full = tmp_path / "full"
    full.mkdir()
    (full / "a.txt").write_text("keep me too")
    common = (zeroed, corpus, *RETROFIT_ARGS, "--work-dir", tmp_path / "w")
    for inside in (zeroed, zeroed / "inner", zeroed.parent):
        assert "overlaps MODEL" in error_of(capsys, *common, "--out", inside)
    assert "exists and is not a folder" in error_of(capsys, *common, "--out", notes)
    assert "exists and is not empty; pass --overwrite" in error_of(capsys, *common, "--out", full)
    assert "overlaps MODEL" in error_of(capsys, zeroed, corpus, *RETROFIT_ARGS, "--work-dir", zeroed)
    for argv, fragment in ((("--export-depth", zeroed / "model.safetensors"), "is inside MODEL"),
                           (("--out", tmp_path / "o", "--export-depth", tmp_path / "o" / "d.safetensors"),
                            "is inside the output folder"),
                           (("--export-depth", tmp_path / "notes.safetensors"), "exists; pass --overwrite")):
        (tmp_path / "notes.safetensors").write_text("keep")
        assert fragment in error_of(capsys, *common, *argv)
    assert folder_bytes(zeroed) == before and notes.read_text() == "keep me"
    assert (tmp_path / "notes.safetensors").read_text() == "keep"
    assert folder_bytes(full) == {"a.txt": b"keep me too"} and not (tmp_path / "w").exists()


def test_bad_option_values_are_usage_errors_naming_the_value(zeroed, corpus, capsys):
    for argv, message in ((("--lr", "-1"), "--lr must be a finite number > 0, got -1.0 (the default is 5e-4)"),
                          (("--lr", "nan"), "--lr must be a finite number > 0, got nan (the default is 5e-4)"),
                          (("--warmup", "-3"), "--warmup must be >= 0, got -3"),
                          (("--eval-windows", "-1"), "--eval-windows must be >= 0, got -1")):
        assert retrofit.main([str(zeroed), str(corpus), *argv]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"attnres-retrofit: error: {message}"


def test_a_quantized_model_is_refused(zeroed, corpus, tmp_path, capsys):
    quantized = tmp_path / "q"
    quantized.mkdir()
    config = json.loads((zeroed / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "compressed-tensors"}}))
    assert "is quantized (compressed-tensors); retrofit trains in full precision" in error_of(
        capsys, quantized, corpus, *RETROFIT_ARGS, "--work-dir", tmp_path / "w")


@pytest.mark.timeout(240)
def test_resume_refuses_another_model_or_options_and_a_new_run_clears_the_old_checkpoints(zeroed, corpus, tmp_path,
                                                                                         capsys):
    work, common = tmp_path / "w", ("--steps", "4", "--save-every", "1")
    run(zeroed, corpus, work, *common, "--stop-after", "2")
    other = tmp_path / "other"
    perturbed_copy(zeroed, other, ["model.layers.0.self_attn.q_proj.weight"])
    resume = (*RETROFIT_ARGS, "--work-dir", work, *common, "--resume")
    assert "were trained with another MODEL" in error_of(capsys, other, corpus, *resume)
    changed = error_of(capsys, zeroed, corpus, *resume, "--lr", "1e-3", "--batch-size", "2")
    assert "--lr (was 0.03, now 0.001)" in changed and "--batch-size (was 4, now 2)" in changed
    assert sorted(p.name for p in work.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    run(other, corpus, work, *common, "--stop-after", "1")             # a new run: the old checkpoints go
    assert sorted(p.name for p in work.glob("checkpoint-*")) == ["checkpoint-1"]
    assert "were trained with another MODEL" in error_of(capsys, zeroed, corpus, *resume)
    retrofit.check_resumable(work, retrofit.run_record(retrofit.parse_args(
        [str(other), str(corpus), *RETROFIT_ARGS, "--work-dir", str(work), *common]),
        retrofit.read_corpus(corpus, ("*.py",), 20)))


def test_resume_refuses_another_kl_weight(zeroed, corpus, tmp_path, capsys):
    """The KL weight changes every step's gradient, so checkpoints trained with another --kl-weight are not
    continued: the refusal names the option with both values."""
    work = tmp_path / "w"
    work.mkdir()
    args = retrofit.parse_args([str(zeroed), str(corpus), *RETROFIT_ARGS, "--work-dir", str(work)])
    retrofit_work.start_fresh(work, retrofit.run_record(args, retrofit.read_corpus(corpus, ("*.py",), 20)))
    (work / "checkpoint-1").mkdir()
    changed = error_of(capsys, zeroed, corpus, *RETROFIT_ARGS, "--work-dir", work, "--resume", "--kl-weight", "0.5")
    assert "were trained with another --kl-weight (was 1.0, now 0.5)" in changed


def test_apply_refuses_a_file_from_another_model(tmp_path):
    model = tiny_model(num_hidden_layers=2, attn_res_block_size=1)
    other = tiny_model(num_hidden_layers=3, attn_res_block_size=1)
    model.save_pretrained(tmp_path / "m")
    retrofit.export_depth(tmp_path / "m", tmp_path / "d.safetensors", {"steps": 0})
    with safe_open(str(tmp_path / "d.safetensors"), "pt") as f:
        assert f.metadata()["num_hidden_layers"] == "2"
    with pytest.raises(retrofit.RetrofitError, match="different model.*num_hidden_layers: file 2 vs model 3"):
        retrofit.apply_depth_parameters(other, tmp_path / "d.safetensors")
    (tmp_path / "x.safetensors").write_bytes((tmp_path / "m" / "model.safetensors").read_bytes())
    with pytest.raises(retrofit.RetrofitError, match="not a depth-parameter file"):
        retrofit.apply_depth_parameters(model, tmp_path / "x.safetensors")


def test_apply_refuses_a_file_from_another_block_schedule(tmp_path):
    """The same layers and shapes with another attn_res_block_size mix other sources at each site: the
    trained queries mean something else there, so the file is refused though every tensor would fit."""
    model = tiny_model(num_hidden_layers=2, attn_res_block_size=1)
    model.save_pretrained(tmp_path / "m")
    retrofit.export_depth(tmp_path / "m", tmp_path / "d.safetensors", {"steps": 0})
    other = tiny_model(num_hidden_layers=2, attn_res_block_size=2)
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(retrofit.RetrofitError, match="different model.*attn_res_block_size: file 1 vs model 2"):
        retrofit.apply_depth_parameters(other, tmp_path / "d.safetensors")
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())


def hash_bucket(rel_path: str) -> int:
    """The split's hash of a corpus file's relative path (retrofit's docstring: sha256 % 100; its first four
    bytes, big-endian)."""
    return int.from_bytes(hashlib.sha256(rel_path.encode()).digest()[:4], "big") % 100


def test_a_file_is_held_out_only_when_its_hash_is_below_the_percent(tmp_path):
    """--validation-percent P holds out the files whose hash bucket is 0..P-1 (P of 100 buckets): a file in
    bucket P itself is trained on."""
    at = next(f"{i}.txt" for i in range(1000) if hash_bucket(f"{i}.txt") == 10)
    below = next(f"{i}.txt" for i in range(1000) if hash_bucket(f"{i}.txt") < 10)
    (tmp_path / at).write_text("trained on\n")
    (tmp_path / below).write_text("held out\n")
    assert not retrofit.is_validation(at, 10) and retrofit.is_validation(at, 11)
    assert retrofit.read_corpus(tmp_path, ("*.txt",), 10) == {"train": ["trained on\n"], "validation": ["held out\n"]}


def test_seq_len_may_be_the_models_max_position_embeddings():
    """Windows of exactly max_position_embeddings tokens use positions the model was trained on; one more
    is refused."""
    retrofit.check_positions(256, {"max_position_embeddings": 256})
    with pytest.raises(UsageError, match=r"--seq-len 257 is longer than the model's max_position_embeddings \(256\)"):
        retrofit.check_positions(257, {"max_position_embeddings": 256})


def test_training_uses_no_weight_decay(tmp_path):
    """The Trainer's weight decay would pull the pseudo-queries back towards zero (uniform mixing, what a
    conversion starts from): retrofit trains without it."""
    args = retrofit.parse_args([str(tmp_path / "model"), str(tmp_path / "corpus"), "--work-dir", str(tmp_path / "w")])
    assert retrofit.training_arguments(args, 1).weight_decay == 0.0


def test_fsdp_on_cpus_is_refused_not_silently_run_as_ddp(monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(retrofit.RetrofitError, match="accelerate shards models only on GPUs.*--multi_gpu"):
        retrofit.check_distributed(2)
    retrofit.check_distributed(1)                                      # one process: nothing to shard


def test_whole_files_are_tokenized_without_transformers_length_warning(zeroed, caplog):
    """Corpus files are tokenized whole and then cut into windows, so transformers' warning that a text is longer
    than the model's maximum length ("will result in indexing errors") would only alarm."""
    tokenizer = AutoTokenizer.from_pretrained(zeroed)
    text = "def f(x):\n    return x\n" * tokenizer.model_max_length
    windows = retrofit.token_windows(tokenizer, [text], 16, "training")
    assert windows.shape[1] == 16 and windows.numel() > tokenizer.model_max_length
    assert not [r for r in caplog.records if "Token indices sequence length is longer" in r.getMessage()]
