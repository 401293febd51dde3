"""Mixture-of-experts sources (transformers' Qwen3-MoE, Qwen2-MoE with its shared expert, Mixtral) -> AttnRes:
exact at eps=0 (tests/conversion/test_standard.py), the same experts chosen for every token and layer, the
same load-balancing loss, the routing reported by the verification; quantization refused clearly."""

import dataclasses

import pytest
import torch

import attnres.conversion.converter as converter_module
from attnres.conversion import ConversionError, ConvertOptions, convert, keymap
from attnres.conversion.quantize import quantize_checkpoint
from attnres.conversion.standard import standard_rules
from tests.conversion.builders import MOE_SOURCES, save_source, source_model, token_ids
from tests.support.reference import load_hf


@pytest.mark.parametrize("name", MOE_SOURCES)
def test_routing_and_the_aux_loss_are_the_sources_at_eps_zero(tmp_path, name):
    src = source_model(name, eps=0.0, seed=3)
    save_source(src, tmp_path / "src")
    result = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(verify=False, stream_scale=2.0))
    assert result.config.num_experts == 4 and result.config.sparse_layers == {
        "qwen3_moe": [0, 2, 3], "qwen2_moe": [1, 3], "mixtral": [0, 1, 2, 3]}[name]
    model, ids = load_hf(tmp_path / "dst"), token_ids()
    with torch.no_grad():
        ours = model(ids, labels=ids, output_router_logits=True)
        theirs = src(ids, labels=ids, output_router_logits=True)
    assert len(ours.router_logits) == len(theirs.router_logits) == len(result.config.sparse_layers)
    for a, b in zip(ours.router_logits, theirs.router_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        assert torch.equal(a.topk(2).indices.sort().values, b.topk(2).indices.sort().values)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-6)


def test_the_verification_reports_the_routing_and_the_card_the_experts(tmp_path):
    src = source_model("qwen2_moe", eps=1e-7, seed=4)
    save_source(src, tmp_path / "src")
    result = convert(tmp_path / "src", tmp_path / "dst")
    assert result.verification.passed and result.verification.routing_agreement == 1.0
    assert "routing: 100.0% of (token, sparse layer) pairs" in "\n".join(result.verification.lines())
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "mixture of experts: 4 experts, top-2, on layers [1, 3], shared expert of 24" in card


def test_a_zero_width_shared_expert_is_dropped_exactly(tmp_path):
    """Qwen2-MoE with shared_expert_intermediate_size 0 stores an empty shared expert (and its gate): it adds
    nothing, so the conversion drops those tensors and is exact."""
    src = source_model("qwen2_moe", eps=0.0, seed=6, shared_expert_intermediate_size=0)
    save_source(src, tmp_path / "src")
    result = convert(tmp_path / "src", tmp_path / "dst")
    assert result.verification.passed and result.config.shared_expert_intermediate_size == 0
    with torch.no_grad():
        ids = token_ids()
        torch.testing.assert_close(load_hf(tmp_path / "dst")(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name, routing", [("qwen3_moe", dict(mlp_only_layers=[0, 1, 2, 3])),
                                           ("qwen2_moe", dict(decoder_sparse_step=5))])
def test_experts_that_no_layer_routes_through_convert_as_a_dense_model(tmp_path, name, routing):
    """A source declaring experts but sparse on no layer is built dense by its own class: the conversion is
    dense too (num_experts 0), exact, rather than refused for having no sparse layer."""
    src = source_model(name, eps=0.0, seed=7, **routing)
    save_source(src, tmp_path / "src")
    result = convert(tmp_path / "src", tmp_path / "dst")
    assert result.verification.passed and result.config.num_experts == 0 and result.config.sparse_layers == []
    with torch.no_grad():
        ids = token_ids()
        torch.testing.assert_close(load_hf(tmp_path / "dst")(ids).logits, src(ids).logits, rtol=1e-5, atol=1e-5)


def test_quantize_refuses_a_mixture_of_experts(tmp_path):
    src = source_model("mixtral", seed=5)
    save_source(src, tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "attnres", ConvertOptions(verify=False))
    with pytest.raises(ConversionError, match="is a mixture of experts \\(4 experts\\): attnres-quantize writes W8A8"):
        quantize_checkpoint(tmp_path / "attnres", tmp_path / "w8a8")
    assert not (tmp_path / "w8a8").exists()


def test_a_router_the_converter_changed_shows_in_the_routing_agreement(tmp_path, monkeypatch):
    """A converter bug in the router (its logits negated: other experts chosen) is measured by the verification,
    not assumed: the agreement drops far below 1 and the report says so."""
    monkeypatch.setitem(keymap.TRANSFORMS, "negate", lambda t, ctx: -t)
    def buggy_rules(config, source):
        return tuple(dataclasses.replace(rule, transform="negate") if rule.target and rule.target.endswith(
            "mlp.gate.weight") else rule for rule in standard_rules(config, source))
    monkeypatch.setattr(converter_module, "standard_rules", buggy_rules)
    save_source(source_model("qwen2_moe", eps=1e-7, seed=4), tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "dst", ConvertOptions(keep_failed=True)).verification
    assert report.routing_agreement < 0.5 and not report.passed
    assert f"routing: {100 * report.routing_agreement:.1f}% of (token, sparse layer) pairs" in "\n".join(report.lines())
