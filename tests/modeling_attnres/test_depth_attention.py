"""Kernel vs oracle: the shared depth-attention functions against the naive per-site mix."""

import pytest
import torch

from modeling_attnres.depth_attention import depth_mix, fold_queries, merge_partial, mix_site, score_stored
from tests.oracle import naive_mix

EPS = 1e-6


def random_case(n, tokens=(2, 3), d=16, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sources = torch.randn(n, *tokens, d, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(d, generator=gen, dtype=torch.float64)
    gain = 1 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
    return sources.to(dtype), w, gain


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_depth_mix_matches_oracle(n):
    sources, w, gain = random_case(n)
    expected, probs = naive_mix(list(sources), w, gain, EPS)
    query = fold_queries(w[None], gain[None])[0]
    out, weights = depth_mix(sources, query, EPS)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.double(), probs.movedim(0, -1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n_stored", [0, 1, 3, 8])
def test_mix_site_stored_plus_partial_matches_oracle(n_stored):
    sources, w, gain = random_case(n_stored + 1, seed=n_stored)
    expected, probs = naive_mix(list(sources), w, gain, EPS)
    query = fold_queries(w[None], gain[None])[0]
    out, weights = mix_site(sources[:n_stored], sources[n_stored], query, EPS, keep_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.double(), probs.movedim(0, -1), rtol=1e-5, atol=1e-6)


def test_grouped_sites_share_one_scoring_pass():
    """Phase 1 for several sites at once, then each site's own partial: equals per-site oracle."""
    stored, _, _ = random_case(4, seed=1)
    gen = torch.Generator().manual_seed(2)
    queries = torch.randn(3, 16, generator=gen, dtype=torch.float64)
    partials = torch.randn(3, 2, 3, 16, generator=gen, dtype=torch.float64)
    group = score_stored(stored, queries.float(), EPS)
    for i in range(3):
        mixed, _ = merge_partial(group.out[i], group.lse[i], partials[i], queries[i].float(), EPS)
        expected, _ = naive_mix(list(stored) + [partials[i]], queries[i], torch.ones(16, dtype=torch.float64), EPS)
        torch.testing.assert_close(mixed, expected, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_mix_in_float32():
    sources, w, gain = random_case(4, dtype=torch.bfloat16)
    expected, _ = naive_mix(list(sources.double()), w, gain, EPS)
    query = fold_queries(w[None], gain[None])[0]
    out, _ = mix_site(sources[:3], sources[3], query, EPS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


def test_zero_query_is_the_mean_of_sources():
    sources, _, gain = random_case(6)
    out, weights = depth_mix(sources, torch.zeros(16), EPS)
    torch.testing.assert_close(out, sources.mean(0))
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 6))


def test_large_scores_do_not_overflow():
    sources, w, gain = random_case(5)
    query = fold_queries(w[None] * 1e4, gain[None])[0]
    out, _ = mix_site(sources[:4], sources[4], query, EPS)
    assert torch.isfinite(out).all()
    expected, _ = naive_mix(list(sources), w * 1e4, gain, EPS)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
