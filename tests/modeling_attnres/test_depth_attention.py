"""Kernel vs oracle: the shared depth-attention function against the naive per-site mix (float64)."""

import pytest
import torch

from modeling_attnres.depth_attention import (
    DepthBank,
    add_to_partial,
    empty_bank,
    fold_queries,
    group_sites,
    merge_partial,
    mix_site,
    push_source,
    site_group,
    summarize_bank,
)
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


def random_group(n_sites, d=16, seed=0):
    gen = torch.Generator().manual_seed(100 + seed)
    w = torch.randn(n_sites, d, generator=gen, dtype=torch.float64)
    gain = 1 + 0.5 * torch.randn(n_sites, d, generator=gen, dtype=torch.float64)
    return w, gain


@pytest.mark.parametrize("tokens", [(1,), (2, 3), (7,)])
@pytest.mark.parametrize("n_stored", [0, 1, 3, 8, 32])
@pytest.mark.parametrize("n_sites", [1, 4, 24])                           # Full, block 2, block 12
def test_two_phase_group_matches_oracle(n_stored, tokens, n_sites):
    sources, _, _ = random_case(n_stored, tokens=tokens, seed=n_stored) if n_stored else (None, None, None)
    w, gain = random_group(n_sites, seed=n_stored)
    partials = torch.randn(n_sites, *tokens, 16, dtype=torch.float64) * 3
    stored = bank(list(sources) if n_stored else [], partials[0])
    queries = fold_queries(w, gain)
    summary = summarize_bank(stored, queries)
    for row in range(n_sites):                     # each site of the group with its own partial
        expected, _ = naive_mix([*(sources if n_stored else []), partials[row]], w[row], gain[row], EPS)
        out = merge_partial(summary, row, partials[row], queries[row], EPS, torch.float64)
        torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_two_phase_first_site_is_exactly_the_partial_and_keeps_the_query_in_the_graph():
    partial = torch.randn(2, 3, 16)
    queries = torch.randn(2, 16, requires_grad=True)
    summary = summarize_bank(empty_bank(partial), queries)
    out = merge_partial(summary, 1, partial, queries[1], EPS, torch.float32)
    assert torch.equal(out, partial)
    out.sum().backward()
    assert queries.grad is not None and torch.count_nonzero(queries.grad) == 0


def test_two_phase_bf16_and_large_scores():
    sources, w, gain = random_case(5, dtype=torch.bfloat16)
    stored = bank(list(sources[:4]), None)
    queries = fold_queries(w[None].bfloat16() * 1e4, gain[None].bfloat16())
    out = merge_partial(summarize_bank(stored, queries), 0, sources[4], queries[0], EPS, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    expected, _ = naive_mix(list(sources.double()), w.bfloat16().double() * 1e4, gain.bfloat16().double(), EPS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=2e-2)


def test_two_phase_gradients_match_oracle():
    sources, _, _ = random_case(4)
    w, gain = random_group(3)
    queries = fold_queries(w, gain).requires_grad_(True)
    src = sources.clone().requires_grad_(True)
    summary = summarize_bank(bank(list(src[:3])), queries)
    out = sum(merge_partial(summary, row, src[3], queries[row], EPS, torch.float64) for row in range(3))
    (out * torch.arange(16.0, dtype=torch.float64)).sum().backward()
    src2, w2 = sources.clone().requires_grad_(True), (w * gain).clone().requires_grad_(True)
    ones = torch.ones(16, dtype=torch.float64)
    expected = sum(naive_mix(list(src2), w2[row], ones, EPS)[0] for row in range(3))
    (expected * torch.arange(16.0, dtype=torch.float64)).sum().backward()
    torch.testing.assert_close(src.grad, src2.grad)
    torch.testing.assert_close(queries.grad, w2.grad)


@pytest.mark.parametrize("layers, block_size", [(16, 2), (6, 1), (5, 3), (4, 4), (93, 12)])
def test_site_groups_follow_the_spec_schedule(layers, block_size):
    """Replay the spec's pseudo-code, counting stored blocks at every site (layers x 2 + output)."""
    stored_before, n_stored = [], 0
    for layer in range(layers):
        stored_before.append(n_stored)                                     # attention site
        n_stored += layer % block_size == 0
        stored_before.append(n_stored)                                     # MLP site
    stored_before.append(n_stored)                                         # output site
    num_sites = 2 * layers + 1
    spb = 2 * block_size
    assert [site_group(j, spb) for j in range(num_sites)] == stored_before
    groups = [list(group_sites(g, spb, num_sites)) for g in range(stored_before[-1] + 1)]
    assert sum(groups, []) == list(range(num_sites))
    assert all(site_group(j, spb) == g for g, sites in enumerate(groups) for j in sites)


def test_full_attnres_sites_each_read_their_own_bank():
    """Full AttnRes (one sublayer per block): site j reads the embedding and the j - 1 outputs before it."""
    assert [site_group(j, 1) for j in range(9)] == list(range(9))
    assert [list(group_sites(g, 1, 9)) for g in range(9)] == [[g] for g in range(9)]
