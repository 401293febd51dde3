"""Kernel vs oracle: the shared depth-attention function against the naive per-site mix (float64)."""

import pytest
import torch

from modeling_attnres.depth_attention import (
    DepthBank,
    add_to_partial,
    bank_dtype,
    empty_bank,
    fold_queries,
    mix_site,
    push_source,
)
from modeling_attnres.depth_attention_ops import site_bank
from tests.oracle import naive_mix

EPS = 1e-6


def bank(sources, like=None):
    """Stored sources `[n, *tokens, d]` (oracle layout) pushed one by one into a kernel bank."""
    stored = empty_bank(sources[0] if len(sources) else like)
    for source in sources:
        stored = push_source(stored, source, EPS)
    return stored


def mix(sources_or_bank, partial, query, keep_weights=False):
    stored = sources_or_bank if isinstance(sources_or_bank, DepthBank) else bank(sources_or_bank, partial)
    return mix_site(stored, partial, query, EPS, partial.dtype, keep_weights)


def random_case(n, tokens=(2, 3), d=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sources = torch.randn(n, *tokens, d, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(d, generator=gen, dtype=torch.float64)
    gain = 1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    return sources.to(dtype), w, gain


@pytest.mark.parametrize("tokens", [(1,), (2, 3), (4, 1), (7,)])          # decode, batch x seq, flat vLLM
@pytest.mark.parametrize("n_stored", [0, 1, 3, 8, 32])                    # first site ... Full AttnRes
def test_mix_site_matches_oracle(n_stored, tokens):
    sources, w, gain = random_case(n_stored + 1, tokens=tokens, seed=n_stored)
    expected, probs = naive_mix(list(sources), w, gain, EPS)
    query = fold_queries(w[None], gain[None])[0]
    out, weights = mix(sources[:n_stored], sources[n_stored], query, keep_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, probs.movedim(0, -1), rtol=1e-12, atol=1e-12)


def test_float32_inputs_match_float64_oracle():
    sources, w, gain = random_case(5, tokens=(3, 4))
    expected, _ = naive_mix(list(sources), w, gain, EPS)
    query = fold_queries(w[None].float(), gain[None].float())[0]
    out, _ = mix(sources[:4].float(), sources[4].float(), query)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_mix_in_float32():
    sources, w, gain = random_case(4, dtype=torch.bfloat16)
    expected, _ = naive_mix(list(sources.double()), w, gain, EPS)     # same bf16-rounded sources
    query = fold_queries(w[None].bfloat16(), gain[None].bfloat16())[0]
    assert query.dtype == torch.float32
    out, _ = mix(sources[:3], sources[3], query)
    assert out.dtype == torch.bfloat16
    # Only the final cast (and the bf16 query) may differ: one bf16 ulp of the output scale.
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=2e-2)


def test_zero_query_is_the_mean_of_sources():
    sources, _, _ = random_case(6)
    out, weights = mix(sources[:5], sources[5], torch.zeros(16, dtype=torch.float64), keep_weights=True)
    torch.testing.assert_close(out, sources.mean(0))
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 6))


def test_first_site_is_the_identity_and_keeps_the_query_in_the_graph():
    partial = torch.randn(2, 3, 16)
    query = torch.randn(16, requires_grad=True)
    out, weights = mix(empty_bank(partial), partial, query, keep_weights=True)
    assert torch.equal(out, partial)
    assert torch.equal(weights, torch.ones(2, 3, 1))
    out.sum().backward()
    assert query.grad is not None and torch.count_nonzero(query.grad) == 0


def test_large_scores_do_not_overflow():
    sources, w, gain = random_case(5)
    query = fold_queries(w[None] * 1e4, gain[None])[0]
    out, _ = mix(sources[:4].float(), sources[4].float(), query.float())
    assert torch.isfinite(out).all()
    expected, _ = naive_mix(list(sources), w * 1e4, gain, EPS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-4, atol=1e-4)


