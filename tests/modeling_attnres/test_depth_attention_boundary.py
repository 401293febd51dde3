"""The sublayer boundary (`site_boundary`: add, mix, store, the next sublayer's RMSNorm in one call).

The torch reference against the steps the models run today (bit for bit) and against the spec's loop
in float64; the fused C++ kernel against the float64 oracle and the reference in every dtype; its ops
inside compiled graphs (the bank written in place, never copied); and the kernel as the default path
(built at first use, one line of log, a one-line fallback where it cannot build). The Triton kernel's
boundary tests are in `test_depth_attention_triton.py` (they need Triton's interpreter).
"""

import itertools
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import modeling_attnres.depth_attention_cpu as cpu
import modeling_attnres.depth_attention_ops as ops
from modeling_attnres import AttnResConfig
from modeling_attnres.depth_attention import (
    DepthBank,
    acc,
    add_to_partial,
    empty_bank,
    fold_queries,
    mix_site,
    push_block,
    push_source,
    rms_norm,
    site_boundary,
)
from tests.oracle import naive_mix
from tests.oracle import rms_norm as oracle_rms_norm

EPS, NORM_EPS = 1e-6, 1e-5
REPO = Path(__file__).resolve().parents[2]
F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16


@pytest.fixture(scope="module", autouse=True)
def kernel():
    """The kernel built (or loaded from torch's cache) and on, as by default; the state restored after."""
    state = cpu._enabled, cpu._in_graphs
    cpu.enable_cpu_kernel()
    yield
    cpu._enabled, cpu._in_graphs = state


