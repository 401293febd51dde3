"""The Triton kernels vs the float64 oracle and the torch reference, and when the models use them.

CI has no GPU: the kernels run on the CPU under Triton's interpreter (`TRITON_INTERPRET=1`). The
variable must be set before Triton is first imported, and must not reach other tests, so one
subprocess (`_worker`, started once for the module) runs every kernel call on inputs this process
built and saved, and saves what the kernels returned; the tests here compare those results with
`tests/oracle.naive_mix` in float64 and with the torch path (`mix_site`, `push_source`, the model).

Tolerances (stated per test) follow from the dtypes: float64 end to end agrees to 1e-12; a float32
accumulation over at most 34 sources to ~1e-6 of the largest source; a result rounded to a
bfloat16/float16 output to one unit in its last place (`finfo(dtype).eps` relative).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

import modeling_attnres.depth_attention_triton as tri
from modeling_attnres.depth_attention import DepthBank, empty_bank, fold_queries, mix_site, push_source, rms_norm
from modeling_attnres.depth_attention import site_boundary as reference_boundary
from modeling_attnres.depth_attention_ops import site_backend, site_boundary
from tests.oracle import naive_mix
from tests.support.models import tiny_model

EPS = 1e-6
REPO = Path(__file__).resolve().parents[2]
F64, F32, BF16, F16 = torch.float64, torch.float32, torch.bfloat16, torch.float16

# (stored sources, token shape, hidden size, fold the gain in the kernel): every n in 0..5 and 8, 33;
# hidden sizes that are no power of two (masked tails) and 1.
ORACLE_CASES = [(n, tokens, d, gain) for n, tokens, d, gain in [
    (0, (1,), 1, False), (0, (2, 3), 7, True), (1, (1,), 33, False), (2, (2, 3), 7, True), (3, (4,), 300, True),
    (4, (1,), 1, True), (5, (2, 1), 33, False), (8, (3,), 300, False), (33, (1,), 7, True), (33, (2,), 300, False),
]]
# (stored sources, hidden size, chunk width): the chunked kernel for rows wider than a program holds.
CHUNKED_CASES = [(0, 33, 16), (5, 300, 64), (33, 7, 4)]
DTYPE_CASES = [(bank, part, out) for bank in (F32, BF16, F16) for part in (F32, BF16, F16) for out in (F32, BF16, F16)]
PUSH_CASES = [(bank, part, n, d) for bank, part in [(F64, F64), (F32, F32), (F32, BF16), (BF16, F32), (F16, F32),
                                                     (BF16, BF16)] for n, d in [(0, 7), (3, 300)]]
MODEL_CASES = [("block", F32), ("full", BF16)]
# Sublayer boundaries (model dtype, bank dtype, stored sources, hidden size, form, closes a block, keep the
# mix and weights): every form of input (after a sublayer, after a closed block, the first site's embedding).
BOUNDARY_CASES = [(dtype, bank, n, d, form, closes, keep) for (dtype, bank), n, d, form, closes, keep in [
    ((F64, F64), 0, 33, "first", True, True), ((F64, F64), 3, 300, "add", False, True),
    ((F64, F64), 3, 7, "closed", True, True), ((F64, F64), 5, 33, "add", True, False),
    ((F32, F32), 0, 33, "first", False, True), ((F32, F32), 3, 300, "add", True, True),
    ((F32, F32), 2, 33, "closed", False, False), ((BF16, BF16), 0, 33, "first", True, False),
    ((BF16, BF16), 3, 33, "add", True, True), ((BF16, BF16), 4, 300, "closed", False, True),
    ((BF16, F32), 3, 33, "add", False, True), ((BF16, F32), 2, 7, "first", True, True),
    ((F16, F16), 3, 33, "add", True, True), ((F16, F16), 1, 33, "closed", False, False),
]]
BOUNDARY_IDS = [f"{str(t)[6:]}-bank-{str(b)[6:]}-n{n}-d{d}-{f}-{'closes' if c else 'open'}-{'keep' if k else 'bare'}"
                for t, b, n, d, f, c, k in BOUNDARY_CASES]


def make_boundary(dtype, bank_dtype, n: int, d: int, form: str, seed: int, room: int = 2):
    """A boundary's inputs: a bank of `n` sources (room to spare), `(partial, output)` in the given form,
    a pseudo-query `[1, d]`, a key-norm gain and the next sublayer's norm weight (in the model's dtype)."""
    acc_dtype = F64 if dtype == F64 else F32
    bank, partial, w, gain = make_case(n, (2, 3), d, bank_dtype, acc_dtype, seed=seed, room=room)
    gen = torch.Generator().manual_seed(seed + 1000)
    output = (torch.randn(2, 3, d, generator=gen, dtype=F64) * 3).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(d, generator=gen, dtype=F64)).to(dtype)
    partial, output = {"add": (partial, output), "closed": (None, output), "first": (output, None)}[form]
    return bank, partial, output, w[None].to(dtype), gain.to(dtype), norm_weight
MODEL = dict(seed=3, num_hidden_layers=3)        # 7 sites: the interpreter runs each program in Python


def make_case(n: int, tokens: tuple, d: int, bank_dtype=F64, part_dtype=F64, seed: int = 0, room: int = 2):
    """A bank of `n` sources (stored by the torch `push_source`, with `room` rows to spare, so that
    `bank.sources` is a strided view), a partial, a pseudo-query `w` and a key-norm gain."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(n + 1, *tokens, d, generator=gen, dtype=F64) * 3
    w = torch.randn(d, generator=gen, dtype=F64)
    gain = 1 + 0.5 * torch.randn(d, generator=gen, dtype=F64)
    partial = values[-1].to(part_dtype)
    with torch.no_grad():
        bank = empty_bank(partial, n + room, bank_dtype)
        for value in values[:-1]:
            bank = push_source(bank, value.to(part_dtype), EPS)
    return bank, partial, w, gain


