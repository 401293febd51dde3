"""The fused CPU kernel vs the float64 oracle and the torch reference, and when the model uses it."""

import json
import os
import subprocess
import sys

import pytest
import torch

import modeling_attnres.depth_attention_cpu as cpu
from modeling_attnres.depth_attention import empty_bank, fold_queries, mix_site, push_source
from modeling_attnres.depth_attention_ops import site_bank, site_mix
from tests.oracle import naive_forward, naive_mix
from tests.support.models import tiny_config, tiny_model

EPS = 1e-6

@pytest.fixture(scope="module", autouse=True)
def kernel():
    state = cpu._enabled, cpu._in_graphs
    cpu.enable_cpu_kernel()          # builds on first use (~35 s), then torch's extension cache
    yield
    cpu._enabled, cpu._in_graphs = state


def case(n_stored, tokens, d, dtype=torch.float64, seed=0, room=0, bank_dtype=None):
    """A bank of `n_stored` sources (with `room` more rows preallocated, sources kept in `bank_dtype`),
    a partial and a folded query; the oracle's sources list (as stored) too."""
    gen = torch.Generator().manual_seed(seed)
    sources = torch.randn(n_stored + 1, *tokens, d, generator=gen, dtype=torch.float64) * 3
    w, gain = torch.randn(d, generator=gen, dtype=torch.float64), 1 + 0.5 * torch.randn(d, generator=gen,
                                                                                         dtype=torch.float64)
    sources = sources.to(dtype)
    with torch.no_grad():
        bank = empty_bank(sources[-1], n_stored + room if room else 0, bank_dtype)
        for source in sources[:-1]:
            bank = push_source(bank, source, EPS)
    query = fold_queries(w[None].to(dtype), gain[None].to(dtype))[0]
    stored = [s.to(bank.storage.dtype).double() for s in sources[:-1]] + [sources[-1].double()]
    return bank, sources[-1], query, (stored, w, gain)


# d = 300: not a multiple of the kernel's 64-lane reductions; 40 tokens: split across threads (and prefetched).
@pytest.mark.parametrize("tokens,d", [((1,), 16), ((2, 3), 16), ((40,), 16), ((2, 1), 300)])
@pytest.mark.parametrize("n_stored", [0, 1, 3, 4, 5, 8, 33])
def test_fused_mix_matches_oracle_in_float64(n_stored, tokens, d):
    bank, partial, query, oracle = case(n_stored, tokens, d, seed=n_stored)
    with torch.no_grad():
        out, weights = cpu.fused_mix_site(bank, partial, query, EPS, torch.float64, keep_weights=True)
    expected, probs = naive_mix(*oracle, EPS)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, probs.movedim(0, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype,out_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                 (torch.bfloat16, torch.bfloat16, 2e-2),
                                                 (torch.float16, torch.float16, 5e-3)])