def test_gradients_match_oracle():
    sources, w, gain = random_case(4)
    src = sources.clone().requires_grad_(True)
    query = fold_queries(w[None], gain[None])[0].clone().requires_grad_(True)
    out, _ = mix(src[:3], src[3], query)
    (out * torch.arange(16.0, dtype=torch.float64)).sum().backward()
    src2 = sources.clone().requires_grad_(True)
    w2 = (w * gain).clone().requires_grad_(True)
    expected, _ = naive_mix(list(src2), w2, torch.ones(16, dtype=torch.float64), EPS)
    (expected * torch.arange(16.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(src.grad, src2.grad)
    torch.testing.assert_close(query.grad, w2.grad)


def test_an_all_zero_source_scores_zero_with_eps_zero_and_keeps_gradients_finite():
    """With eps = 0 an all-zero row (stored, or the partial) has no RMS: it scores 0 (docs/spec.md), as for any
    eps > 0, and its gradients stay finite; the oracle says so independently."""
    sources, w, gain = random_case(4)
    sources[1, 0, 2] = 0                                           # a stored source of one token
    sources[3, 1] = 0                                              # the partial of three tokens
    src = sources.clone().requires_grad_(True)
    stored = empty_bank(src[0])
    for source in src[:3]:
        stored = push_source(stored, source, 0.0)
    assert stored.inv_rms[0, 2, 1] == 0 and stored.inv_rms.isfinite().all()
    query = fold_queries(w[None], gain[None])[0]
    out, weights = mix_site(stored, src[3], query, 0.0, torch.float64, keep_weights=True)
    expected, probs = naive_mix(list(sources), w, gain, 0.0)
    assert expected.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, probs.movedim(0, -1), rtol=1e-12, atol=1e-12)
    out.sum().backward()
    assert src.grad.isfinite().all()


def test_push_source_builds_the_token_major_bank_with_inverse_rms():
    sources, _, _ = random_case(3)
    stored = empty_bank(sources[0])
    assert stored.sources.shape == (2, 3, 0, 16) and stored.inv_rms.shape == (2, 3, 0)
    for source in sources:
        stored = push_source(stored, source, EPS)
    assert torch.equal(stored.sources, sources.movedim(0, -2))
    expected = 1 / torch.sqrt(sources.pow(2).mean(-1) + EPS)
    torch.testing.assert_close(stored.inv_rms, expected.movedim(0, -1))


def test_bf16_sources_are_stored_and_accumulated_in_float32():
    x = torch.randn(2, 16).bfloat16()
    stored = push_source(empty_bank(x), x, EPS)
    assert stored.sources.dtype == torch.float32
    partial = add_to_partial(add_to_partial(None, x), x)
    assert partial.dtype == torch.float32
    torch.testing.assert_close(partial, 2 * x.float())


def test_a_preallocated_bank_fills_in_place_and_equals_the_grown_bank():
    sources, w, gain = random_case(5, tokens=(2, 3))
    query = fold_queries(w[None], gain[None])[0]
    with torch.no_grad():
        grown, filled = empty_bank(sources[0]), empty_bank(sources[0], capacity=4)
        storage = filled.storage
        for source in sources[:4]:
            grown, filled = push_source(grown, source, EPS), push_source(filled, source, EPS)
            assert filled.storage is storage                                   # no copy of earlier blocks
            assert torch.equal(filled.sources, grown.sources) and torch.equal(filled.inv_rms, grown.inv_rms)
        full = push_source(filled, sources[4], EPS)                             # past the capacity: grows
        assert full.num_stored == 5 and torch.equal(full.sources, sources.movedim(0, -2))
        expected, _ = naive_mix(list(sources), w, gain, EPS)
        torch.testing.assert_close(mix(filled, sources[4], query)[0], expected, rtol=1e-12, atol=1e-12)


def test_under_autograd_the_bank_grows_by_concatenation():
    x = torch.randn(2, 16)
    assert empty_bank(x, capacity=4).storage.shape == (2, 0, 16)   # in-place writes would break backward
    with torch.no_grad():
        assert empty_bank(x, capacity=4).storage.shape == (2, 4, 16)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_bank_rounds_each_source_once_and_mixes_in_float32(dtype):
    """Against the oracle on the rounded sources (the partial stays float32): only float32 rounding
    is left, so the mix agrees to float32 precision before its final cast."""
    sources, w, gain = random_case(4, tokens=(3, 5))
    query = fold_queries(w[None].float(), gain[None].float())[0]
    with torch.no_grad():
        stored = empty_bank(sources[0].float(), capacity=3, dtype=dtype)
        for source in sources[:3]:
            stored = push_source(stored, source.float(), EPS)
        assert stored.sources.dtype == dtype and stored.inv_rms.dtype == torch.float32
        out, weights = mix_site(stored, sources[3].float(), query, EPS, torch.float32, keep_weights=True)
    rounded = [s.to(dtype).double() for s in sources[:3]] + [sources[3].float().double()]
    expected, probs = naive_mix(rounded, query.double(), torch.ones(16, dtype=torch.float64), EPS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.double(), probs.movedim(0, -1), rtol=1e-5, atol=1e-6)


def test_bank_dtype_choice():
    expected = {("auto", torch.bfloat16): torch.bfloat16, ("auto", torch.float16): torch.float16,
                ("auto", torch.float32): torch.float32, ("auto", torch.float64): torch.float64,
                ("float32", torch.bfloat16): torch.float32, ("float32", torch.float64): torch.float64}
    for (choice, model_dtype), dtype in expected.items():
        assert bank_dtype(choice, model_dtype) == dtype, (choice, model_dtype)
    with pytest.raises(ValueError, match="'bfloat16'"):
        bank_dtype("bfloat16", torch.bfloat16)


@pytest.mark.parametrize("schedule", [dict(attn_res_block_size=2), dict(attn_res_mode="full")])
def test_site_bank_has_room_for_every_source_of_the_schedule(monkeypatch, schedule):
    """Room for exactly the sources the schedule stores (in Full AttnRes the last MLP output too: one short,
    and the last store would copy the whole bank to grow it)."""
    import modeling_attnres.depth_attention_ops as ops
    from modeling_attnres import AttnResConfig

    config = AttnResConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=5, num_attention_heads=2,
                           attn_res_bank_dtype="auto", **schedule)
    embeds = torch.zeros(2, 3, 16, dtype=torch.bfloat16)
    stored = sum(site.closes_block for site in config.depth_sites)             # independent of num_stored
    with torch.no_grad():
        monkeypatch.setattr(ops, "cpu_kernel_applies", lambda x: False)  # the C++ kernel off (it is on by default)
        bank = site_bank(embeds, config)              # eager torch on a CPU: "auto" keeps float32
        assert bank.storage.shape == (2, 3, stored, 16) and bank.storage.dtype == torch.float32
        assert bank.inv_storage.dtype == torch.float32 and bank.num_stored == 0
        monkeypatch.setattr(ops, "cpu_kernel_applies", lambda x: True)   # a fused reader: the model's dtype
        assert site_bank(embeds, config).storage.dtype == torch.bfloat16
        config.attn_res_bank_dtype = "float32"
        assert site_bank(embeds, config).storage.dtype == torch.float32