def zero_rows_case():
    """As `make_case` (float64, 3 sources, room for 2 more), pushed with eps = 0, with all-zero rows: one token's
    second stored source, and four tokens' partial."""
    gen = torch.Generator().manual_seed(140)
    values = torch.randn(4, 2, 3, 33, generator=gen, dtype=F64) * 3
    values[1, 0, 1] = values[3, 1] = values[3, 0, 2] = 0
    with torch.no_grad():
        bank = empty_bank(values[3], 5, F64)
        for value in values[:3]:
            bank = push_source(bank, value, 0.0)
    return bank, values[3], torch.randn(33, generator=gen, dtype=F64), 1 + 0.5 * torch.randn(33, generator=gen,
                                                                                              dtype=F64)


def oracle(bank: DepthBank, partial: torch.Tensor, w: torch.Tensor, gain: torch.Tensor, eps: float = EPS):
    """`naive_mix` in float64 over the sources as stored (already rounded to the bank's dtype)."""
    sources = list(bank.sources.double().movedim(-2, 0)) + [partial.double()]
    mixed, probs = naive_mix(sources, w.double(), gain.double(), eps)
    return mixed, probs.movedim(0, -1)


def wider(x: torch.Tensor) -> torch.Tensor:
    """`x` as a view into rows twice as wide (a column slice): a row stride of 2 d, which a reshape keeps."""
    rows = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype)
    rows[..., : x.shape[-1]] = x
    return rows[..., : x.shape[-1]]


