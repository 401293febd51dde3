"""The benchmark scripts behind `make bench` run end to end at a tiny size, and what makes their ratios
trustworthy holds in what they print: an A/A control beside every ratio (finite, with its spread), the
pairs the ratios come from, token counts that were checked equal, and headers that name the machine,
the versions and every setting. Timings are never asserted: they depend on the machine.
"""

import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from tests.support.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402
import fused_llama  # noqa: E402

TINY = ["--hidden-size", "128", "--num-hidden-layers", "4", "--num-attention-heads", "2",   # head_dim 64:
        "--num-key-value-heads", "1", "--intermediate-size", "256", "--vocab-size", "256"]  # vLLM CPU attention
SPREAD = re.compile(r"\*\*(\d+\.\d+)\*\* \((\d+\.\d+)-(\d+\.\d+)\)")
HEADER = ("machine: ", "versions: ", "date: ", "command: ", "settings: ")
STEP_ORDER = ["env", "kernel", "transformers", "transformers-compiled", "vllm"]


def run(script: str, *args: str, timeout: float = 600, env: dict | None = None) -> str:
    done = run_bounded([sys.executable, str(ROOT / "bench" / script), *args], timeout=timeout, cwd=ROOT,
                       env={**os.environ, **(env or {})})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text`, as rows of `{column: cell}`."""
    found, lines = [], text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and (i == 0 or not lines[i - 1].startswith("|")) and i + 1 < len(lines) \
                and lines[i + 1].startswith("|---"):
            head = [c.strip() for c in line.strip("|").split("|")]
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(head, (c.strip() for c in row.strip("|").split("|")))))
            found.append(rows)
    return found


def spread(cell: str) -> tuple[float, float, float]:
    """`**median** (min-max)`, checked: finite, positive, min <= median <= max."""
    found = SPREAD.fullmatch(cell)
    assert found, f"not a ratio with its spread: {cell!r}"
    median, low, high = map(float, found.groups())
    assert all(math.isfinite(x) and x > 0 for x in (median, low, high)) and low <= median <= high, cell
    return median, low, high


def assert_header(text: str, *settings: str) -> None:
    """The machine, versions, date, command and settings are printed, and the settings name `settings`."""
    lines = text.splitlines()
    for start in HEADER:
        assert any(line.startswith(start) for line in lines), f"no {start!r} line:\n{text}"
    machine = next(line for line in lines if line.startswith("machine: "))
    assert "AMX bfloat16: " in machine and "load average at the start" in machine, machine
    assert any(line.startswith("load average at the end: ") for line in lines), text
    setting_line = next(line for line in lines if line.startswith("settings: "))
    for word in settings:
        assert word in setting_line, f"{word!r} not in {setting_line!r}"


def column(row: dict[str, str], prefix: str) -> str:
    """The cell of the one column whose name starts with `prefix`."""
    names = [name for name in row if name.startswith(prefix)]
    assert len(names) == 1, (prefix, list(row))
    return row[names[0]]


# -- the rules themselves, in bench/common.py -----------------------------------------------------------------


@pytest.mark.parametrize("kinds", [["a", "b"], ["a", "b", "c"], ["a", "b", "c", "d"]])
def test_rotation_puts_every_runner_first_equally_often_and_reverses_within_a_pair(kinds):
    orders = [common.rotation(kinds, r) for r in range(2 * len(kinds))]
    assert all(sorted(order) == kinds for order in orders)
    assert {k: sum(order[0] == k for order in orders) for k in kinds} == dict.fromkeys(kinds, 2)
    assert all(orders[r + 1] == orders[r][::-1] for r in range(0, len(orders), 2))
    assert common.balanced(2 * len(kinds), len(kinds)) and not common.balanced(3, len(kinds))
    if len(kinds) == 2:
        assert orders == [["a", "b"], ["b", "a"], ["b", "a"], ["a", "b"]]                  # A B B A


def test_rotate_runs_shares_fresh_inputs_warms_up_at_size_and_refuses_unequal_work():
    seen = []

    def runner(name, extra=0):
        def run(batch):
            seen.append((name, batch))
            return len(batch) + extra
        return run

    runs = common.rotate_runs({"a": runner("a"), "b": runner("b")}, lambda r: [r] * 3, 4, count=lambda n: n)
    assert len(runs) == 4 and all(set(run) == {"a", "b"} for run in runs)
    assert seen[:2] == [("a", [-1] * 3), ("b", [-1] * 3)]                 # warm-up: same size, its own inputs
    assert [b for _, b in seen[2:]] == [[r] * 3 for r in range(4) for _ in range(2)]   # shared, fresh each repeat
    assert [name for name, _ in seen[2:]] == ["a", "b", "b", "a", "b", "a", "a", "b"]
    with pytest.raises(common.UnequalWork, match="repeat 0"):
        common.rotate_runs({"a": runner("a"), "b": runner("b", extra=1)}, lambda r: [r], 2, count=lambda n: n)


def test_alternate_takes_a_runners_own_seconds_where_it_reports_them():
    """A runner that times itself (without its set-up, as `bench_boundary.py --cold` does) is reported by
    its own figure; one that returns nothing, or something other than a float (a runner's output), is timed
    by `alternate`."""
    paired: list = []
    runs = {"own": lambda: 7.0, "timed": lambda: None, "returns a tensor": lambda: torch.ones(3)}
    medians = common.alternate(runs, repeats=6, paired=paired)
    assert medians["own"] == 7.0 and 0 <= medians["timed"] < 1.0 and 0 <= medians["returns a tensor"] < 1.0
    assert len(paired) == 6 and all(run["own"] == 7.0 for run in paired)


def test_spread_is_the_median_and_range_of_the_pairs():
    assert common.spread([1.0, 1.2, 0.9]) == "**1.000** (0.900-1.200)"
    assert common.ratios([{"x": 2.0, "y": 1.0}, {"x": 3.0, "y": 3.0}], "x", "y") == [2.0, 1.0]


@pytest.mark.timeout(300)
def test_fused_llama_calls_one_add_norm_per_sublayer_and_changes_nothing_else():
    """The `fused-llama` baseline: the same logits and tokens as transformers' Llama, with 2 x layers
    fused calls per forward, one per residual add (a patch that did nothing would make none), and the
    model restored after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256)
    model = LlamaForCausalLM(config).eval()
    kernel, calls = fused_llama.fused_add_rms_norm_op(), []

    def op(x, residual, weight, eps):
        calls.append(weight.data_ptr())
        kernel(x, residual, weight, eps)

    ids = torch.randint(0, 256, (2, 9))
    with torch.inference_mode():
        expected = model(ids).logits
        tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        with fused_llama.fused_add_norm(model, op):
            fused = model(ids).logits
            assert len(calls) == 2 * config.num_hidden_layers        # the first norm has nothing to add
            fused_tokens = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                          do_sample=False)
        after = model(ids).logits
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused_tokens, tokens) and torch.equal(after, expected)
    assert calls[:2] == [model.model.layers[0].post_attention_layernorm.weight.data_ptr(),
                         model.model.layers[1].input_layernorm.weight.data_ptr()]
    assert calls[2 * config.num_hidden_layers - 1] == model.model.norm.weight.data_ptr()
    assert not any("forward" in vars(m) for m in [*model.model.layers, model.model.norm])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_llama_kernel_rounds_as_llama_in_every_dtype(dtype):
    """The kernel's add rounds to the model's dtype and its norm is `LlamaRMSNorm`'s, in each dtype it takes
    (bfloat16 rounds by hand in the kernel, so it is checked against torch's own rounding)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    x, residual = torch.randn(37, 96).to(dtype), torch.randn(37, 96).to(dtype)
    norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        expected_residual = (residual.float() + x.float()).to(dtype)
        expected = norm(expected_residual)
        fused_llama.fused_add_rms_norm_op()(x, residual, norm.weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(x, expected)                 # the sum of squares may add in another order


# -- each script end to end ------------------------------------------------------------------------------------


@pytest.mark.timeout(660)
def test_bench_transformers_sets_inductors_cpp_wrapper_only_when_asked():
    """`--inductor-cpp-wrapper` is torch's own global setting, so it applies to the three models alike.
    (torch's `patch` restores it; pytest's monkeypatch would delete the config entry on undo.)"""
    import bench_transformers
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(cpp_wrapper=False), dynamo_config.patch(recompile_limit=8,
                                                                       fail_on_recompile_limit_hit=False):
        bench_transformers.apply_inductor_settings(bench_transformers.parse_args(["--inductor-cpp-wrapper"]))
        assert inductor_config.cpp_wrapper is True
        bench_transformers.apply_inductor_settings(bench_transformers.parse_args([]))
        assert inductor_config.cpp_wrapper is False
        # the three models share one compiled step: a ninth cache entry must fail, not run eager unsaid
        assert dynamo_config.recompile_limit == 64 and dynamo_config.fail_on_recompile_limit_hit is True
    assert inductor_config.cpp_wrapper is False and dynamo_config.fail_on_recompile_limit_hit is False


def test_bench_transformers_pairs_attnres_llama_and_an_aa_llama_on_a_converted_checkpoint(tmp_path):
    """`--model` / `--source`: an attnres-convert output against the Llama it came from (the sizes come
    from the folders), with the bfloat16-vs-float64 accuracy table and the memory probes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    convert = run_bounded([sys.executable, "-m", "attnres.conversion.cli", str(tmp_path / "llama"),
                           str(tmp_path / "attnres"), "--block-size", "2", "--stream-scale", "1"],
                          timeout=600, cwd=ROOT)
    assert convert.returncode == 0, convert.stderr[-3000:]
    out = run("bench_transformers.py", "--model", str(tmp_path / "attnres"), "--source", str(tmp_path / "llama"),
              "--accuracy", "--repeats", "2", "--prefill-tokens", "8", "--prompt-tokens", "4", "--new-tokens", "2",
              "--decode-batches", "2", "--dtypes", "bfloat16", "--modes", "eager", "fused-llama",
              "--memory-probes", "1")
    assert_header(out, "repeats 1 per build order in rotating order", "fresh random token ids every repeat",
                  "modes eager, fused-llama", "Inductor's wrapper Python (torch's default)",
                  "build orders forward (AttnRes, Llama, Llama (A/A)) then reverse (Llama (A/A), Llama, AttnRes), "
                  "each in a fresh process")
    assert "hidden 64, 4 layers, block size 2" in out and str(tmp_path / "llama") in out, out
    accuracy, timing, memory, layers = tables(out)
    assert [(r["model"], r["attn_res_bank_dtype"], r["bank kept in"]) for r in accuracy] == [
        ("llama", "-", "-"), ("attnres", "float32", "float32"), ("attnres", "auto", "bfloat16")], out
    assert [(r["workload"], r["mode"]) for r in timing] == [
        (workload, mode) for mode in ("eager", "fused-llama") for workload in ("prefill 1x8", "decode 2x2 (prompt 4)")
    ], out
    for row in timing:
        pooled = spread(column(row, "AttnRes / Llama")), spread(column(row, "A/A: Llama (A/A) / Llama"))
        assert row["pairs"] == "2" and all(float(row[f"{m} ms"]) > 0 for m in ("AttnRes", "Llama", "Llama (A/A)"))
        # one pair per build order, pooled: each order's ratio (and A/A) is one end of the pooled spread
        by_order = re.fullmatch(r"forward: (\d+\.\d+) / (\d+\.\d+); reverse: (\d+\.\d+) / (\d+\.\d+)",
                                row["by build order: ratio / A/A"])
        assert by_order, row
        ratio, aa = (sorted(map(float, by_order.groups()[i::2])) for i in (0, 1))
        for (_, low, high), ends in zip(pooled, (ratio, aa)):
            assert ends == pytest.approx([low, high], abs=1.5e-3), row
    assert re.search(r"^CPU share of the timing .*: \d+ %$", out, re.M), out
    (peak,) = memory
    assert float(peak["Llama (A/A) peak RSS MiB"]) > 0 and re.fullmatch(r"\*\*\d+\.\d+\*\*", peak["A/A"]), out
    # 8 tokens x 2 stored sources (the embedding and layers 0-1's block; the output site stores none) x 64 in
    # bfloat16 (the kernel reads a bfloat16 bank: float32 would print 0.004), and their float32 inverse RMS
    assert peak["probes"] == "1" and peak["AttnRes bank MiB"] == f"{(8 * 2 * 64 * 2 + 8 * 2 * 4) / 2**20:.3f}", out
    assert re.fullmatch(r"[+-]\d+\.\d", peak["allocated: AttnRes - Llama MiB"]), out
    assert [(r["layer"], r["dtype"]) for r in layers] == [(str(i), "bfloat16") for i in range(4)], out
    for row in layers:
        attnres, llama = (float(row[f"{m} allocated at the layer's peak MiB"]) for m in ("AttnRes", "Llama"))
        assert float(row["AttnRes - Llama MiB"]) == pytest.approx(attnres - llama, abs=0.011), out


@pytest.mark.timeout(600)
def test_profile_step_splits_a_compiled_step_into_parts_for_both_models_and_the_aa_control():
    """Every part of a compiled decoding step is found in each model's profile (the matrix products, the
    residual-path kernels: Llama's add+norm, AttnRes's boundaries; the wrapper; the guards), and the
    differences are those of the columns."""
    out = run("profile_step.py", *TINY, "--num-hidden-layers", "2", "--batch", "2", "--prompt-tokens", "4",
              "--new-tokens", "3", "--repeats", "2", timeout=540)     # 2 layers: Inductor's cold compile, 74 -> 51 s
    assert_header(out, "dtype bfloat16", "2 x 3 new tokens", "Inductor's code", "2 profiled calls a model")
    (parts,) = tables(out)
    names = [row["part of a step (ms a new token, profiled)"] for row in parts]
    assert names == ["matrix products", "attention", "residual-path kernels", "other generated kernels",
                     "the graph's Python wrapper", "Dynamo's guard checks", "other recorded ops (cache, sampling, ...)",
                     "outside any event (generate's Python, direct kernel calls)", "whole call"], out
    for row in parts:
        values = [float(row[m]) for m in ("AttnRes", "Llama", "Llama (A/A)")]
        assert all(math.isfinite(v) for v in values) and (row is parts[-2] or min(values) >= 0), row
        assert float(row["AttnRes - Llama"]) == pytest.approx(values[0] - values[1], abs=0.0011), row
        assert float(row["A/A: Llama (A/A) - Llama"]) == pytest.approx(values[2] - values[1], abs=0.0011), row
    found = {row["part of a step (ms a new token, profiled)"]: row for row in parts}
    for name in ("matrix products", "residual-path kernels", "the graph's Python wrapper", "Dynamo's guard checks"):
        assert all(float(found[name][m]) > 0 for m in ("AttnRes", "Llama", "Llama (A/A)")), (name, out)
    whole = {m: float(found["whole call"][m]) for m in ("AttnRes", "Llama", "Llama (A/A)")}
    for m, total in whole.items():      # the parts are the profiled call's own times: they cannot exceed it
        assert sum(float(row[m]) for row in parts[:-2]) <= total * 1.05, (m, out)


def refusal(parse_args, argv: list[str], capsys) -> str:
    """What a script's `parse_args(argv)` says on stderr as it exits with status 2 (argparse's usage error),
    in this process: the scripts parse their arguments only after importing torch and transformers."""
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2, exited.value
    return capsys.readouterr().err


def test_profile_step_refuses_a_single_new_token(capsys):
    import profile_step

    assert "--new-tokens must be at least 2" in refusal(profile_step.parse_args, ["--new-tokens", "1"], capsys)


@pytest.mark.timeout(900)
def test_bench_vllm_reports_each_ratio_beside_its_aa_control_over_both_build_orders():
    out = run("bench_vllm.py", *TINY, "--dtype", "float32", "--compile", "eager", "--prefill-tokens", "32",
              "--decode-batches", "2", "--long-decode-batches", "--decode-context", "8", "--new-tokens", "3",
              "--repeats", "2", "--max-num-batched-tokens", "16", "--kv-cache-bytes", str(64 << 20),
              "--gpu-memory-utilization", "0.1", timeout=840)
    assert_header(out, "prefix caching off", "max_num_batched_tokens 16", "float32", "forward (AttnRes, Llama, "
                  "Llama (A/A)) then reverse (Llama (A/A), Llama, AttnRes)", "1 per build order in rotating order")
    timing, memory = tables(out)
    assert [r["workload"] for r in timing] == ["prefill 1 x 32", "decode 2 x 3 (context 8)"], out
    expected_tokens = {"prefill 1 x 32": "32 / 1", "decode 2 x 3 (context 8)": "16 / 6"}
    for row in timing:
        assert column(row, "tokens in / out") == expected_tokens[row["workload"]], row
        spread(column(row, "AttnRes / Llama"))
        spread(column(row, "A/A: Llama (A/A) / Llama"))
        assert row["pairs"] == "2" and re.fullmatch(r"forward: [\d.]+ / [\d.]+; reverse: [\d.]+ / [\d.]+",
                                                    column(row, "by build order")), row
    assert [r["model"] for r in memory] == ["AttnRes", "Llama", "Llama (A/A)"], out
    config = common.AttnResConfig(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                                  intermediate_size=256, vocab_size=256, attn_res_block_size=2)
    per_token = config.depth_sites[-1].num_stored * (128 * 4 + 4)           # float32 sources + their inverse RMS
    assert memory[0]["bank bytes per token"].startswith(f"{per_token} (float32)"), memory[0]
    for row in memory:
        budget = column(row, "KV capacity, tokens, in the budget").split(" / ")
        assert len(budget) == 2 and len(set(budget)) == 1 and int(budget[0]) > 0, row
        assert len(column(row, "peak growth").split(" / ")) == 2, row
    assert all(int(column(r, "KV capacity, tokens, vLLM's profiling")) > 0 for r in memory[:2]), memory
    assert re.search(r"^CPU share of the timed calls .*: forward \d+ %, reverse \d+ %$", out, re.M), out
    engines = r"AttnRes \d+ / Llama \d+ / Llama \(A/A\) \d+"
    reverse = r"Llama \(A/A\) \d+ / Llama \d+ / AttnRes \d+"
    per_workload = [rf"{re.escape(w)}: forward {engines}, reverse {reverse}" for w in expected_tokens]
    assert re.search(r"^minor page faults per timed call .*, per build order: " + "; ".join(per_workload) + "$",
                     out, re.M), out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_vllm_c_norms_compute_what_vllms_native_norms_compute(dtype):
    """`--norms vllm-c` registers vLLM's C++ kernels as its IR norm ops on a CPU: same results as the native
    ones (to their rounding), the add+norm in place as vLLM's own GPU implementation does it."""
    import bench_vllm
    from vllm import ir

    bench_vllm.register_c_norms()
    bench_vllm.register_c_norms()                                        # once per process, then a no-op
    norm, add_norm = (op.impls[bench_vllm.C_NORMS] for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm))
    gen = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(shape, generator=gen).to(dtype) for shape in ((5, 64), (5, 64), (64,)))
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    assert norm.supports_args(x, weight, 1e-6) and not norm.supports_args(x.t(), weight[:5], 1e-6)
    torch.testing.assert_close(norm.impl_fn(x, weight, 1e-6), ir.ops.rms_norm.impls["native"].impl_fn(x, weight, 1e-6),
                               **tol)
    expected = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, residual, weight, 1e-6)
    x_in, residual_in = x.clone(), residual.clone()
    got = add_norm.impl_fn(x_in, residual_in, weight, 1e-6)
    assert got[0] is x_in and got[1] is residual_in                      # in place
    # The sum, rounded once from float32: to nearest as the native op (vLLM's AVX-512 builds), or toward zero
    # (its AVX2 build rounds bfloat16 so), never through a second rounding.
    exact = x.float() + residual.float()
    toward_zero = (exact.view(torch.int32) & -65536).view(torch.float32).to(dtype) if dtype == torch.bfloat16 else exact
    assert torch.equal(expected[1], exact.to(dtype))
    assert ((got[1] == expected[1]) | (got[1] == toward_zero)).all(), (got[1] - expected[1]).abs().max()
    torch.testing.assert_close(got[0], expected[0], **tol)


@pytest.mark.timeout(660)
def test_bench_vllm_compares_the_transformers_backend_with_the_plugin():
    out = run("bench_vllm.py", *TINY, "--compare", "transformers-backend", "--dtype", "float32", "--compile", "eager",
              "--prefill-tokens", "16", "--decode-batches", "2", "--long-decode-batches", "--decode-context", "4",
              "--new-tokens", "2", "--repeats", "2", "--build-order", "forward", "--no-kv-profile",
              "--kv-cache-bytes", str(64 << 20), "--norms", "vllm-c")
    assert_header(out, "prefix caching off", "Transformers backend, plugin and plugin (A/A) in one process",
                  "norms vLLM's C++ rms_norm / fused_add_rms_norm kernels")
    timing, memory = tables(out)
    for row in timing:
        spread(column(row, "Transformers backend / plugin"))
        spread(column(row, "A/A: plugin (A/A) / plugin"))
        assert row["pairs"] == "2", row
    assert [r["model"] for r in memory] == ["Transformers backend", "plugin", "plugin (A/A)"], out


@pytest.mark.timeout(900)
def test_bench_serve_measures_three_servers_up_together_in_a_rotating_order_with_an_aa_control():
    """AttnRes, Llama and a second Llama (the A/A control) stay up; each round measures the three with vLLM's
    client in a rotating order, after one untimed round, and each ratio comes with the A/A's. With `--norms
    vllm-c` every server's processes load the plugin that registers vLLM's C++ norms (a server whose plugin
    fails does not start)."""
    out = run("bench_serve.py", *TINY, "--compilations", "eager", "--concurrency", "2", "--num-prompts", "2",
              "--input-len", "16", "--output-len", "4", "--dtype", "float32", "--kv-cache-bytes", str(64 << 20),
              "--repeats", "1", "--start-order", "reverse", "--norms", "vllm-c", "--settle", "0.5", timeout=840)
    assert_header(out, "--no-enable-prefix-caching", "vllm bench serve (in this process)",
                  "servers up together, started in reverse (llama-aa, llama, attnres) order; 1 timed rounds in all "
                  "(1 reverse), each start order's after one untimed", "rotating order (not a multiple of 6: "
                  "unbalanced; fewer than 10 pairs: a ratio within a few % of 1 is not resolved), 0.5 s apart",
                  "vLLM's C++ rms_norm")
    (rows,) = tables(out)
    (row,) = rows
    assert row["clients"] == "2" and column(row, "requests x tokens") == "2 x 16 / 4", row
    assert row["rounds"] == "1", row
    for name in ("duration", "median TTFT", "median TPOT"):
        spread(row[f"{name}: AttnRes / Llama (median, min-max)"]), spread(row[f"{name}: A/A"])
    assert re.search(r"start-up to healthy, in start order: none \(--enforce-eager\), reverse: llama-aa \d+ s, "
                     r"llama \d+ s, attnres \d+ s$", out, re.M), out
    # the order the clients ran in: every server in every round, a different one first in round 1
    order = re.search(r"running order by round \(round 0 untimed\): none \(--enforce-eager\), reverse start order: "
                      r"0: (.+), 1: (.+)$", out, re.M)
    assert order, out
    first, second = order.group(1).split(), order.group(2).split()
    assert sorted(first) == sorted(second) == ["attnres", "llama", "llama-aa"] and first[0] != second[0], order


@pytest.mark.timeout(60)
def test_bench_serve_splits_the_rounds_between_both_start_orders_with_fresh_prompts():
    """By default the three servers are started in one order for half the rounds, then restarted in the
    reverse order for the other half; no round of either order reuses another's prompts."""
    import bench_serve

    def plans(*argv: str) -> list[tuple[str, list[str], int]]:
        args = bench_serve.parse_args(["--hidden-size", "64", *argv])
        found = bench_serve.start_plans(args)
        seeds = [p["seed"] + r for p in found for r in range(p["repeats"] + 1)]
        assert len(set(seeds)) == len(seeds), found
        return [(p["label"], p["order"], p["repeats"]) for p in found]

    forward, reverse = ["attnres", "llama", "llama-aa"], ["llama-aa", "llama", "attnres"]
    assert plans() == [("forward", forward, 6), ("reverse", reverse, 6)]
    assert plans("--repeats", "13") == [("forward", forward, 7), ("reverse", reverse, 6)]
    assert plans("--repeats", "1") == [("forward", forward, 1)]
    assert plans("--start-order", "reverse", "--repeats", "4") == [("reverse", reverse, 4)]
    assert bench_serve.order_note(bench_serve.parse_args(["--hidden-size", "64"])).startswith("balanced")
    assert bench_serve.order_note(bench_serve.parse_args(["--hidden-size", "64", "--repeats", "6"])).startswith(
        "not a multiple of 12: unbalanced")


@pytest.mark.timeout(660)
def test_bench_depth_checks_every_path_against_mix_site_and_reports_each_lever():
    """The cat-bank and two-phase paths are compared with per-site `mix_site` inside the script before
    they are timed; each row reports three paired ratios (one per lever)."""
    out = run("bench_depth.py", *TINY, "--num-hidden-layers", "2", "--tokens", "1", "5", "--modes", "eager",
              "cpu-kernel", "--repeats", "2", "--work", "1024", "--dtype", "bfloat16")
    rows = [line for line in out.splitlines() if line.startswith(("| eager", "| cpu-kernel"))]
    assert len(rows) == 4, out
    found = [float(x) for x in re.findall(r"\*\*(\d+\.\d+)x\*\*", out)]
    assert len(found) == 12 and all(r > 0 for r in found), out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("baseline, via", [("fused-llama", "extension"), ("vllm", "op")])
def test_bench_boundary_times_the_kernel_against_llamas_add_norm_with_an_aa_control(baseline, via):
    """One row per (tokens, stored sources), each with AttnRes's, Llama's and the control's microseconds,
    the ratio and the A/A ratio with their spreads; both Llama sides (our kernel, vLLM's op) run, and
    AttnRes's kernel both through its extension and as the dispatcher op a compiled graph calls."""
    tunables = "glibc.malloc.trim_threshold=1073741824"                      # the allocator's settings are shown
    out = run("bench_boundary.py", "--hidden-size", "64", "--tokens", "1", "33", "--sources", "0", "3",
              "--repeats", "2", "--calls", "2", "--baseline", baseline, "--via", via, timeout=240,
              env={"GLIBC_TUNABLES": tunables})
    assert_header(out, "hidden 64", f"Llama side {baseline}", f"AttnRes called via {via}", "repeats 2")
    assert f"GLIBC_TUNABLES={tunables}" in next(line for line in out.splitlines() if line.startswith("command: "))
    [rows] = tables(out)
    assert [(r["tokens"], r["stored sources"]) for r in rows] == [("1", "0"), ("1", "3"), ("33", "0"), ("33", "3")]
    for row in rows:
        spread(row["AttnRes / Llama (median, min-max)"]), spread(row["A/A (median, min-max)"])
        assert all(float(row[c]) > 0 for c in ("AttnRes us", "Llama us", "Llama (A/A) us")), row
        assert row["pairs"] == "2", row


@pytest.mark.timeout(300)
def test_bench_boundary_cold_flushes_before_each_call_and_prints_the_read_bandwidth():
    """`--cold` says what it flushed, prints the memory read bandwidth a byte floor divides by, and gives the
    same rows; a flushed call is timed alone, so a 1-token boundary still measures microseconds, not the
    milliseconds of the flush before it. Writing 256 MiB takes over 8 ms even at 32 GB/s, so a call that
    counted its flush would exceed the 5 ms bound, which a call preempted once by another process (a few ms
    when `make test`'s second worker is busy) stays under; the median of 3 repeats drops one such call. One
    thread: with two, every parallel region waits for a thread the other worker's processes hold off the
    second core (7-8 ms per call, measured under `make test`)."""
    out = run("bench_boundary.py", "--hidden-size", "64", "--tokens", "1", "33", "--sources", "0", "3",
              "--repeats", "3", "--calls", "2", "--cold", "--flush-mib", "256", timeout=240,
              env={"OMP_NUM_THREADS": "1"})
    assert_header(out, "caches flushed before every call (256 MiB written)", "threads 1")
    bandwidth = float(re.search(r"^memory read bandwidth: (\d+\.\d) GB/s", out, re.M).group(1))
    assert bandwidth > 0, out
    [rows] = tables(out)
    assert [(r["tokens"], r["stored sources"]) for r in rows] == [("1", "0"), ("1", "3"), ("33", "0"), ("33", "3")]
    for row in rows:
        assert all(0 < float(row[c]) < 5000 for c in ("AttnRes us", "Llama us", "Llama (A/A) us")), row


def test_bench_boundary_rejects_a_bad_size_naming_it(capsys):
    import bench_boundary

    said = refusal(bench_boundary.parse_args, ["--tokens", "0", "8"], capsys)
    assert "--tokens [0, 8]" in said and "expected tokens >= 1" in said, said


@pytest.mark.timeout(400)
def test_bench_boundary_against_another_build_times_both_and_shows_where_their_outputs_differ(tmp_path):
    """`--against FILE` builds the kernel source a file defines beside this checkout's and times the two with
    the other build's A/A control; the difference column is computed from both builds' outputs: a copy
    whose norm epsilon is 1000x differs in the normed output and not in the partial (which the norm does
    not touch)."""
    from modeling_attnres.depth_attention_cpu_source import KERNEL_SOURCE

    changed = "static_cast<float>(norm_eps) * 1000.0f;"
    assert KERNEL_SOURCE.count("static_cast<float>(norm_eps);") == 1
    other = tmp_path / "other_kernel.py"
    other.write_text("KERNEL_SOURCE = " + repr(KERNEL_SOURCE.replace("static_cast<float>(norm_eps);", changed)))
    out = run("bench_boundary.py", "--against", str(other), "--hidden-size", "64", "--tokens", "1", "33",
              "--sources", "0", "3", "--repeats", "2", "--calls", "2", timeout=360)
    assert_header(out, "hidden 64", "against other_kernel.py", "repeats 2")
    [rows] = tables(out)
    assert [(r["tokens"], r["stored sources"]) for r in rows] == [("1", "0"), ("1", "3"), ("33", "0"), ("33", "3")]
    for row in rows:
        spread(row["AttnRes / AttnRes at other_kernel.py (median, min-max)"]), spread(row["A/A (median, min-max)"])
        assert all(float(row[c]) > 0 for c in ("AttnRes us", "AttnRes at other_kernel.py us",
                                                "AttnRes at other_kernel.py (A/A) us")), row
        normed, partial = map(float, row["largest difference, normed output / partial"].split(" / "))
        assert normed > 1e-4 and partial == 0.0, row


def test_bench_boundary_finds_the_kernel_source_at_a_revision_in_either_layout(tmp_path):
    """A revision's kernel source is read from git without running the file, whether it lived in
    `depth_attention_cpu_source.py` (KERNEL_SOURCE) or, earlier, in `depth_attention_cpu.py` (_SOURCE);
    a revision or file without it, or a file that is not Python, is refused naming it."""
    import bench_boundary

    def commit(path: str, text: str) -> None:
        (tmp_path / "modeling_attnres").mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
        for args in (["add", path], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", path]):
            assert bench_boundary.git(str(tmp_path), *args).returncode == 0

    assert bench_boundary.git(str(tmp_path), "init", "-q").returncode == 0
    commit("modeling_attnres/depth_attention_cpu.py", 'import os\nROUNDING_CPP = r"""// to<T>"""\n'
           '_SOURCE = r"""void site_boundary() {} """ + ROUNDING_CPP\n_enabled = os.environ.get("X") != "0"\n')
    commit("modeling_attnres/depth_attention_cpu_source.py", 'LANES_CPP = "// lanes "\n'
           'KERNEL_SOURCE = r"""// new """ + LANES_CPP + "void site_boundary() {}"\n')
    assert bench_boundary.kernel_source_at("HEAD~1", str(tmp_path))[1] == "void site_boundary() {} // to<T>"
    label, source = bench_boundary.kernel_source_at("HEAD", str(tmp_path))
    assert source == "// new // lanes void site_boundary() {}" and len(label) >= 7, label
    with pytest.raises(SystemExit, match="no-such-revision.*git found no kernel source"):
        bench_boundary.kernel_source_at("no-such-revision", str(tmp_path))
    (tmp_path / "computed.py").write_text('KERNEL_SOURCE = open("kernel.cpp").read()\n')   # never run
    (tmp_path / "broken.py").write_text('KERNEL_SOURCE = r"""void site_boundary() {}\n')
    with pytest.raises(SystemExit, match="computed.py.*no KERNEL_SOURCE"):
        bench_boundary.kernel_source_at(str(tmp_path / "computed.py"))
    with pytest.raises(SystemExit, match="broken.py.*not Python"):
        bench_boundary.kernel_source_at(str(tmp_path / "broken.py"))


def test_bench_boundary_against_refuses_the_llama_options_naming_them(capsys):
    import bench_boundary

    said = refusal(bench_boundary.parse_args, ["--against", "HEAD", "--via", "op"], capsys)
    assert "--against HEAD compares two builds" in said and "--baseline and --via op do not apply" in said, said


@pytest.mark.timeout(660)
def test_gpu_run_sh_dry_run_writes_one_table_per_step_and_names_what_failed(tmp_path):
    """`DRY_RUN=1 bash bench/gpu/run.sh` runs the GPU steps at toy sizes on the CPU (Triton's interpreter):
    each step's file holds its table, or says how it failed; summary.md lists exactly the failed steps
    and the exit status agrees; vLLM is said not to run. (The compiled step, whose Inductor compile takes
    minutes on a CPU, is left out here.)"""
    out = tmp_path / "out"
    done = run_bounded(["bash", str(ROOT / "bench" / "gpu" / "run.sh")], timeout=600, cwd=ROOT,
                       env={**os.environ, "DRY_RUN": "1", "OUT": str(out), "PYTHON": sys.executable,
                            "STEPS": "env kernel transformers vllm"})
    files = {p.name: p.read_text() for p in out.iterdir() if p.is_file()}
    assert set(files) == {"env.md", "kernel.md", "transformers.md", "vllm.md", "summary.md"}, (files, done.stdout)
    failed = [name.removesuffix(".md") for name, text in files.items() if "**FAILED" in text]
    summary = files["summary.md"]
    assert (done.returncode == 0) == (not failed), (failed, summary, done.stdout[-3000:])
    if failed:
        assert f"FAILED steps: {' '.join(sorted(failed, key=STEP_ORDER.index))} " in summary, (failed, summary)
    else:
        assert "all steps passed" in summary, summary
    assert "torch " in files["env.md"] and "AMX bfloat16: " in files["env.md"], files["env.md"]
    assert "vLLM step is not run" in files["vllm.md"]
    assert "A/A: Triton / Triton" in files["kernel.md"], files["kernel.md"]
    by_order, pooled = tables(files["transformers.md"])
    cases = [(w, b) for w in ("prefill 1x8", "decode 1x2 (prompt 4)") for b in ("triton", "torch")]
    assert [(r["build order"], r["workload"], r["AttnRes"]) for r in by_order] == [
        (order, *case) for order in ("forward", "reverse") for case in cases], files["transformers.md"]
    assert [(r["workload"], r["AttnRes"]) for r in pooled] == cases, files["transformers.md"]
    assert "build orders forward (AttnRes, Llama, Llama (A/A)) then reverse (Llama (A/A), Llama, AttnRes)" \
        in files["transformers.md"]
    for row in pooled:       # one pair per build order (--repeats 2): the pooled spread's ends are the orders'
        mine = [r for r in by_order if (r["workload"], r["AttnRes"]) == (row["workload"], row["AttnRes"])]
        assert row["pairs"] == "2" and [r["pairs"] for r in mine] == ["1", "1"], files["transformers.md"]
        for name in ("AttnRes / Llama", "A/A: Llama (A/A) / Llama"):
            _, low, high = spread(column(row, name))
            assert sorted(spread(column(r, name))[0] for r in mine) == pytest.approx([low, high], abs=1.5e-3), row