@pytest.mark.parametrize("kernel", [False, True])
def test_site_push_stores_the_partial_on_each_backend(monkeypatch, kernel):
    """`site_push`, the unfused block store (`site_mix`'s sibling), on the torch path and the C++ kernel: a
    closing site stores the partial rounded to the bank's dtype with its inverse RMS and starts a new partial;
    another site passes both through."""
    import modeling_attnres.depth_attention_ops as ops

    if not kernel:
        monkeypatch.setattr(ops, "cpu_kernel_applies", lambda x: False)
    sources, _, _ = random_case(3, dtype=torch.float32)
    partial = sources[2]
    with torch.no_grad():
        bank = empty_bank(partial, capacity=3, dtype=torch.bfloat16)
        for source in sources[:2]:
            bank = push_source(bank, source, EPS)
        assert ops.site_push(bank, partial, False, EPS) == (bank, partial)
        pushed, new_partial = ops.site_push(bank, partial, True, EPS)
    rounded = partial.to(torch.bfloat16)
    assert new_partial is None and pushed.num_stored == 3
    assert torch.equal(pushed.sources[..., 2, :], rounded)
    expected = 1 / torch.sqrt(rounded.double().pow(2).mean(-1) + EPS)
    torch.testing.assert_close(pushed.inv_rms[..., 2], expected.float())