def all_jobs() -> dict:
    """Every kernel call the worker makes, by name: the inputs and the arguments."""
    jobs = {}
    for i, (n, tokens, d, gain) in enumerate(ORACLE_CASES):
        bank, partial, w, g = make_case(n, tokens, d, seed=i)
        jobs[f"oracle{i}"] = dict(kind="mix", bank=bank, partial=partial, dtype=F64, keep=True,
                                  query=w if gain else w * g, gain=g if gain else None)
    for i, (n, d, chunk) in enumerate(CHUNKED_CASES):
        bank, partial, w, g = make_case(n, (2,), d, seed=10 + i)
        jobs[f"chunked{i}"] = dict(kind="mix", bank=bank, partial=partial, dtype=F64, keep=True, query=w, gain=g,
                                   chunk=chunk)
    for i, (bank_dtype, part_dtype, out) in enumerate(DTYPE_CASES):
        bank, partial, w, g = make_case(5, (3,), 33, bank_dtype, part_dtype, seed=20 + i)
        jobs[f"dtype{i}"] = dict(kind="mix", bank=bank, partial=partial, dtype=out, keep=i % 2 == 0,
                                 query=(w * g).float(), gain=None)
    bank, partial, w, g = make_case(4, (6, 2), 32, F32, F32, seed=50)
    jobs["strided"] = dict(kind="mix", bank=bank, partial=partial.transpose(0, 1).contiguous().transpose(0, 1),
                           dtype=F32, keep=True, query=(w * g * 1e3).float(), gain=None)   # large scores too
    bank, partial, w, g = make_case(3, (6,), 33, F32, F32, seed=55)
    jobs["sliced"] = dict(kind="mix", bank=bank, partial=wider(partial), dtype=F32, keep=True, query=w.float(),
                          gain=g.float())
    bank, partial, output, w, gain, norm_weight = make_boundary(F32, F32, 3, 33, "add", seed=56)
    jobs["boundary_sliced"] = dict(kind="boundary", bank=bank, partial=wider(partial), output=wider(output), proj=w,
                                   gain=gain, norm_weight=norm_weight, dtype=F32, closes=False, keep=True)
    for i, (bank_dtype, part_dtype, n, d) in enumerate(PUSH_CASES):
        bank, partial, _, _ = make_case(n, (2, 3), d, bank_dtype, part_dtype, seed=60 + i)
        jobs[f"push{i}"] = dict(kind="push", bank=bank, partial=partial)
    bank, partial, _, _ = make_case(3, (2,), 16, F32, F32, seed=80, room=0)
    jobs["push_full"] = dict(kind="push", bank=bank, partial=partial)      # no room left: concatenation
    for i, (dtype, bank_dtype, n, d, form, closes, keep) in enumerate(BOUNDARY_CASES):
        bank, partial, output, w, gain, norm_weight = make_boundary(dtype, bank_dtype, n, d, form, seed=90 + i)
        jobs[f"boundary{i}"] = dict(kind="boundary", bank=bank, partial=partial, output=output, proj=w, gain=gain,
                                    norm_weight=norm_weight, dtype=dtype, closes=closes, keep=keep)
    for name, room, chunk in (("boundary_full", 0, None), ("boundary_wide", 2, 16)):   # the separate kernels
        bank, partial, output, w, gain, norm_weight = make_boundary(BF16, BF16, 3, 33, "add", seed=120, room=room)
        jobs[name] = dict(kind="boundary", bank=bank, partial=partial, output=output, proj=w, gain=gain,
                          norm_weight=norm_weight, dtype=BF16, closes=True, keep=True, chunk=chunk)
    for name, chunk in (("zeros_mix", None), ("zeros_mix_chunked", 16)):        # all-zero rows with eps = 0
        bank, partial, w, g = zero_rows_case()
        jobs[name] = dict(kind="mix", bank=bank, partial=partial, dtype=F64, keep=True, query=w, gain=g, chunk=chunk,
                          eps=0.0)
    bank, partial, _, _ = zero_rows_case()
    jobs["zeros_push"] = dict(kind="push", bank=bank, partial=partial, eps=0.0)
    bank, partial, w, g = zero_rows_case()
    jobs["zeros_boundary"] = dict(kind="boundary", bank=bank, partial=None, output=partial, proj=w[None], gain=g,
                                  norm_weight=torch.ones(33, dtype=F64), dtype=F64, closes=True, keep=True, eps=0.0)
    return jobs


def boundary_chain(bank, embeds, outputs, params):
    """Three boundaries from the embedding (closing, open, closing), through the op wrapper."""
    partial, output, normed = embeds, None, []
    for closes, output_next, (w, gain, norm_weight) in zip((True, False, True), outputs, params, strict=True):
        b = site_boundary(bank, partial, output, w, gain, EPS, closes, norm_weight, EPS)
        bank, partial, output = b.bank, b.partial, output_next
        normed.append(b.normed)
    return normed, bank.sources


