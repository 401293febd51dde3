"""A conversion that fails its own verification is never published (unless --keep-failed asks for it).

The failures are real: a converter with a wrong key map (the MLP output left unscaled while the rest
of the stream is scaled), and a source whose eps is so large that the spec's eps effect changes the
greedy tokens. Neither mocks the verifier.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

import attnres.conversion.converter as converter_module
from attnres.conversion import ConvertOptions, VerificationFailed, convert, verify
from attnres.conversion.cli import main
from attnres.conversion.datatypes import VerifyReport
from attnres.conversion.standard import standard_rules
from attnres.conversion.verify import NEW_TOKENS, PROMPTS, prompt_ids
from tests.conversion.builders import save_source, source_model


def staged(tmp_path) -> list[str]:
    return [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.fixture
def unscaled_down_proj(monkeypatch):
    """A converter bug: down_proj copied instead of scaled by s, so with s != 1 every MLP adds 1/s of its output."""
    def buggy_rules(config, source):
        return tuple(dataclasses.replace(rule, transform="copy") if rule.target and "down_proj" in rule.target
                     else rule for rule in standard_rules(config, source))
    monkeypatch.setattr(converter_module, "standard_rules", buggy_rules)


def test_wrong_conversion_publishes_nothing_and_exits_non_zero(tmp_path, capsys, unscaled_down_proj):
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--stream-scale", "2"]) == 1
    err = capsys.readouterr().err
    assert "attnres-convert: error: verification failed: max |difference| to the spec's eps prediction is" in err
    assert "LARGER than float noise" in err and f"Nothing was published at {tmp_path / 'dst'}" in err
    assert "verdict: FAILED" in err and "--keep-failed" in err
    assert not (tmp_path / "dst").exists() and staged(tmp_path) == []


def test_keep_failed_publishes_with_a_warning(tmp_path, capsys, unscaled_down_proj):
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--stream-scale", "2", "--keep-failed"]) == 0
    captured = capsys.readouterr()
    assert "verdict: FAILED" in captured.out
    assert "warning: verification FAILED (max |difference| to the spec's eps prediction" in captured.err
    assert "published anyway because of --keep-failed" in captured.err
    assert "**Verification FAILED (" in (tmp_path / "dst" / "README.md").read_text()
    AutoModelForCausalLM.from_pretrained(tmp_path / "dst")   # a complete checkpoint
    assert staged(tmp_path) == []


def test_greedy_disagreement_from_a_large_eps_effect_is_refused(tmp_path):
    src = save_source(source_model("llama", eps=1e-2), tmp_path / "src")
    with pytest.raises(VerificationFailed, match=r"greedy generation differs from the source: the logits are the "
                                                 r"spec's prediction, so the eps effect itself") as failure:
        convert(src, tmp_path / "dst", ConvertOptions(stream_scale=1.0))
    assert failure.value.report.prediction_holds and not failure.value.report.greedy_agree
    assert not (tmp_path / "dst").exists() and staged(tmp_path) == []
    result = convert(src, tmp_path / "dst", ConvertOptions(stream_scale=1.0, keep_failed=True))
    assert not result.verification.passed and (tmp_path / "dst" / "model.safetensors").exists()


@pytest.mark.parametrize("vs_prediction, eps_effect, blamed", [
    (2.5e-7, True, "the rms_norm_eps effect"), (0.5, True, "converter bug"), (2.5e-7, False, "no eps effect here")])
def test_a_failed_verification_blames_the_eps_effect_only_where_the_spec_prediction_holds(vs_prediction, eps_effect,
                                                                                          blamed):
    """A greedy flip on a near-tie while the model equals the spec's prediction is the eps effect (float
    rounding where rms_norm_eps is 0, which has none), not a bug."""
    report = VerifyReport(max_abs_diff=1e-3, max_rel_diff=1e-4, logit_scale=10.0, argmax_agreement=0.99,
                          greedy_agree=False, vs_prediction=vs_prediction, reference="the source",
                          prediction="the source with the spec's eps", explained="eps", greedy_reference="the source",
                          num_prompts=4, new_tokens=8, eps_effect=eps_effect)
    message = str(VerificationFailed(Path("dst"), report))
    assert blamed in message
    assert ("converter bug" in message) == (blamed == "converter bug")
    assert ("eps effect itself" in message) == (blamed == "the rms_norm_eps effect")


@pytest.mark.parametrize("vs_prediction, holds", [(5e-4, True), (2e-3, False)])
def test_the_prediction_holds_up_to_1e_4_of_the_largest_logit(vs_prediction, holds):
    """Float noise is at most 1e-4 of the largest source logit (1e-3 where it is 10); more is a
    converter bug, and the conversion fails."""
    report = VerifyReport(max_abs_diff=1e-3, max_rel_diff=1e-4, logit_scale=10.0, argmax_agreement=1.0,
                          greedy_agree=True, vs_prediction=vs_prediction, reference="the source",
                          prediction="the source with the spec's eps", explained="eps", greedy_reference="the source",
                          num_prompts=3, new_tokens=8)
    assert report.prediction_holds == holds and report.passed == holds
    assert bool(report.failures()) != holds


def test_the_greedy_reference_is_the_source_rounded_to_the_output_dtype(tmp_path, monkeypatch):
    """A bfloat16 output is compared token for token with the source whose weights are rounded to bfloat16
    (as the report says), not the float32 source: rounding alone may flip a near-tie."""
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    seen, greedy = [], verify._greedy

    def recording(model, ids):
        seen.append(all(torch.equal(p, p.to(torch.bfloat16).float()) for p in model.parameters()))
        return greedy(model, ids)
    monkeypatch.setattr(verify, "_greedy", recording)
    result = convert(src, tmp_path / "dst", ConvertOptions(dtype="bfloat16", keep_failed=True))
    assert result.verification.greedy_reference == "the source with weights rounded to bfloat16"
    assert seen[0], "the greedy reference ran on weights not rounded to bfloat16"


def test_verification_prompts_hold_distinct_tokens_and_fit_the_positions(tmp_path):
    """The tiny tokenizer maps every prompt word to one unknown token: with one repeated token every value
    vector is the same, so attention would hide any difference in its scores. Random ids replace such
    prompts; every prompt and its greedy continuation fit `max_positions` (a clipped window)."""
    src = save_source(source_model("llama"), tmp_path / "src", tokenizer=True)
    tokenizer = AutoTokenizer.from_pretrained(src)
    assert {len(set(tokenizer(p).input_ids)) for p in PROMPTS} == {1}        # what the fallback is for
    ids = prompt_ids(src, 97)
    assert all(x.unique().numel() >= 3 for x in ids) and [x.shape[1] for x in ids] == [6, 9, 12]
    assert [x.shape[1] for x in prompt_ids(src, 97, max_positions=NEW_TOKENS + 7)] == [6, 7, 7]


def test_the_reported_numbers_are_the_source_against_the_output(tmp_path):
    """The headline numbers of a calibrated conversion (eps > 0: the output differs from the source by the eps
    effect), recomputed here from the source's own transformers class and the published checkpoint on the same
    prompts: the report compares the source as given (its eps untouched by the calibration) with the output."""
    src = save_source(source_model("llama", eps=1e-4, seed=5), tmp_path / "src")
    result = convert(src, tmp_path / "dst", ConvertOptions(keep_failed=True))
    report = result.verification
    assert result.stream_scale != 1 or report.max_abs_diff > 0         # a real difference to measure
    source = LlamaForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    output = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype=torch.float32).eval()
    ids = prompt_ids(src, source.config.vocab_size, source.config.max_position_embeddings)
    with torch.no_grad():
        want, got = [source(x).logits for x in ids], [output(x).logits for x in ids]
    diff = max(float((a - b).abs().max()) for a, b in zip(want, got))
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)).flatten() for a, b in zip(want, got)]).float().mean()
    assert diff > 1e-6 and report.max_abs_diff == pytest.approx(diff, rel=1e-3)
    assert report.logit_scale == pytest.approx(max(float(a.abs().max()) for a in want), rel=1e-6)
    assert report.argmax_agreement == pytest.approx(float(agree))