def make(n: int, tokens: tuple, d: int, dtype=F32, bank_dtype=None, seed: int = 0, room: int = 2):
    """A bank of `n` sources with `room` rows to spare (sources kept in `bank_dtype`), a partial in the
    accumulation dtype, a sublayer output, a pseudo-query `[1, d]`, a key-norm gain and a norm weight
    (the last three in `dtype`, the model's)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n + 2, *tokens, d, generator=gen, dtype=F64) * 3
    acc_dtype = F64 if dtype == F64 else F32
    with torch.no_grad():
        bank = empty_bank(values[0].to(acc_dtype), n + room, bank_dtype or acc_dtype)
        for value in values[:n]:
            bank = push_source(bank, value.to(acc_dtype), EPS)
    proj = (torch.randn(1, d, generator=gen, dtype=F64) * d ** -0.5 * 4).to(dtype)
    gain = (1 + 0.5 * torch.randn(d, generator=gen, dtype=F64)).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(d, generator=gen, dtype=F64)).to(dtype)
    return bank, values[n].to(acc_dtype), values[n + 1].to(dtype), proj, gain, norm_weight


def copy(bank: DepthBank) -> DepthBank:
    return DepthBank(bank.storage.clone(), bank.inv_storage.clone(), bank.num_stored)


def inputs(form: str, partial, output):
    """`(partial, output)` of a boundary: after a sublayer (`"add"`), right after a block closed
    (`"closed"`: no partial), or the first site (`"first"`: the embedding, in the model's dtype)."""
    return {"add": (partial, output), "closed": (None, output), "first": (output, None)}[form]


FORMS = ["add", "closed", "first"]


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("closes", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_the_reference_is_the_models_separate_steps_bit_for_bit(form, closes, dtype):
    """add_to_partial, mix_site, push_block and transformers' LlamaRMSNorm module, in the order both
    models run them today: every result identical."""
    bank, partial, output, proj, gain, norm_weight = make(3, (2, 3), 48, dtype, seed=1)
    partial, output = inputs(form, partial, output)
    query = fold_queries(proj, gain[None])[0]
    norm = LlamaRMSNorm(48, eps=NORM_EPS).to(dtype)
    norm.weight.data.copy_(norm_weight)
    with torch.no_grad():
        p = acc(partial) if output is None else add_to_partial(partial, output)
        mixed, weights = mix_site(bank, p, query, EPS, dtype, keep_weights=True)
        expected_bank, expected_partial = push_block(copy(bank), p, closes, EPS)
        expected = norm(mixed)
        got = site_boundary(copy(bank), partial, output, query, EPS, closes, norm.weight, NORM_EPS, dtype,
                            keep_weights=True, keep_mixed=True)
    assert torch.equal(got.normed, expected) and got.normed.dtype == dtype
    assert torch.equal(got.mixed, mixed) and torch.equal(got.weights, weights)
    assert got.bank.num_stored == expected_bank.num_stored == 3 + closes
    assert torch.equal(got.bank.sources, expected_bank.sources) and torch.equal(got.bank.inv_rms, expected_bank.inv_rms)
    assert (got.partial is None) == closes and (closes or torch.equal(got.partial, expected_partial))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [F32, BF16, F16, F64])
def test_rms_norm_is_transformers_and_vllms_rms_norm_bit_for_bit(dtype):
    """`rms_norm` against `LlamaRMSNorm` and vLLM's `RMSNorm` (native and as dispatched on a CPU) with
    the weight in the input's dtype, as both models hold it; and a float32 weight on a low-precision
    input (the promoted result) against transformers."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.layernorm import RMSNorm

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(4, 5, 96, generator=gen) * 7).to(dtype)
    weight = (1 + 0.3 * torch.randn(96, generator=gen)).to(dtype)
    llama = LlamaRMSNorm(96, eps=NORM_EPS).to(dtype)
    llama.weight.data.copy_(weight)
    with set_current_vllm_config(VllmConfig()):
        vllm_norm = RMSNorm(96, eps=NORM_EPS, dtype=dtype)
    vllm_norm.weight.data.copy_(weight)
    with torch.no_grad():
        ours = rms_norm(x, weight, NORM_EPS)
        assert torch.equal(ours, llama(x))
        assert torch.equal(ours, vllm_norm.forward_native(x)) and torch.equal(ours, vllm_norm(x))
        llama.float()
        assert torch.equal(rms_norm(x, llama.weight, NORM_EPS), llama(x))     # float32 weight: promoted


def spec_site_mixes(config: AttnResConfig, embeds: torch.Tensor, outputs: torch.Tensor, proj, gain):
    """Every site's mix by the spec's loops (docs/spec.md sections 3 and 4), float64, `naive_mix` over
    Python lists; `outputs[j]` stands in for sublayer j's output."""
    L, mixes = config.num_hidden_layers, []

    def site(sources, j):
        mixes.append(naive_mix(sources, proj[j][0], gain[j], EPS)[0])

    if config.attn_res_mode == "full":
        sources = [embeds]
        for j in range(2 * L):
            site(sources, j)
            sources.append(outputs[j])
        site(sources, 2 * L)
        return mixes
    k, blocks, partial = config.attn_res_block_size, [], embeds
    for layer in range(L):
        site(blocks + [partial], 2 * layer)
        if layer % k == 0:
            blocks.append(partial)
            partial = None
        partial = outputs[2 * layer] if partial is None else partial + outputs[2 * layer]
        site(blocks + [partial], 2 * layer + 1)
        partial = partial + outputs[2 * layer + 1]
    site(blocks + [partial], 2 * L)
    return mixes


@pytest.mark.parametrize("backend", ["torch", "cpu-kernel"])
@pytest.mark.parametrize("mode,block_size", [("block", 1), ("block", 2), ("block", 3), ("full", 2)])
def test_a_forward_pass_of_boundaries_follows_the_spec(mode, block_size, backend):
    """The boundaries of a 4-layer forward pass, chained as the models will chain them (the output of
    sublayer j enters at boundary j + 1; `config.depth_sites` says which sites close a block), against
    the spec's loop in float64: each site's mix and the RMSNorm the next sublayer reads."""
    config = AttnResConfig(hidden_size=24, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
                           attn_res_mode=mode, attn_res_block_size=block_size)
    sites, d = config.depth_sites, 24
    gen = torch.Generator().manual_seed(block_size)
    embeds = torch.randn(2, 3, d, generator=gen, dtype=F64)
    outputs = torch.randn(len(sites) - 1, 2, 3, d, generator=gen, dtype=F64)
    proj = torch.randn(len(sites), 1, d, generator=gen, dtype=F64)
    gain = 1 + 0.5 * torch.randn(len(sites), d, generator=gen, dtype=F64)
    norm_weight = 1 + 0.3 * torch.randn(len(sites), d, generator=gen, dtype=F64)
    expected = spec_site_mixes(config, embeds, outputs, proj, gain)
    cpu.enable_cpu_kernel(backend == "cpu-kernel")
    try:
        with torch.no_grad():
            bank = empty_bank(embeds, sites[-1].num_stored, F64)
            partial, output = embeds, None
            for site in sites:
                assert ops.site_backend(embeds) == backend
                b = ops.site_boundary(bank, partial, output, proj[site.index], gain[site.index], EPS, site.closes_block,
                                      norm_weight[site.index], NORM_EPS, keep_mixed=True)
                torch.testing.assert_close(b.mixed, expected[site.index], rtol=1e-12, atol=1e-12)
                # transformers' RMSNorm computes in float32 even for a float64 model: float32 rounding
                norm = oracle_rms_norm(expected[site.index].float(), norm_weight[site.index].float(), NORM_EPS)
                torch.testing.assert_close(b.normed, norm.double(), rtol=1e-6, atol=1e-6)
                assert b.bank.num_stored == site.num_stored + site.closes_block
                bank, partial = b.bank, b.partial
                output = outputs[site.index] if site.index < len(outputs) else None
    finally:
        cpu.enable_cpu_kernel()


ORACLE_CASES = list(itertools.product([0, 1, 4, 5, 9], [(1,), (2, 3), (40,)], [16, 300]))


@pytest.mark.parametrize("closes", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n,tokens,d", ORACLE_CASES, ids=[f"n{n}-tokens{t}-d{d}" for n, t, d in ORACLE_CASES])
def test_the_fused_kernel_matches_the_oracle_in_float64(n, tokens, d, form, closes):
    bank, partial, output, proj, gain, norm_weight = make(n, tokens, d, F64, seed=n + d)
    partial, output = inputs(form, partial, output)
    p = partial if output is None else (output if partial is None else partial + output)
    expected, probs = naive_mix(list(bank.sources.movedim(-2, 0)) + [p], proj[0], gain, EPS)
    storage = bank.storage
    with torch.no_grad():
        got = cpu.fused_site_boundary(bank, partial, output, proj, EPS, closes, norm_weight, NORM_EPS, F64,
                                      keep_weights=True, keep_mixed=True, gain=gain)
        ref = site_boundary(copy(bank), partial, output, fold_queries(proj, gain[None])[0], EPS, closes, norm_weight,
                            NORM_EPS, F64)
    torch.testing.assert_close(got.mixed, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.weights, probs.movedim(0, -1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.normed, ref.normed, rtol=1e-6, atol=1e-6)          # a float32 norm: its rounding
    norm = oracle_rms_norm(expected.float(), norm_weight.float(), NORM_EPS).double()
    torch.testing.assert_close(got.normed, norm, rtol=1e-6, atol=1e-6)
    assert got.bank.storage is storage                                             # in place
    assert got.bank.num_stored == n + closes and torch.equal(got.bank.sources[..., :n, :], bank.sources[..., :n, :])
    if closes:
        assert got.partial is None and torch.equal(got.bank.sources[..., n, :], p)
        torch.testing.assert_close(got.bank.inv_rms[..., n], torch.rsqrt(p.pow(2).mean(-1) + EPS), rtol=1e-12, atol=0)
    else:
        assert torch.equal(got.partial, p)
        assert form != "add" or got.partial is not partial                         # a new tensor, the input kept


LOW_CASES = [(F32, None), (BF16, BF16), (BF16, F32), (F16, F16)]


@pytest.mark.parametrize("keep", [False, True])
@pytest.mark.parametrize("closes", [False, True])
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("n", [0, 3, 8])
@pytest.mark.parametrize("dtype,bank_dtype", LOW_CASES, ids=[f"{str(a)[6:]}-bank-{str(b)[6:]}" for a, b in LOW_CASES])
def test_the_fused_kernel_matches_the_torch_reference(dtype, bank_dtype, n, form, closes, keep):
    """Low precision: the stored block and the new partial exactly (one rounding each, or none); the mix
    and the normed output within one or two units in the last place of the model's dtype (float32 sums
    in another order may round to the neighbouring value); weights to float32 accuracy."""
    bank, partial, output, proj, gain, norm_weight = make(n, (5, 7), 136, dtype, bank_dtype, seed=3 * n + keep)
    partial, output = inputs(form, partial, output)
    with torch.no_grad():
        got = cpu.fused_site_boundary(copy(bank), partial, output, proj, EPS, closes, norm_weight, NORM_EPS, dtype,
                                      keep_weights=keep, keep_mixed=keep, gain=gain)
        ref = site_boundary(copy(bank), partial, output, fold_queries(proj, gain[None])[0], EPS, closes, norm_weight,
                            NORM_EPS, dtype, keep_weights=True, keep_mixed=True)
    assert torch.equal(got.bank.sources, ref.bank.sources)
    torch.testing.assert_close(got.bank.inv_rms, ref.bank.inv_rms, rtol=1e-6, atol=0)
    assert (got.partial is None) == (ref.partial is None) == closes
    assert closes or torch.equal(got.partial, ref.partial)
    ulp = 0.0 if dtype == F32 else torch.finfo(dtype).eps
    assert got.normed.dtype == dtype
    # float32 sums in another order: ~1e-6 of the largest source (|x| < 20) in the mix, times the norm's
    # 1 / rms (a mix of few large sources can be small) and the weight
    torch.testing.assert_close(got.normed.float(), ref.normed.float(), rtol=2 * ulp + 1e-5, atol=1e-4)
    assert (got.mixed is None) == (got.weights is None) == (not keep)
    if keep:
        torch.testing.assert_close(got.mixed.float(), ref.mixed.float(), rtol=ulp + 1e-5, atol=3e-5)
        torch.testing.assert_close(got.weights, ref.weights, rtol=1e-5, atol=1e-6)
        # The norm reads the mix it returns, rounded to the model's dtype: LlamaRMSNorm of it, bit for bit (in
        # float32 the kernel's sum of squares may round 1 / rms to the neighbouring value), and the same normed
        # output as a call that does not keep the mix.
        if dtype != F32:
            assert torch.equal(got.normed, rms_norm(got.mixed, norm_weight, NORM_EPS))
        with torch.no_grad():
            bare = cpu.fused_site_boundary(copy(bank), partial, output, proj, EPS, closes, norm_weight, NORM_EPS, dtype,
                                           gain=gain)
        assert torch.equal(bare.normed, got.normed)


def test_what_a_boundary_returns():
    """No norm: the mix is the result. A float32 weight on a bfloat16 mix: the normed output is float32
    (transformers' promotion). Weights `[*tokens, n + 1]` only when kept. Shapes and dtypes as the reference."""
    bank, partial, output, proj, gain, norm_weight = make(4, (2, 3), 40, BF16, BF16, seed=5)
    query = fold_queries(proj, gain[None])[0]
    with torch.no_grad():
        for fn, q, kw in [(cpu.fused_site_boundary, proj, {"gain": gain}), (site_boundary, query, {})]:
            bare = fn(copy(bank), partial, output, q, EPS, False, None, NORM_EPS, BF16, **kw)
            assert bare.normed is None and bare.weights is None and bare.mixed.shape == (2, 3, 40)
            assert bare.mixed.dtype == BF16 and bare.partial.dtype == F32
            promoted = fn(copy(bank), partial, output, q, EPS, True, norm_weight.float(), NORM_EPS, BF16,
                          keep_weights=True, **kw)
            assert promoted.normed.dtype == F32 and promoted.mixed is None and promoted.weights.shape == (2, 3, 5)
        ref = site_boundary(copy(bank), partial, output, query, EPS, True, norm_weight.float(), NORM_EPS, BF16)
    torch.testing.assert_close(promoted.normed, ref.normed, rtol=2 ** -7, atol=1e-5)


def test_a_bank_without_room_grows_as_the_reference_does():
    bank, partial, output, proj, gain, norm_weight = make(3, (2, 3), 32, F32, seed=6, room=0)
    assert bank.storage.shape[-2] == 3
    with torch.no_grad():
        got = cpu.fused_site_boundary(bank, partial, output, proj, EPS, True, norm_weight, NORM_EPS, F32, gain=gain)
        ref = site_boundary(bank, partial, output, fold_queries(proj, gain[None])[0], EPS, True, norm_weight,
                            NORM_EPS, F32)
    assert got.bank.num_stored == 4 and torch.equal(got.bank.sources, ref.bank.sources)
    assert torch.equal(got.normed, ref.normed)


def test_the_op_wrapper_picks_the_backend_and_training_keeps_gradients(monkeypatch):
    """`ops.site_boundary`: the C++ kernel in CPU inference, the reference with autograd recording (and
    with the kernel turned off); gradients reach the pseudo-query, both gains, the partial and the output."""
    bank, partial, output, proj, gain, norm_weight = make(2, (2, 3), 16, F32, seed=7)
    calls = []
    real = ops.fused_site_boundary
    monkeypatch.setattr(ops, "fused_site_boundary", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fused = ops.site_boundary(copy(bank), partial, output, proj, gain, EPS, True, norm_weight, NORM_EPS)
    assert calls == [1]
    leaves = [t.clone().requires_grad_(True) for t in (partial, output, proj, gain, norm_weight)]
    grown = DepthBank(bank.sources, bank.inv_rms, bank.num_stored)     # autograd: the bank grows by cat
    trained = ops.site_boundary(grown, *leaves[:4], EPS, True, leaves[4], NORM_EPS)
    assert calls == [1]
    trained.normed.sum().backward()
    assert all(leaf.grad is not None and leaf.grad.abs().sum() > 0 for leaf in leaves)
    torch.testing.assert_close(trained.normed.detach(), fused.normed, rtol=1e-5, atol=1e-5)
    cpu.enable_cpu_kernel(False)
    try:
        with torch.no_grad():
            off = ops.site_boundary(copy(bank), partial, output, proj, gain, EPS, True, norm_weight, NORM_EPS)
    finally:
        cpu.enable_cpu_kernel()
    assert calls == [1]
    torch.testing.assert_close(off.normed, trained.normed.detach(), rtol=1e-6, atol=1e-6)   # the bank's layout differs


D, T = 64, 5
CLOSES = [True, False, True, False, False]


def boundaries(params, embeds, outs, storage=None, inv_storage=None, n=0):
    """Five boundaries from the embedding (or from a bank passed in, as a vLLM piece receives it), each
    reusing a partial that an earlier boundary made by adding an output, as the models do."""
    bank = empty_bank(embeds, 3, BF16) if storage is None else DepthBank(storage, inv_storage, n)
    partial, output = (embeds, None) if storage is None else (embeds.float(), outs[0])
    normed, owned = [], False
    for j, closes in enumerate(CLOSES):
        b = ops.site_boundary(bank, partial, output, *params[j][:2], EPS, closes, params[j][2], NORM_EPS,
                              reuse_partial=owned)
        bank, partial, output, owned = b.bank, b.partial, outs[j], output is not None
        normed.append(b.normed)
    return normed


@pytest.mark.timeout(600)
@pytest.mark.parametrize("in_graphs", [True, False])
def test_compiled_graphs_write_the_bank_in_place_and_never_copy_it(in_graphs):
    """Inductor's code for a compiled chain of boundaries. With the kernel enabled for graphs, every
    boundary is one call of `attnres::site_boundary[_store|_reuse]`, the bank is allocated once and written
    in place by the ops (no clone, no copy), also when it is an input of the graph (a vLLM piece), and the
    results are the eager kernel's, bit for bit. Otherwise (the default) no op is in the graph."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(8)
    params = [(torch.randn(1, D, generator=gen).bfloat16(), (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16(),
               (1 + 0.1 * torch.randn(D, generator=gen)).bfloat16()) for _ in CLOSES]
    embeds, outs = torch.randn(T, D, generator=gen).bfloat16(), torch.randn(len(CLOSES), T, D, generator=gen).bfloat16()
    with torch.no_grad():
        eager = boundaries(params, embeds, outs)
        bank = empty_bank(embeds, 4, BF16)
        eager_piece = boundaries(params, embeds, outs, bank.storage.clone(), bank.inv_storage.clone())
        torch._dynamo.reset()
        cpu.enable_cpu_kernel(compiled=in_graphs)
        try:
            whole, (code,) = run_and_get_code(torch.compile(boundaries, fullgraph=True), params, embeds, outs)
            storage, inv_storage = bank.storage.clone(), bank.inv_storage.clone()
            piece, (piece_code,) = run_and_get_code(torch.compile(boundaries, fullgraph=True), params, embeds, outs,
                                                    storage, inv_storage)
        finally:
            cpu.enable_cpu_kernel()
    calls = [code.count(f"torch.ops.attnres.{op}.default(")
             for op in ("site_boundary_store", "site_boundary", "site_boundary_reuse")]
    assert calls == ([2, 2, 1] if in_graphs else [0, 0, 0]), code        # the last boundary reuses the partial
    tol = dict(rtol=0, atol=0) if in_graphs else dict(rtol=2 ** -7, atol=1e-2)   # the same C++, or Inductor's sums
    for a, b in zip(whole + piece, eager + eager_piece, strict=True):
        torch.testing.assert_close(a, b, **tol)
    if in_graphs:                                           # the dispatcher reaches the C++ kernel directly
        assert torch._C._dispatch_has_kernel_for_dispatch_key("attnres::site_boundary_store", "CPU")
        code, piece_code = (text[text.index("def call("):text.index("def get_args(")] for text in (code, piece_code))
        assert code.count(f"empty_strided_cpu(({T}, 3, {D})") == 1, code                # the bank, once
        assert f"empty_strided_cpu(({T}, 4, {D})" not in piece_code                      # the input bank: none
        for text in (code, piece_code):                                              # no copy into or out of it
            assert "copy_(" not in text and "clone" not in text and "aten.copy" not in text, text
        assert storage[:, 1].abs().sum() > 0                                         # the input bank, written


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype,bank_dtype", [(F32, None), (BF16, BF16)])
def test_a_reused_partial_takes_the_new_partial_eager_and_compiled_with_the_same_results(dtype, bank_dtype):
    """`reuse_partial=True`: the eager kernel writes the new partial into the partial it was given (the same
    tensor comes back), the compiled op `attnres::site_boundary_reuse` does the same to a graph input with
    no copy in Inductor's code, and both give the results of a boundary that does not reuse, bit for bit.
    A partial that is not contiguous is left alone (a fresh one is returned)."""
    from torch._inductor.utils import run_and_get_code

    bank, partial, output, proj, gain, norm_weight = make(3, (4, 6), 64, dtype, bank_dtype, seed=11)

    def boundary(storage, inv_storage, partial, output):
        return ops.site_boundary(DepthBank(storage, inv_storage, 3), partial, output, proj, gain, EPS, False,
                                 norm_weight, NORM_EPS, reuse_partial=True)

    with torch.no_grad():
        fresh = ops.site_boundary(copy(bank), partial, output, proj, gain, EPS, False, norm_weight, NORM_EPS)
        given = partial.clone()
        eager = boundary(bank.storage, bank.inv_storage, given, output)
        strided = partial.transpose(0, 1).contiguous().transpose(0, 1)         # the same values, transposed
        kept = boundary(bank.storage, bank.inv_storage, strided, output)
        torch._dynamo.reset()
        cpu.enable_cpu_kernel(compiled=True)
        try:
            graph_input = partial.clone()
            compiled, (code,) = run_and_get_code(torch.compile(lambda *a: boundary(*a).normed, fullgraph=True),
                                                 bank.storage, bank.inv_storage, graph_input, output)
        finally:
            cpu.enable_cpu_kernel()
    assert eager.partial is given and torch.equal(given, fresh.partial) and torch.equal(eager.normed, fresh.normed)
    assert kept.partial is not strided and torch.equal(strided, partial) and torch.equal(kept.partial, fresh.partial)
    assert torch.equal(compiled, fresh.normed) and torch.equal(graph_input, fresh.partial)
    code = code[code.index("def call("):code.index("def get_args(")]
    assert code.count("torch.ops.attnres.site_boundary_reuse.default(") == 1, code
    assert "copy_(" not in code and "clone" not in code and "aten.copy" not in code, code


INTO_OPS = {("add", False, True): "site_boundary_reuse_into", ("add", True, False): "site_boundary_store_into",
            ("add", False, False): "site_boundary_into", ("closed", False, False): "site_boundary_into"}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("dtype,bank_dtype", [(F32, None), (BF16, BF16)])
@pytest.mark.parametrize("form,closes,reuse", list(INTO_OPS))
def test_a_consumed_output_takes_the_normed_mix_eager_and_compiled_with_the_same_results(
        dtype, bank_dtype, form, closes, reuse):
    """`consume_output=True` (vLLM's model): the eager kernel writes the normed mix over the sublayer output it
    was given (the same tensor comes back as `.normed`), the compiled op (`attnres::site_boundary[_store|
    _reuse]_into`) does the same to an output the graph computed, with no copy in Inductor's code, and both
    give the bank, partial and normed mix of a boundary that does not consume, bit for bit. An output that is
    not contiguous, or not of the normed mix's dtype, is left alone (a fresh normed mix is returned)."""
    from torch._inductor.utils import run_and_get_code

    bank, partial, output, proj, gain, norm_weight = make(3, (4, 6), 64, dtype, bank_dtype, seed=13)
    partial, output = inputs(form, partial, output)

    def boundary(bank, partial, output, consume=True):
        """The boundary on a copy of `bank` and of `partial` (which `reuse` may overwrite)."""
        given = None if partial is None else partial.clone()
        return ops.site_boundary(bank, given, output, proj, gain, EPS, closes, norm_weight, NORM_EPS,
                                 reuse_partial=reuse, consume_output=consume)

    with torch.no_grad():
        ref_bank, eager_bank, graph_bank = copy(bank), copy(bank), copy(bank)
        fresh = boundary(ref_bank, partial, output, consume=False)
        given = output.clone()
        eager = boundary(eager_bank, partial, given)
        strided = output.transpose(0, 1).contiguous().transpose(0, 1)          # the same values, transposed
        kept = boundary(copy(bank), partial, strided)
        other = output.to(BF16 if dtype == F32 else F32)                      # not the normed mix's dtype
        other_fresh, other_kept = (boundary(copy(bank), partial, other, consume) for consume in (False, True))
        torch._dynamo.reset()
        cpu.enable_cpu_kernel(compiled=True)
        try:
            def graph(storage, inv_storage, partial, output):
                b = boundary(DepthBank(storage, inv_storage, 3), partial, output * 2)   # an output of the graph's
                return b.normed, b.partial

            (normed, new_partial), (code,) = run_and_get_code(torch.compile(graph, fullgraph=True), graph_bank.storage,
                                                              graph_bank.inv_storage, partial, output / 2)
        finally:
            cpu.enable_cpu_kernel()
    assert eager.normed is given and torch.equal(given, fresh.normed)
    for result, result_bank in ((eager, eager_bank), (SimpleNamespace(normed=normed, partial=new_partial), graph_bank)):
        assert torch.equal(result.normed, fresh.normed)
        assert (result.partial is None) == (fresh.partial is None) == closes
        assert closes or torch.equal(result.partial, fresh.partial)
        rows = 3 + closes                                                  # the rows written (the rest: garbage)
        assert torch.equal(result_bank.storage[..., :rows, :], ref_bank.storage[..., :rows, :])
        assert torch.equal(result_bank.inv_storage[..., :rows], ref_bank.inv_storage[..., :rows])
    assert kept.normed is not strided and torch.equal(strided, output) and torch.equal(kept.normed, fresh.normed)
    assert other_kept.normed is not other and torch.equal(other_kept.normed, other_fresh.normed)
    assert torch.equal(other, output.to(other.dtype))
    code = code[code.index("def call("):code.index("def get_args(")]
    assert code.count(f"torch.ops.attnres.{INTO_OPS[form, closes, reuse]}.default(") == 1, code
    assert "copy_(" not in code and "aten.copy" not in code, code


@pytest.mark.timeout(600)
@pytest.mark.parametrize("closes", [False, True])
def test_compiled_boundaries_that_keep_weights_or_the_mix_run_the_reference_in_the_graph(closes):
    """The ops return only what the models read (the new partial, the normed mix). A compiled call that also
    keeps the depth weights and the mix, with the kernel enabled for graphs, runs the torch reference inside
    the graph instead (no `attnres::` op), with the eager kernel's values."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(9)
    bank = empty_bank(torch.zeros(T, D), 4)
    for _ in range(2):
        bank = push_source(bank, torch.randn(T, D, generator=gen), EPS)
    partial, output = torch.randn(T, D, generator=gen), torch.randn(T, D, generator=gen)
    proj, gain, norm = torch.randn(1, D, generator=gen), 1 + 0.1 * torch.randn(D, generator=gen), torch.rand(D)

    def boundary(storage, inv_storage):
        b = ops.site_boundary(DepthBank(storage, inv_storage, 2), partial, output, proj, gain, EPS, closes, norm,
                              NORM_EPS, keep_weights=True, keep_mixed=True)
        return b.normed, b.mixed, b.weights, b.bank.storage[:, : b.bank.num_stored]

    with torch.no_grad():
        eager = boundary(bank.storage.clone(), bank.inv_storage.clone())
        torch._dynamo.reset()
        cpu.enable_cpu_kernel(compiled=True)
        try:
            compiled, (code,) = run_and_get_code(torch.compile(boundary, fullgraph=True), bank.storage.clone(),
                                                 bank.inv_storage.clone())
        finally:
            cpu.enable_cpu_kernel()
    assert "attnres.site_boundary" not in code, code
    assert [t.shape for t in eager] == [(T, D), (T, D), (T, 3), (T, 3 if closes else 2, D)]
    for a, b in zip(compiled, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_default_build_that_fails_falls_back_to_torch_in_one_line(monkeypatch, caplog):
    import torch.utils.cpp_extension as cpp_extension

    attempts = []

    def no_compiler(*args, **kwargs):
        attempts.append(1)
        raise RuntimeError("Ninja is required to load C++ extensions\n(and a second line of compiler output)")

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpu, "_enabled", True)
    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    bank, partial, output, proj, gain, norm_weight = make(2, (2, 3), 16, F32, seed=9)
    with caplog.at_level(logging.WARNING, logger=cpu.__name__), torch.no_grad():
        got = ops.site_boundary(copy(bank), partial, output, proj, gain, EPS, True, norm_weight, NORM_EPS)
        assert not cpu.cpu_kernel_applies(partial) and ops.site_backend(partial) == "torch"
    assert attempts == [1]                                            # tried once per process, not per site
    (record,) = [r for r in caplog.records if r.name == cpu.__name__]
    message = record.getMessage()
    assert "\n" not in message and "could not be built" in message and "Ninja is required" in message
    assert "torch path" in message and "ATTNRES_CPU_KERNEL=0" in message
    ref = site_boundary(copy(bank), partial, output, fold_queries(proj, gain[None])[0], EPS, True, norm_weight,
                        NORM_EPS, F32)
    assert torch.equal(got.normed, ref.normed)


@pytest.mark.parametrize("seconds,logged", [(40.0, True), (0.5, False)])
def test_building_the_kernel_logs_one_line_and_loading_it_none(monkeypatch, caplog, seconds, logged):
    import torch.utils.cpp_extension as cpp_extension

    module, clock = cpu._build(), iter([100.0, 100.0 + seconds])
    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpp_extension, "load_inline", lambda *a, **k: module)
    monkeypatch.setattr(cpu, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    with caplog.at_level(logging.INFO, logger=cpu.__name__):
        assert cpu._build() is module
    messages = [r.getMessage() for r in caplog.records if r.name == cpu.__name__]
    assert len(messages) == logged
    assert not logged or ("built the fused C++ CPU kernel" in messages[0] and "in 40 s" in messages[0]
                          and "\n" not in messages[0])


HOLD_LOCK = """
import sys, time
import modeling_attnres.depth_attention_cpu as cpu
with cpu._build_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(300)                                   # a child interpreter importing torch, on a busy machine
def test_a_build_killed_midway_does_not_block_the_next_one(tmp_path):
    """torch's builder waits forever on a lock file left by a killed build; ours holds an OS lock while
    building, which dies with its holder, and clears such a file once it has the lock."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True, env={**os.environ, "ATTNRES_CPU_KERNEL": "0"})
    try:
        assert holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").write_text("")                              # what torch's killed builder leaves
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        holder.wait(timeout=60)
    start = time.monotonic()
    with cpu._build_lock(str(tmp_path)):
        assert not (tmp_path / "lock").exists()
    assert time.monotonic() - start < 30