def model_and_ids(mode: str, dtype: torch.dtype):
    model = tiny_model(dtype=dtype, attn_res_mode=mode, **MODEL)
    return model, torch.randint(3, model.config.vocab_size, (2, 3), generator=torch.Generator().manual_seed(3))


def _worker(jobs_path: str, results_path: str) -> None:
    """Run in a subprocess with TRITON_INTERPRET=1: every job through the kernels, the dispatcher's
    choices, and the tiny models (whose sites dispatch to the kernels here)."""
    assert tri._interpreting()
    results = {}
    torch.set_grad_enabled(False)
    for name, job in torch.load(jobs_path, weights_only=False).items():
        eps = job.get("eps", EPS)
        if job["kind"] == "push":
            bank = job["bank"]
            pushed = tri.triton_push_source(bank, job["partial"], eps)
            results[name] = (pushed, pushed.storage.data_ptr() == bank.storage.data_ptr())
            continue
        tri._MAX_BLOCK_D, tri._CHUNK_D = (job["chunk"], job["chunk"]) if job.get("chunk") else (16384, 4096)
        if job["kind"] == "boundary":
            storage = job["bank"].storage
            got = tri.triton_site_boundary(job["bank"], job["partial"], job["output"], job["proj"], eps, job["closes"],
                                           job["norm_weight"], EPS, job["dtype"], keep_weights=job["keep"],
                                           keep_mixed=job["keep"], gain=job["gain"])
            results[name] = (got, got.bank.storage.data_ptr() == storage.data_ptr())
            continue
        results[name] = tri.triton_mix_site(job["bank"], job["partial"], job["query"], eps, job["dtype"],
                                            keep_weights=job["keep"], gain=job["gain"])
    tri._MAX_BLOCK_D, tri._CHUNK_D = 16384, 4096
    # The boundary op inside a compiled graph (aot_eager: the interpreter's kernels run on the CPU, where
    # Inductor would not launch Triton): the same results as eager, the ops in the graph.
    gen = torch.Generator().manual_seed(130)
    embeds = torch.randn(2, 3, 33, generator=gen).bfloat16()
    outputs = torch.randn(3, 2, 3, 33, generator=gen).bfloat16()
    params = [(torch.randn(1, 33, generator=gen).bfloat16(), (1 + 0.2 * torch.randn(33, generator=gen)).bfloat16(),
               (1 + 0.2 * torch.randn(33, generator=gen)).bfloat16()) for _ in range(3)]
    eager = boundary_chain(empty_bank(embeds.float(), 2, BF16), embeds, outputs, params)
    graphs = []
    backend = aot_autograd(fw_compiler=lambda gm, example_inputs: graphs.append(gm.code) or gm.forward)
    tri.enable_triton_kernel(compiled=True)
    compiled = torch.compile(boundary_chain, backend=backend, fullgraph=True)(
        empty_bank(embeds.float(), 2, BF16), embeds, outputs, params)
    tri.enable_triton_kernel()
    results["compiled_boundary"] = (eager, compiled, "\n".join(graphs))
    x = torch.zeros(2, 4)
    with torch.enable_grad():
        results["backend_grad"] = site_backend(x)
    results["backend_no_grad"] = site_backend(x)
    results["backend_compiled"] = torch.compile(lambda t: site_backend(t), backend="eager", fullgraph=True)(x)
    calls = []
    ops = sys.modules["modeling_attnres.depth_attention_ops"]
    for name in ("triton_mix_site", "triton_site_boundary"):           # a site alone, or a whole boundary
        real = getattr(tri, name)
        setattr(ops, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    for mode, dtype in MODEL_CASES:
        model, ids = model_and_ids(mode, dtype)
        out = model(ids, output_depth_attentions=True)
        sites = len(calls)
        tokens = model.generate(ids, max_new_tokens=2, do_sample=False)
        results[f"model_{mode}_{dtype}"] = (out.logits, out.depth_attentions, tokens, sites)
        calls.clear()
    torch.save(results, results_path)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The jobs (built here) and the kernels' results (from one interpreter subprocess)."""
    folder = tmp_path_factory.mktemp("triton")
    jobs = all_jobs()
    torch.save(jobs, folder / "jobs.pt")
    env = {**os.environ, "TRITON_INTERPRET": "1", "ATTNRES_CPU_KERNEL": "0", "ATTNRES_TRITON_KERNEL": "1"}
    code = (f"from tests.modeling_attnres.test_depth_attention_triton import _worker; "
            f"_worker({str(folder / 'jobs.pt')!r}, {str(folder / 'results.pt')!r})")
    with open(folder / "worker.log", "w") as log:
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=240)
    assert proc.returncode == 0, (folder / "worker.log").read_text()[-5000:]
    return jobs, torch.load(folder / "results.pt", weights_only=False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("i", range(len(ORACLE_CASES)), ids=[f"n{n}-tokens{t}-d{d}-gain{g}" for n, t, d, g in
                                                             ORACLE_CASES])
def test_mix_matches_the_oracle_in_float64(ran, i):
    jobs, results = ran
    job = jobs[f"oracle{i}"]
    out, weights = results[f"oracle{i}"]
    gain = job["gain"] if job["gain"] is not None else torch.ones_like(job["query"])
    expected, probs = oracle(job["bank"], job["partial"], job["query"], gain)
    assert out.dtype == weights.dtype == F64 and out.shape == job["partial"].shape
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)        # float64 end to end
    torch.testing.assert_close(weights, probs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("i", range(len(CHUNKED_CASES)), ids=[f"n{n}-d{d}-chunk{c}" for n, d, c in CHUNKED_CASES])
def test_the_chunked_kernel_for_wide_rows_matches_the_oracle(ran, i):
    jobs, results = ran
    job = jobs[f"chunked{i}"]
    out, weights = results[f"chunked{i}"]
    expected, probs = oracle(job["bank"], job["partial"], job["query"], job["gain"])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, probs, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("i", range(len(DTYPE_CASES)), ids=[f"bank-{str(b)[6:]}-partial-{str(p)[6:]}-out-{str(o)[6:]}"
                                                            for b, p, o in DTYPE_CASES])
def test_mix_in_every_dtype_matches_the_oracle_and_the_torch_path(ran, i):
    jobs, results = ran
    job = jobs[f"dtype{i}"]
    out, weights = results[f"dtype{i}"]
    bank, partial, dtype = job["bank"], job["partial"], job["dtype"]
    assert out.dtype == dtype and (weights is None) == (not job["keep"])
    expected, probs = oracle(bank, partial, job["query"], torch.ones_like(job["query"]))
    with torch.no_grad():
        ref, ref_weights = mix_site(bank, partial, job["query"], EPS, dtype, keep_weights=True)
    # float32 accumulation: ~1e-6 of the largest source; the cast to `dtype`: one ulp (two vs the
    # torch path, which rounds its own float32 result).
    scale = float(bank.sources.abs().max().clamp(min=1))
    eps_out = torch.finfo(dtype).eps if dtype != F32 else 0.0
    torch.testing.assert_close(out.double(), expected, rtol=eps_out, atol=2e-6 * scale)
    torch.testing.assert_close(out.double(), ref.double(), rtol=2 * eps_out, atol=2e-6 * scale)
    if weights is not None:
        assert weights.dtype == F32
        torch.testing.assert_close(weights.double(), probs, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_rows_of_another_stride_are_read_where_they_are(ran):
    """A partial (and a sublayer output) that is a column slice of wider rows: the kernels take its row stride."""
    jobs, results = ran
    job = jobs["sliced"]
    assert job["partial"].stride(0) == 2 * job["partial"].shape[-1]
    out, weights = results["sliced"]
    with torch.no_grad():
        ref, ref_weights = mix_site(job["bank"], job["partial"], fold_queries(job["query"][None], job["gain"][None])[0],
                                    EPS, F32, keep_weights=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)
    job = jobs["boundary_sliced"]
    got, _ = results["boundary_sliced"]
    with torch.no_grad():
        query = fold_queries(job["proj"], job["gain"][None])[0]
        ref = reference_boundary(job["bank"], job["partial"], job["output"], query, EPS, False, job["norm_weight"],
                                 EPS, F32, keep_weights=True, keep_mixed=True)
    assert torch.equal(got.partial, ref.partial)
    torch.testing.assert_close(got.normed, ref.normed, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got.mixed, ref.mixed, rtol=1e-5, atol=3e-5)


def test_strided_inputs_and_large_scores(ran):
    jobs, results = ran
    job = jobs["strided"]
    assert not job["partial"].is_contiguous() and not job["bank"].sources.is_contiguous()
    out, weights = results["strided"]
    with torch.no_grad():
        ref, ref_weights = mix_site(job["bank"], job["partial"], job["query"], EPS, F32, keep_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("i", range(len(PUSH_CASES)), ids=[f"bank-{str(b)[6:]}-partial-{str(p)[6:]}-n{n}-d{d}"
                                                           for b, p, n, d in PUSH_CASES])
def test_push_source_stores_in_place_like_the_torch_path(ran, i):
    jobs, results = ran
    job = jobs[f"push{i}"]
    pushed, in_place = results[f"push{i}"]
    bank, partial = job["bank"], job["partial"]
    with torch.no_grad():
        ref = push_source(DepthBank(bank.storage.clone(), bank.inv_storage.clone(), bank.num_stored), partial, EPS)
    assert in_place and pushed.num_stored == ref.num_stored == bank.num_stored + 1
    assert pushed.sources.dtype == bank.storage.dtype and pushed.inv_rms.dtype == bank.inv_storage.dtype
    assert torch.equal(pushed.sources[..., :-1, :], bank.sources)              # earlier rows untouched
    new = pushed.sources[..., -1, :]
    assert torch.equal(new, ref.sources[..., -1, :])          # the partial rounded to the bank's dtype, once
    expected_inv = torch.rsqrt(new.double().pow(2).mean(-1) + EPS)          # of the value as stored
    tol = 1e-12 if bank.inv_storage.dtype == F64 else 1e-6
    torch.testing.assert_close(pushed.inv_rms[..., -1].double(), expected_inv, rtol=tol, atol=0)
    torch.testing.assert_close(pushed.inv_rms[..., :-1], bank.inv_rms)


def test_push_source_into_a_full_bank_grows_it(ran):
    jobs, results = ran
    job = jobs["push_full"]
    pushed, in_place = results["push_full"]
    with torch.no_grad():
        ref = push_source(job["bank"], job["partial"], EPS)
    assert not in_place and pushed.num_stored == 4
    torch.testing.assert_close(pushed.sources, ref.sources, rtol=0, atol=0)
    torch.testing.assert_close(pushed.inv_rms, ref.inv_rms, rtol=1e-6, atol=0)


def test_the_dispatcher_picks_triton_for_inference_only(ran):
    _, results = ran
    # Under the interpreter CPU tensors count as a Triton device; a GPU's are chosen by the same rule.
    assert results["backend_no_grad"] == "triton"
    assert results["backend_grad"] == "torch"            # autograd: the differentiable torch path
    assert results["backend_compiled"] == "torch"        # torch.compile fuses the torch code itself
    with torch.no_grad():
        assert site_backend(torch.zeros(2, 4)) != "triton"  # here, without the interpreter: never on the CPU


def test_the_interpreter_switch_and_the_off_switch_are_read_when_deciding(monkeypatch):
    x = torch.zeros(3)
    with torch.no_grad():
        assert not tri.triton_applies(x)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert tri.triton_applies(x)
        tri.enable_triton_kernel(False)
        try:
            assert not tri.triton_applies(x)
        finally:
            tri.enable_triton_kernel()
        monkeypatch.setattr(tri, "_AVAILABLE", False)     # Triton not installed: never
        assert not tri.triton_applies(x)
    assert not tri.triton_applies(torch.zeros(3, device="meta"))


@pytest.mark.parametrize("mode,dtype", MODEL_CASES, ids=[f"{m}-{str(d)[6:]}" for m, d in MODEL_CASES])
def test_models_whose_sites_run_the_kernels_match_the_torch_path(ran, mode, dtype):
    _, results = ran
    logits, depth_attentions, tokens, sites = results[f"model_{mode}_{dtype}"]
    model, ids = model_and_ids(mode, dtype)
    assert sites == 2 * model.config.num_hidden_layers + 1          # every site of the forward ran the kernel
    with torch.no_grad():
        ref = model(ids, output_depth_attentions=True)
        ref_tokens = model.generate(ids, max_new_tokens=2, do_sample=False)
    # bfloat16: a mix may round to the neighbouring bfloat16 (float32 sums in another order), a few ulps at the end
    tol, weights_tol = (1e-5, 1e-5) if dtype == F32 else (3e-2, 1e-3)
    torch.testing.assert_close(logits.float(), ref.logits.float(), rtol=tol, atol=tol)
    for a, b in zip(depth_attentions, ref.depth_attentions, strict=True):
        torch.testing.assert_close(a, b, rtol=weights_tol, atol=weights_tol)
    if dtype == F32:
        assert torch.equal(tokens, ref_tokens)                          # greedy decoding through the kernels


def test_a_missing_triton_says_what_to_do(monkeypatch):
    monkeypatch.setattr(tri, "_kernels", None)
    monkeypatch.setitem(sys.modules, "triton", None)                    # `import triton` raises ImportError
    bank, partial, w, _ = make_case(1, (1,), 4, F32, F32)
    with pytest.raises(RuntimeError, match=r"pip install triton.*torch path"):
        tri.triton_mix_site(bank, partial, w.float(), EPS, F32)


def test_mismatched_shapes_are_refused():
    bank, partial, w, _ = make_case(2, (2,), 8, F32, F32)
    with pytest.raises(ValueError, match=r"do not match partial \(2, 4\)"):
        tri.triton_mix_site(bank, partial[..., :4], w[:4].float(), EPS, F32)
    with pytest.raises(ValueError, match="must have 8 elements"):
        tri.triton_mix_site(bank, partial, w[:4].float(), EPS, F32)


@pytest.mark.parametrize("i", range(len(BOUNDARY_CASES)), ids=BOUNDARY_IDS)
def test_the_boundary_kernel_matches_the_reference_and_the_oracle(ran, i):
    """One kernel per boundary: the stored block and the new partial exactly as the torch reference (the
    bfloat16 rounding is done by hand, to nearest even, also under the interpreter); float64 mixes and
    weights to the oracle at 1e-12; the normed output (a float32 norm) and low-precision mixes within
    float32 accuracy and one or two units in the last place of the model's dtype."""
    jobs, results = ran
    job = jobs[f"boundary{i}"]
    got, in_place = results[f"boundary{i}"]
    bank, partial, output, dtype = job["bank"], job["partial"], job["output"], job["dtype"]
    with torch.no_grad():
        ref = reference_boundary(DepthBank(bank.storage.clone(), bank.inv_storage.clone(), bank.num_stored), partial,
                                 output, fold_queries(job["proj"], job["gain"][None])[0], EPS, job["closes"],
                                 job["norm_weight"], EPS, dtype, keep_weights=True, keep_mixed=True)
    assert in_place and got.bank.num_stored == ref.bank.num_stored == bank.num_stored + job["closes"]
    assert torch.equal(got.bank.sources, ref.bank.sources) and got.bank.sources.dtype == bank.storage.dtype
    torch.testing.assert_close(got.bank.inv_rms, ref.bank.inv_rms, rtol=1e-12 if dtype == F64 else 1e-6, atol=0)
    assert (got.partial is None) == (ref.partial is None) == job["closes"]
    assert job["closes"] or torch.equal(got.partial, ref.partial)
    assert got.normed.dtype == dtype and (got.mixed is None) == (got.weights is None) == (not job["keep"])
    ulp = torch.finfo(dtype).eps if dtype in (BF16, F16) else 0.0
    # float32 sums in another order: ~1e-6 of the largest source (|x| < 20) in the mix, times the norm's
    # 1 / rms (a mix of few large sources can be small) and the weight
    torch.testing.assert_close(got.normed.double(), ref.normed.double(), rtol=2 * ulp + 1e-6, atol=1e-4)
    if not job["keep"]:
        return
    if dtype in (BF16, F16):     # the norm reads the mix rounded to the model's dtype: LlamaRMSNorm of it, exactly
        assert torch.equal(got.normed, rms_norm(got.mixed, job["norm_weight"], EPS))
    torch.testing.assert_close(got.mixed.double(), ref.mixed.double(), rtol=ulp + 1e-6, atol=3e-5)
    torch.testing.assert_close(got.weights, ref.weights, rtol=1e-5, atol=1e-6)
    if dtype == F64:
        p = ref.bank.sources[..., -1, :] if job["closes"] else ref.partial
        expected, probs = naive_mix(list(bank.sources.movedim(-2, 0)) + [p], job["proj"][0], job["gain"], EPS)
        torch.testing.assert_close(got.mixed, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got.weights, probs.movedim(0, -1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["zeros_mix", "zeros_mix_chunked", "zeros_boundary"])
def test_an_all_zero_source_scores_zero_with_eps_zero(ran, name):
    """With eps = 0 all-zero rows (a stored source, the partial) score 0, as the oracle says (docs/spec.md), in
    the mix, its chunked form and the boundary; the boundary stores the zero rows with an inverse RMS of 0."""
    jobs, results = ran
    job = jobs[name]
    partial = job["partial"] if job["partial"] is not None else job["output"]
    got = results[name][0] if name == "zeros_boundary" else None
    out, weights = (got.mixed, got.weights) if got is not None else results[name]
    expected, probs = oracle(job["bank"], partial, job["query"] if got is None else job["proj"][0], job["gain"], 0.0)
    assert expected.isfinite().all() and out.isfinite().all()
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, probs, rtol=1e-12, atol=1e-12)
    if got is not None:
        assert torch.equal(got.bank.inv_rms[..., 3] == 0, partial.abs().sum(-1) == 0)


def test_push_source_with_eps_zero_stores_an_all_zero_row_with_an_inverse_rms_of_zero(ran):
    jobs, results = ran
    job = jobs["zeros_push"]
    pushed, in_place = results["zeros_push"]
    with torch.no_grad():
        ref = push_source(DepthBank(job["bank"].storage.clone(), job["bank"].inv_storage.clone(), 3), job["partial"],
                          0.0)
    assert in_place and ref.inv_rms[1, 0, 3] == 0 and ref.inv_rms.isfinite().all()
    torch.testing.assert_close(pushed.inv_rms, ref.inv_rms, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["boundary_full", "boundary_wide"])
def test_a_boundary_without_room_or_too_wide_for_one_program_takes_the_separate_kernels(ran, name):
    jobs, results = ran
    job = jobs[name]
    got, in_place = results[name]
    bank = job["bank"]
    with torch.no_grad():
        ref = reference_boundary(DepthBank(bank.storage.clone(), bank.inv_storage.clone(), bank.num_stored),
                                 job["partial"], job["output"], fold_queries(job["proj"], job["gain"][None])[0], EPS,
                                 True, job["norm_weight"], EPS, BF16, keep_weights=True, keep_mixed=True)
    assert in_place == (name == "boundary_wide")                         # a full bank grows by concatenation
    assert got.bank.num_stored == 4 and torch.equal(got.bank.sources, ref.bank.sources) and got.partial is None
    torch.testing.assert_close(got.mixed.float(), ref.mixed.float(), rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(got.normed.float(), ref.normed.float(), rtol=2 ** -6, atol=1e-5)


def test_the_boundary_op_runs_inside_a_compiled_graph(ran):
    """With `enable_triton_kernel(compiled=True)` the boundaries trace as the ops (the one that stores a
    block declares its write to the bank) and give the eager kernels' results bit for bit."""
    _, results = ran
    (eager, eager_sources), (compiled, compiled_sources), code = results["compiled_boundary"]
    assert code.count("attnres.triton_site_boundary_store") == 2 and code.count("attnres.triton_site_boundary.") == 1
    for a, b in zip(eager + [eager_sources], compiled + [compiled_sources], strict=True):
        assert torch.equal(a, b)