def test_fused_mix_matches_the_torch_reference(dtype, out_dtype, tol):
    bank, partial, query, oracle = case(8, (3, 5), 64, dtype=dtype, seed=1)
    with torch.no_grad():
        out, weights = cpu.fused_mix_site(bank, partial, query, EPS, out_dtype, keep_weights=True)
        ref, ref_weights = mix_site(bank, partial, query, EPS, out_dtype, keep_weights=True)
    assert out.dtype == ref.dtype == out_dtype and weights.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    sources, _, _ = oracle                            # the oracle on the same low-precision inputs and query
    expected, _ = naive_mix(sources, query.double(), torch.ones_like(query, dtype=torch.float64), EPS)
    torch.testing.assert_close(out, expected.to(out_dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens", [(1,), (2, 3), (40,)])
@pytest.mark.parametrize("n_stored", [0, 3])
@pytest.mark.parametrize("dtype,bank_dtype", [(torch.float64, None), (torch.float32, None),
                                              (torch.float32, torch.bfloat16), (torch.float32, torch.float16)])
def test_fused_push_source_writes_in_place_what_push_source_stores(dtype, bank_dtype, n_stored, tokens):
    bank, partial, _, _ = case(n_stored, tokens, 48, dtype=dtype, seed=n_stored, room=2, bank_dtype=bank_dtype)
    copy = bank._replace(storage=bank.storage.clone(), inv_storage=bank.inv_storage.clone())
    with torch.no_grad():
        fused = cpu.fused_push_source(bank, partial, EPS)
        ref = push_source(copy, partial, EPS)
    assert fused.storage is bank.storage and fused.num_stored == ref.num_stored == n_stored + 1   # in place
    assert torch.equal(fused.sources, ref.sources)                     # one rounding each: exact
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(fused.inv_rms, ref.inv_rms, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_an_all_zero_source_scores_zero_with_eps_zero(dtype):
    """With eps = 0, all-zero rows (a stored source, a new partial that closes a block) score 0 and are stored
    with an inverse RMS of 0, as the torch path does (docs/spec.md), not 0 * inf."""
    bank, partial, query, (stored, w, gain) = case(3, (2, 3), 300, dtype=dtype, seed=11, room=2)
    zero_rows = torch.ones(2, 3, 1, dtype=dtype)
    zero_rows[1], zero_rows[0, 2] = 0, 0
    partial = partial * zero_rows[..., 0, None]                     # the partial of four tokens
    bank.storage[0, 1, 1] = stored[1][0, 1] = 0                     # a stored source of one token
    bank.inv_storage[..., :3] = bank.sources.pow(2).mean(-1).rsqrt().nan_to_num(posinf=0)    # as pushed with eps 0
    with torch.no_grad():
        got = cpu.fused_site_boundary(bank, None, partial, query, 0.0, True, None, 0.0, dtype, keep_weights=True)
        ref = mix_site(bank, partial, query, 0.0, dtype, keep_weights=True)
    expected, probs = naive_mix(stored[:-1] + [partial.double()], w, gain, 0.0)      # `stored` ends with the partial
    tol = 1e-12 if dtype == torch.float64 else 5e-5              # float32: as the low-precision bank's test
    assert got.mixed.isfinite().all() and got.weights.isfinite().all()
    torch.testing.assert_close(got.mixed.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(got.weights.double(), probs.movedim(0, -1), rtol=tol, atol=tol)
    torch.testing.assert_close(got.weights, ref[1], rtol=tol, atol=tol)
    assert torch.equal(got.bank.inv_rms[..., 3] == 0, zero_rows[..., 0] == 0)           # stored with 0, not inf


@pytest.mark.parametrize("bank_dtype,tol", [(torch.bfloat16, 5e-5), (torch.float16, 5e-5)])
def test_a_low_precision_preallocated_bank_matches_the_oracle_in_float32(bank_dtype, tol):
    """A bank read as float32 from bf16/fp16 storage: against the oracle on the same rounded sources only
    float32 rounding is left (the output stays float32 here, so no final cast either). That rounding is up to a
    few 1e-5 here: scores of about +-20 carry float32 errors of ~1e-6, which the peaked softmax passes on to
    outputs of 3-9 (torch's own float32 path is 3.4e-5 off the oracle on the float16 case), and the kernel's
    summation order, hence its error, depends on the CPU's vector width."""
    bank, partial, query, (stored, _, _) = case(5, (7, 3), 300, dtype=torch.float32, seed=7, room=3,
                                                bank_dtype=bank_dtype)
    assert bank.storage.dtype == bank_dtype and bank.storage.shape[-2] == 8 and bank.num_stored == 5
    with torch.no_grad():
        out, weights = cpu.fused_mix_site(bank, partial, query, EPS, torch.float32, keep_weights=True)
    expected, probs = naive_mix(stored, query.double(), torch.ones(300, dtype=torch.float64), EPS)
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(weights.double(), probs.movedim(0, -1), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gain_folded_in_cpp_equals_fold_queries(dtype):
    bank, partial, _, _ = case(5, (2, 3), 48, dtype=torch.float32, seed=5)
    gen = torch.Generator().manual_seed(5)
    w, gain = torch.randn(1, 48, generator=gen).to(dtype), torch.randn(48, generator=gen).to(dtype)
    with torch.no_grad():
        folded, _ = cpu.fused_mix_site(bank, partial, fold_queries(w, gain[None])[0], EPS, dtype)
        unfolded, _ = cpu.fused_mix_site(bank, partial, w, EPS, dtype, gain=gain)
    assert torch.equal(folded, unfolded)


def test_mismatched_shapes_are_refused():
    bank, partial, query, _ = case(3, (2,), 16, dtype=torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not match partial"):
        cpu.fused_mix_site(bank, partial[..., :8], query[:8], EPS, torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match="does not match partial"):
        cpu.fused_mix_site(bank, partial, query, EPS, torch.float32, gain=torch.ones(1))


def test_a_bank_of_other_tokens_with_the_same_count_is_refused():
    """A bank built for [3, 2] tokens read with a [2, 3] partial would mix each token with another token's
    sources: every entry point compares the token shape, not only the element count."""
    bank, partial, query, _ = case(2, (3, 2), 16, dtype=torch.float32, room=1)
    other = partial.reshape(2, 3, 16)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match=r"does not match partial \[2, 3, 16\]"):
            cpu.fused_mix_site(bank, other, query, EPS, torch.float32)
        with pytest.raises(RuntimeError, match="does not match partial"):
            cpu.fused_site_boundary(bank, other, other.clone(), query, EPS, True, torch.ones(16), EPS, torch.float32)
        with pytest.raises(RuntimeError, match="does not match partial"):
            cpu.fused_push_source(bank, other, EPS)
        with pytest.raises(RuntimeError, match="does not match partial"):   # a flattened partial as well
            cpu.fused_mix_site(bank, partial.reshape(6, 16), query, EPS, torch.float32)
        mixed, _ = cpu.fused_mix_site(bank, partial, query, EPS, torch.float32)   # the matching shape runs
    assert mixed.shape == partial.shape


def test_non_contiguous_partial_and_large_scores():
    bank, partial, query, oracle = case(4, (6, 2), 32, dtype=torch.float32, seed=2)
    strided = partial.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    with torch.no_grad():
        out, _ = cpu.fused_mix_site(bank, strided, query * 1e4, EPS, torch.float32)
        ref, _ = mix_site(bank, partial, query * 1e4, EPS, torch.float32)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_the_kernel_applies_only_to_cpu_inference():
    x = torch.zeros(2, 4)
    assert torch.is_grad_enabled() and not cpu.cpu_kernel_applies(x)   # grad mode: the torch path
    with torch.no_grad():
        assert cpu.cpu_kernel_applies(x)
    with torch.inference_mode():
        assert cpu.cpu_kernel_applies(x)
    with torch.enable_grad():
        assert not cpu.cpu_kernel_applies(x)            # training keeps the differentiable torch path
    cpu.enable_cpu_kernel(False)
    try:
        with torch.no_grad():
            assert not cpu.cpu_kernel_applies(x)
    finally:
        cpu.enable_cpu_kernel()


def test_the_default_bank_is_the_models_dtype_where_the_kernel_reads_it():
    """docs/model.md's `attn_res_bank_dtype="auto"`: a bfloat16 model's completed blocks are stored in bfloat16 where
    a fused reader reads them (the kernel, or vLLM's ranks, which agree on it before any forward), in float32 on the
    eager torch path on a CPU; `"float32"` always keeps float32."""
    embeds = torch.zeros(1, 3, 32, dtype=torch.bfloat16)
    auto, wide = tiny_config(), tiny_config(attn_res_bank_dtype="float32")
    assert auto.attn_res_bank_dtype == "auto"
    with torch.no_grad():
        assert site_bank(embeds, auto).storage.dtype == torch.bfloat16                  # the kernel applies
        assert site_bank(embeds, wide).storage.dtype == torch.float32
        cpu.enable_cpu_kernel(False)
        try:
            assert site_bank(embeds, auto).storage.dtype == torch.float32               # the eager torch path
            assert site_bank(embeds, auto, same_on_every_rank=True).storage.dtype == torch.bfloat16
        finally:
            cpu.enable_cpu_kernel()
    assert site_bank(embeds, auto).storage.dtype == torch.float32                       # autograd: torch path


@pytest.mark.parametrize("in_graphs", [False, True])
def test_torch_compile_calls_the_kernel_as_a_custom_op_only_when_asked(in_graphs):
    """With `compiled=True` the site traces through `attnres::mix_site` and its fake implementation
    (`fullgraph=True` fails on a graph break); by default a compiled graph keeps Inductor's code for the
    site (faster there). Either way the result equals the torch reference."""
    bank, partial, _, _ = case(3, (2, 5), 64, dtype=torch.float32, seed=8, room=1, bank_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    proj, gain = torch.randn(1, 64, generator=gen).bfloat16(), torch.randn(64, generator=gen).bfloat16()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    site = torch.compile(lambda *a: site_mix(*a, keep_weights=True), backend=backend, fullgraph=True)
    cpu.enable_cpu_kernel(compiled=in_graphs)
    try:
        with torch.no_grad():
            out, weights = site(bank, partial, proj, gain, EPS)
    finally:
        cpu.enable_cpu_kernel()
    with torch.no_grad():
        ref, ref_weights = mix_site(bank, partial, fold_queries(proj, gain[None])[0], EPS, torch.bfloat16, True)
    calls_op = any("attnres.mix_site" in str(node.target) for gm in graphs for node in gm.graph.nodes)
    assert calls_op == in_graphs
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)   # one bf16 ulp: the final cast
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["block", "full"])
def test_model_with_the_kernel_matches_the_torch_path(mode, dtype):
    model = tiny_model(seed=3, dtype=dtype, attn_res_mode=mode)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fused = model(ids, output_depth_attentions=True)
        fused_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        cpu.enable_cpu_kernel(False)
        try:
            ref = model(ids, output_depth_attentions=True)
            ref_tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        finally:
            cpu.enable_cpu_kernel()
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2                 # bfloat16: measured 4.9e-3 at logits <= 0.39
    torch.testing.assert_close(fused.logits.float(), ref.logits.float(), rtol=tol, atol=tol)
    if dtype == torch.bfloat16:      # both against the exact answer: the kernel's rounding no worse than torch's
        exact = naive_forward({k: v.double() for k, v in model.state_dict().items()}, model.config, ids)
        def error(logits):
            return float((logits.double() - exact).abs().max() / exact.abs().max())
        assert error(fused.logits) <= 1.25 * error(ref.logits) + 1e-3, (error(fused.logits), error(ref.logits))
    # bfloat16 with the default bank ("auto"): the kernel stores blocks in bfloat16, the eager torch
    # path in float32 (`site_bank`), and every later site reads inputs that already differ by that
    # rounding, carried through bfloat16 layers: weights to the logits' bfloat16 tolerance. float32:
    # the same bank, only summation order differs.
    weight_tol = 1e-5 if dtype == torch.float32 else tol
    for a, b in zip(fused.depth_attentions, ref.depth_attentions, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4 if dtype == torch.float32 else tol, atol=weight_tol)
    if dtype == torch.float32:
        assert torch.equal(fused_tokens, ref_tokens)
    else:
        # bf16 rounds both paths differently, so a near tie may be broken either way: every token the
        # kernel chose must be the torch path's argmax or within the logit tolerance of it, scored by
        # the torch path on the kernel's own sequence.
        cpu.enable_cpu_kernel(False)
        try:
            with torch.no_grad():
                scored = model(fused_tokens).logits[:, ids.shape[1] - 1:-1].float()
        finally:
            cpu.enable_cpu_kernel()
        chosen = scored.gather(-1, fused_tokens[:, ids.shape[1]:, None]).squeeze(-1)
        assert (scored.amax(-1) - chosen <= tol * scored.abs().amax()).all(), (fused_tokens, ref_tokens)


def test_the_model_writes_its_own_partials_in_place_and_never_the_callers_embedding():
    """Past layer 0 a layer's boundaries write the new partial into the partial they were given (the
    forward's own, made by an earlier boundary), so a layer that closes no block returns the very tensor it
    received; the caller's float32 `inputs_embeds` (block 0) is never written. The logits are those of
    the torch path."""
    model = tiny_model(seed=5, attn_res_mode="block", attn_res_block_size=3)
    sites = model.config.depth_sites
    seen = []
    hooks = [layer.register_forward_hook(lambda _, args, out, i=i: seen.append((i, args[3], out[2])))   # partials
             for i, layer in enumerate(model.model.layers)]
    embeds = torch.randn(2, 6, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    given = embeds.clone()
    try:
        with torch.no_grad():
            fused = model(inputs_embeds=embeds).logits
            cpu.enable_cpu_kernel(False)
            ref = model(inputs_embeds=embeds).logits
    finally:
        cpu.enable_cpu_kernel()
        for hook in hooks:
            hook.remove()
    assert torch.equal(embeds, given)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    in_place = [i for i, received, returned in seen[:len(model.model.layers)]
                if i > 0 and received is not None and not sites[2 * i].closes_block
                and not sites[2 * i + 1].closes_block]
    assert in_place, [(s.index, s.closes_block) for s in sites]            # the case this test is about
    for i, received, returned in seen[:len(model.model.layers)]:
        assert (returned is received) == (i in in_place), (i, sites[2 * i], sites[2 * i + 1])


def test_a_layer_writes_only_a_partial_that_an_earlier_boundary_of_its_forward_made():
    """The rule both models follow (vLLM's layer has the same line): a layer given a partial and no output
    to add (a pipeline stage's first layer, its partial received) passes it through sites that close no
    block and never writes it; given an output too (the partial came from the layer before) it writes
    the new partial into it; under gradient checkpointing in training, whose recomputation reads the
    layer's inputs again, it never does."""
    model = tiny_model(seed=6, attn_res_mode="block", attn_res_block_size=3)
    layer, sites = model.model.layers[1], model.config.depth_sites[2:4]
    assert not any(site.closes_block for site in sites) and sites[0].num_stored == 1
    gen = torch.Generator().manual_seed(6)
    embeds, received, output = (torch.randn(1, 5, model.config.hidden_size, generator=gen) for _ in range(3))
    positions = torch.arange(5)[None]
    kwargs = dict(position_ids=positions, position_embeddings=model.model.rotary_emb(embeds, positions))

    def run(partial, output):
        given = partial.clone()
        with torch.no_grad():
            bank = push_source(site_bank(embeds, model.config), embeds, model.config.rms_norm_eps)
            _, _, returned, _ = layer(*bank, partial, output, **kwargs)
        return returned is partial, torch.equal(partial, given)

    assert run(received, None) == (False, True)                        # passed through, then a fresh partial
    assert run(received.clone(), output) == (True, False)              # written in place
    model.gradient_checkpointing_enable()
    model.train()
    assert run(received.clone(), output) == (False, True)
    model.gradient_checkpointing_disable()


def test_training_forward_keeps_the_torch_path_and_its_gradients():
    model = tiny_model(seed=4).train()
    ids = torch.randint(0, model.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
    model(ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "res_proj" in n]
    assert grads and all(g is not None for g in grads)


# Off first: those checks then run before anything in the process could have built or loaded the kernel.
ENVIRONMENT_VALUES = {"0": (False, False), "off": (False, False), "false": (False, False), " Off ": (False, False),
                      None: (True, False), "1": (True, False),
                      "compiled": (True, True)}      # ATTNRES_CPU_KERNEL -> (on in eager, in compiled graphs)
ENVIRONMENT_CHILD = """
import importlib, json, os, sys
import torch
seen, cpu = [], None
for value in json.loads(sys.argv[1]):
    os.environ.pop("ATTNRES_CPU_KERNEL", None)
    if value is not None:
        os.environ["ATTNRES_CPU_KERNEL"] = value
    if cpu is None:
        import modeling_attnres.depth_attention_cpu as cpu
    else:
        cpu = importlib.reload(cpu)                  # the module reads the variable when it is executed
    with torch.no_grad():
        seen.append([cpu.cpu_kernel_applies(torch.zeros(1)), cpu._in_graphs, cpu._module is None])
print(json.dumps(seen))
"""


def test_environment_variable_at_import_and_the_default():
    """Unset, the kernel is on (loaded from torch's cache here: the fixture built it, so nothing is
    logged); `0`/`off` turn it off without building or loading anything. Each value is read as the
    module executes: one process imports it, then reloads it under each further value (a process each
    would cost an import of torch and transformers per value)."""
    env = {key: item for key, item in os.environ.items() if key != "ATTNRES_CPU_KERNEL"}
    out = subprocess.run([sys.executable, "-c", ENVIRONMENT_CHILD, json.dumps(list(ENVIRONMENT_VALUES))], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    for value, (eager, in_graphs), seen in zip(ENVIRONMENT_VALUES, ENVIRONMENT_VALUES.values(),
                                               json.loads(out.stdout), strict=True):
        assert seen == [eager, in_graphs, not eager], (value, seen)
    assert "AttnRes" not in out.stderr                     # no build, no failure: nothing to say


def test_an_unknown_value_of_a_kernel_switch_is_named_and_the_default_kept():
    """A typo (`compile` for `compiled`) would otherwise pass for "on" without a word."""
    code = ("import json, modeling_attnres.depth_attention_cpu as cpu, modeling_attnres.depth_attention_triton as tri; "
            "print(json.dumps([cpu._enabled, cpu._in_graphs, tri._enabled, tri._in_graphs]))")
    env = {**os.environ, "ATTNRES_CPU_KERNEL": "compile", "ATTNRES_TRITON_KERNEL": "yes please"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == [True, False, True, False]
    assert "ATTNRES_CPU_KERNEL='compile' is not a known value" in out.stderr
    assert "ATTNRES_TRITON_KERNEL='yes please' is not a known value" in out.stderr


def test_each_source_builds_under_its_own_name(monkeypatch):
    """Two versions of the kernel (an installed package and an older checkpoint's remote code) build under two
    names in torch's extension cache, so that neither rebuilds over the other; one source keeps one name."""
    name = cpu._extension_name()
    assert name == cpu._extension_name() and name.startswith("attnres_depth_attention_cpu_")
    monkeypatch.setattr(cpu, "KERNEL_SOURCE", cpu.KERNEL_SOURCE + "\n// another version\n")
    assert cpu._extension_name() != name


def test_each_torch_installation_builds_under_its_own_name(monkeypatch):
    """Two environments (two torch installations) sharing one home directory keep a build each: the build
    command names torch's headers, so one shared name would make each rebuild over the other in turn."""
    name = cpu._extension_name()
    monkeypatch.setattr(torch, "__file__", "/another/venv/lib/python3.11/site-packages/torch/__init__.py")
    assert cpu._extension_name() != name
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".another")
    assert cpu._extension_name() != name


def test_a_failed_build_says_what_is_missing(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu, "_module", None)
    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    with pytest.raises(RuntimeError, match=r"C\+\+ compiler .* `ninja` .*ATTNRES_CPU_KERNEL"):
        cpu.enable_cpu_kernel()


FAKE_NINJA = '#!/bin/sh\necho "$@" >> "$0.called"\nexit 1\n'     # fails, and records that it was run
LOAD_KERNEL = """
import logging
logging.basicConfig()
import modeling_attnres.depth_attention_cpu as cpu
cpu.enable_cpu_kernel()
print(cpu._module is not None)
"""


def test_the_build_runs_the_packages_ninja_whatever_comes_first_on_path(tmp_path):
    """torch's builder runs the first `ninja` on PATH. The kernel's build puts the ninja package's first, so
    that how Python was started (a virtual environment activated or not) neither breaks the build (no ninja on
    PATH: `.venv/bin/python` run directly on a machine without a system ninja) nor alternates two ninja
    versions, each of which took the other's build for a changed command and rebuilt it (30-100 s a process).
    Here PATH's first ninja fails and records its calls: the kernel (built by the fixture) loads from torch's
    cache without calling it and without a rebuild."""
    fake = tmp_path / "ninja"
    fake.write_text(FAKE_NINJA)
    fake.chmod(0o755)
    env = {key: item for key, item in os.environ.items() if key != "ATTNRES_CPU_KERNEL"}
    env["PATH"] = os.pathsep.join([str(tmp_path), os.environ.get("PATH", "")])
    out = subprocess.run([sys.executable, "-c", LOAD_KERNEL], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split() == ["True"], out.stderr[-3000:]
    assert not (tmp_path / "ninja.called").exists(), (tmp_path / "ninja.called").read_text()
    assert "AttnRes" not in out.stderr                 # loaded, not rebuilt (nor failed): nothing to say


def test_a_user_install_of_ninja_is_found_where_the_environment_has_none(monkeypatch):
    """`pip install --user` puts ninja in the user scheme's scripts folder: used when the interpreter's own has
    none; with neither, PATH is left as it is (torch then finds the system's, or says ninja is missing)."""
    import shutil
    import sysconfig

    user = sysconfig.get_path("scripts", f"{os.name}_user")
    monkeypatch.setattr(shutil, "which", lambda name, path=None: f"{user}/ninja" if path == user else None)
    with cpu._package_ninja_first():
        assert os.environ["PATH"].split(os.pathsep)[0] == user
    before = os.environ.get("PATH")
    monkeypatch.setattr(shutil, "which", lambda name, path=None: None)
    with cpu._package_ninja_first():
        assert os.environ.get("PATH") == before
    assert os.environ.get("PATH") == before


VLLM_WITH_KERNEL = """
import json, sys
from torch.profiler import ProfilerActivity, profile
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", kv_cache_memory_bytes=32 << 20,
          max_model_len=64, seed=0)
params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
# The graphs call the ops' C++ kernels through the dispatcher, with no Python in between: the profiler,
# which records every dispatched op by name, is what sees them.
with profile(activities=[ProfilerActivity.CPU]) as prof:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in json.loads(sys.argv[2])], params, use_tqdm=False)
calls = sum(e.count for e in prof.key_averages() if e.key.startswith("attnres::"))
print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
print(f"KERNEL_CALLS {calls}")
"""


@pytest.mark.timeout(900)
def test_vllm_compiled_with_the_kernel_op_generates_the_torch_paths_tokens(tmp_path):
    """An in-process vLLM engine, compiled (vLLM's piecewise CPU graphs), with ATTNRES_CPU_KERNEL=compiled: the
    boundaries run as `attnres::site_boundary[_store]` inside the graphs. In float32 the two paths' logits differ by
    rounding (~1e-6), far below the gaps between a random model's top logits, so the greedy tokens
    must equal those of the transformers model on the torch path exactly."""
    from attnres.serving.random_model import write_tiny_checkpoint
    from modeling_attnres import AttnResForCausalLM

    path = write_tiny_checkpoint(tmp_path / "ckpt", seed=5, attn_res_block_size=1)
    prompts = [[5, 9, 14, 3, 7], [11, 4]]
    cpu.enable_cpu_kernel(False)
    try:
        model = AttnResForCausalLM.from_pretrained(path).eval()
        with torch.no_grad():
            expected = [model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
                        for p in prompts]
    finally:
        cpu.enable_cpu_kernel()
    env = {**os.environ, "ATTNRES_CPU_KERNEL": "compiled", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache"), "VLLM_DISABLE_COMPILE_CACHE": "1"}
    log = tmp_path / "vllm.log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-c", VLLM_WITH_KERNEL, str(path), json.dumps(prompts)], env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=800, start_new_session=True)
    text = log.read_text()
    assert done.returncode == 0, text[-4000:]
    tokens = json.loads(next(line for line in text.splitlines() if line.startswith("TOKENS "))[7:])
    assert tokens == expected
    calls = int(next(line for line in text.splitlines() if line.startswith("KERNEL_CALLS "))[13:])
    assert calls > 0, "the sites never reached the C++ kernel inside vLLM's compiled graphs"


# Each boundary op as compiled graphs call it: (op, a block closes, an output is added, the partial is reused).
BOUNDARY_FORMS = [("site_boundary", False, True, False), ("site_boundary", False, False, False),
                  ("site_boundary_store", True, True, False), ("site_boundary_store", True, False, False),
                  ("site_boundary_reuse", False, True, True), ("site_boundary_into", False, True, False),
                  ("site_boundary_store_into", True, True, False), ("site_boundary_reuse_into", False, True, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,closes,adds,reuses", BOUNDARY_FORMS)
def test_each_boundary_op_agrees_with_its_schema_and_fake(name, closes, adds, reuses, dtype):
    """torch.library.opcheck: the declared writes are the only writes, and the fake (shape-only) results,
    which compiled graphs are traced with, have the kernel's shapes and dtypes."""
    cpu._build().register_ops()
    bank, partial, query, _ = case(2, (3,), 32, dtype=torch.float32, seed=4, room=1)
    gen = torch.Generator().manual_seed(5)
    output = torch.randn(3, 32, generator=gen).to(dtype) if adds else None
    gain, norm_weight = 1 + torch.rand(32, generator=gen).to(dtype), torch.rand(32, generator=gen).to(dtype)
    args = (bank.storage, bank.inv_storage, 2, partial.clone(), output, query.to(dtype), gain, EPS, norm_weight, 1e-5)
    torch.library.opcheck(getattr(torch.ops.attnres, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
