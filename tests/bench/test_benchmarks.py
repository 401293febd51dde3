"""The benchmark scripts behind `make bench` run end to end at a tiny size, and what makes their ratios
trustworthy holds in what they print: an A/A control beside every ratio (finite, with its spread), the
pairs the ratios come from, token counts that were checked equal, and headers that name the machine,
the versions and every setting. Timings are never asserted: they depend on the machine.
"""

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import statistics
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

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
              "--input-len", "16", "--output-len", "16", "--dtype", "float32", "--kv-cache-bytes", str(64 << 20),
              "--repeats", "1", "--start-order", "reverse", "--norms", "vllm-c", "--settle", "0.5", timeout=840)
    assert_header(out, "--no-enable-prefix-caching", "vllm bench serve (in this process)",
                  "servers up together, started in reverse (llama-aa, llama, attnres) order; 1 timed rounds in all "
                  "(1 reverse), each start order's after one untimed", "rotating order (not a multiple of 6: "
                  "unbalanced; fewer than 10 pairs: a ratio within a few % of 1 is not resolved), 0.5 s apart",
                  "vLLM's C++ rms_norm")
    (rows,) = tables(out)
    (row,) = rows
    assert row["clients"] == "2" and column(row, "requests x tokens") == "2 x 16 / 16", row
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
    they are timed; each row reports the paired ratios of the three levers and of the A/A control, under
    the header every benchmark prints."""
    out = run("bench_depth.py", *TINY, "--num-hidden-layers", "2", "--tokens", "1", "5", "--modes", "eager",
              "cpu-kernel", "--repeats", "2", "--work", "1024", "--dtype", "bfloat16")
    assert_header(out, "hidden 128, 2 layers", "bfloat16", "2 paired repeats after one warm-up",
                  "rotating order (not a multiple of 12: unbalanced; fewer than 10 pairs)", "--work 1024",
                  "per-site (A/A) / per-site is the control")
    (rows,) = tables(out)
    assert [(r["mode"], r["tokens"]) for r in rows] == [("eager", "1"), ("eager", "5"), ("cpu-kernel", "1"),
                                                        ("cpu-kernel", "5")], out
    for row in rows:
        for lever in ("per-site (A/A)", "cat-bank", "float32-bank", "two-phase"):
            cell = row[f"{lever} / per-site"]
            assert cell.endswith(")") and "x**" in cell, row
            spread(cell.replace("x**", "**"))


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


# -- the rules and tables, unit by unit (what the end-to-end runs cannot tell apart) --------------------------


def test_alternate_warms_up_rotates_and_pairs_each_repeats_own_seconds():
    """`alternate` (bench_boundary.py's and bench_depth.py's timing): one untimed call of each runner, then the
    rotating order of `rotation`; `paired` gets each repeat's own seconds (the pairs the ratios come from) and
    the result is each runner's median (one preempted call must not move it, as it moves a mean)."""
    calls, seconds = [], {"a": iter([99.0, 1.0, 2.0, 3.0, 10.0]), "b": iter([99.0, 5.0, 6.0, 7.0, 8.0])}

    def runner(name):
        def run():
            calls.append(name)
            return next(seconds[name])
        return run

    paired: list = []
    medians = common.alternate({"a": runner("a"), "b": runner("b")}, repeats=4, paired=paired)
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "b", "a", "a", "b"]             # warm-up, then A B B A
    assert paired == [{"a": 1.0, "b": 5.0}, {"a": 2.0, "b": 6.0}, {"a": 3.0, "b": 7.0}, {"a": 10.0, "b": 8.0}]
    assert medians == {"a": 2.5, "b": 6.5}


def test_rotate_runs_counts_the_cpu_time_of_timed_calls_apart_from_their_wall_time():
    """The "CPU share of the timing" line: `TIMED` adds each timed call's wall and process CPU seconds apart,
    so a call that waits (as one held off the cores by another job does) shows a share well below 100 %."""
    before = dict(common.TIMED)
    common.rotate_runs({"a": lambda _: time.sleep(0.05), "b": lambda _: time.sleep(0.05)}, lambda r: r, 2,
                       warmup=False)
    wall, cpu = (common.TIMED[k] - before[k] for k in ("wall", "cpu"))
    assert wall >= 4 * 0.05 and cpu < wall / 2, (wall, cpu)


def test_header_prints_the_whole_command_the_start_date_and_every_setting(monkeypatch):
    """A table's header gives the command as it was run (the variables that change what it measures, the
    script and every argument), the date the process started and each setting with its value."""
    monkeypatch.setattr(sys, "argv", ["bench/bench_x.py", "--repeats", "6", "--label", "a b"])
    shown = {"OMP_NUM_THREADS": "3", "GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1", "VLLM_CPU_KVCACHE_SPACE": "4"}
    for name, value in {**shown, "UNRELATED_VARIABLE": "1"}.items():
        monkeypatch.setenv(name, value)
    lines = dict(line.split(": ", 1) for line in common.header("title", {"dtype": "bfloat16", "repeats": 6})
                 .splitlines()[1:])
    command = lines["command"]
    assert command.endswith(" bench/bench_x.py --repeats 6 --label 'a b'"), command
    assert all(f"{k}={v}" in command.split() for k, v in shown.items()) and "UNRELATED" not in command, command
    assert datetime.datetime.fromisoformat(lines["date"]).tzinfo is not None, lines["date"]
    assert lines["settings"] == "dtype bfloat16; repeats 6"


# Seconds of (subject, baseline, control) in three pairs, two of one build order and one of the other; their
# ratios 1.5, 1.6, 2.0 (median 1.6) and A/A 1.1, 1.1, 0.9 (median 1.1).
PAIRS = [(3.0, 2.0, 2.2), (6.4, 4.0, 4.4), (10.0, 5.0, 4.5)]
RATIO, AA = "**1.600** (1.500-2.000)", "**1.100** (0.900-1.100)"


def test_bench_transformers_rows_put_each_model_in_its_column_and_the_aa_over_the_baseline():
    import bench_transformers

    def timed(pairs):
        return [{"workload": "w", "dtype": "float32", "mode": "eager",
                 "runs": [dict(zip(bench_transformers.MODELS, (s / 1e3 for s in p))) for p in pairs]}]

    results = [{"label": "forward", "timed": timed(PAIRS[:2])}, {"label": "reverse", "timed": timed(PAIRS[2:])}]
    assert bench_transformers.timing_rows(results) == [
        ["w", "float32", "eager", "6.4", "4.0", "4.4", RATIO, AA, "forward: 1.550 / 1.100; reverse: 2.000 / 0.900", 3]]


def test_bench_transformers_gives_each_build_order_its_own_process_repeats_and_prompts(monkeypatch):
    """`--build-order both`: a fresh process per order, each with half the repeats and a seed of its own (the
    pooled pairs must not be the same prompts twice)."""
    import bench_transformers

    cmds = []

    def value(cmd: list[str], flag: str) -> str:                  # the last occurrence wins, as in argparse
        return cmd[max(i for i, arg in enumerate(cmd) if arg == flag) + 1]

    def fake_run_logged(cmd, log, timeout, env=None):
        cmds.append(cmd)
        Path(value(cmd, "--timing-out")).write_text(json.dumps({"label": value(cmd, "--build-order")}))
        return 0

    monkeypatch.setattr(bench_transformers, "run_logged", fake_run_logged)
    results = bench_transformers.time_orders(bench_transformers.parse_args([*TINY, "--repeats", "6"]))
    assert [r["label"] for r in results] == [value(c, "--build-order") for c in cmds] == ["forward", "reverse"]
    assert [value(c, "--repeats") for c in cmds] == ["3", "3"]
    assert len({value(c, "--seed") for c in cmds}) == 2, cmds


class FakeGenerator:
    """A model's `generate` that records what it was given (and whether `fused_add_norm` was on), and returns the
    prompts with `max_new_tokens + extra` tokens."""

    def __init__(self, name: str, log: list, extra: int = 0):
        self.name, self.log, self.extra, self.fused = name, log, extra, False

    def generate(self, ids, attention_mask=None, max_new_tokens=0, **kwargs):
        self.log.append((self.name, ids.clone(), self.fused))
        return torch.cat([ids, ids.new_zeros(ids.shape[0], max_new_tokens + self.extra)], dim=1)


def test_bench_transformers_models_share_fresh_prompts_count_tokens_and_fuse_both_llamas(monkeypatch):
    """`time_mode` as the table's rows rely on it: per workload a warm-up at the timed size, then each repeat's
    fresh prompts shared by the three models; unequal token counts stop it; `fused-llama` fuses the Llama and
    its A/A control alike, never AttnRes."""
    import bench_transformers

    from modeling_attnres import depth_attention_cpu

    monkeypatch.setenv("ATTNRES_CPU_KERNEL", "0")
    # time_mode turns the kernel off when it ends: this worker's later tests must find it as it was.
    for name in ("_enabled", "_in_graphs"):
        monkeypatch.setattr(depth_attention_cpu, name, getattr(depth_attention_cpu, name))
    args = argparse.Namespace(prefill_tokens=6, prompt_tokens=3, new_tokens=2, decode_batches=[2], repeats=2, seed=0,
                              vocab_size=50, device="cpu")
    log: list = []
    models = {kind: FakeGenerator(kind, log) for kind in bench_transformers.MODELS}
    timed = bench_transformers.time_mode(args, models, "float32", "torch-path")
    assert [(t["workload"], len(t["runs"])) for t in timed] == [("prefill 1x6", 2), ("decode 2x2 (prompt 3)", 2)]
    assert len(log) == 2 * 3 * 3
    for workload in range(2):
        groups = [log[9 * workload + 3 * i: 9 * workload + 3 * i + 3] for i in range(3)]    # warm-up, repeats 0, 1
        for group in groups:
            assert sorted(name for name, _, _ in group) == sorted(bench_transformers.MODELS)
            assert all(torch.equal(ids, group[0][1]) for _, ids, _ in group)           # shared by the three
        prompts = [group[0][1] for group in groups]
        assert all(p.shape == prompts[0].shape for p in prompts)                        # warm-up at the timed size
        assert not any(torch.equal(a, b) for i, a in enumerate(prompts) for b in prompts[i + 1:])   # fresh

    @contextlib.contextmanager
    def fake_fused_add_norm(model, op):
        model.fused = True
        yield model
        model.fused = False

    monkeypatch.setattr(bench_transformers, "fused_add_norm", fake_fused_add_norm)
    monkeypatch.setattr(bench_transformers, "fused_add_rms_norm_op", lambda: None)
    log.clear()
    bench_transformers.time_mode(args, models, "float32", "fused-llama")
    assert {(name, fused) for name, _, fused in log} == {("attnres", False), ("llama", True), ("llama-2", True)}
    assert not any(model.fused for model in models.values())
    models["llama-2"].extra = 1
    with pytest.raises(common.UnequalWork):
        bench_transformers.time_mode(args, models, "float32", "torch-path")


@pytest.mark.parametrize("compare", ["llama", "transformers-backend"])
def test_bench_vllm_engines_have_prefix_caching_off_and_the_control_is_the_baseline_again(compare):
    import bench_vllm

    args = bench_vllm.parse_args([*TINY, "--compare", compare, "--compile", "eager"])
    specs = bench_vllm.engine_specs(args, {"attnres": Path("/attnres"), "llama": Path("/llama")})
    subject, baseline, control = bench_vllm.COMPARISONS[compare]
    assert all(spec["kwargs"]["enable_prefix_caching"] is False for spec in specs.values()), specs
    assert specs[control] == specs[baseline] and specs[subject]["path"] == "/attnres", specs
    assert specs[baseline]["path"] == ("/llama" if compare == "llama" else "/attnres"), specs


def test_bench_vllm_engines_share_fresh_prompts_warm_up_at_size_and_check_both_token_counts(monkeypatch):
    """`run_engines` with a stand-in for vLLM's `LLM`: per repeat one set of fresh prompts for the three
    engines, a warm-up with as many prompts as are timed, prompt and generated token counts compared, and a
    decode timed from the last request's first token (the engine's timestamps) to the last token."""
    import bench_vllm

    log, extra = [], {}

    class FakeLLM:
        def __init__(self, model, **kwargs):
            self.name = model
            config = SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=2, block_size=16),
                                     scheduler_config=SimpleNamespace(max_num_batched_tokens=32))
            self.llm_engine = SimpleNamespace(vllm_config=config)

        def generate(self, prompts, params, use_tqdm=True):
            ids = [p["prompt_token_ids"] for p in prompts]
            log.append((self.name, ids))
            new = params.max_tokens + extra.get(self.name, 0)
            return [SimpleNamespace(prompt_token_ids=p, outputs=[SimpleNamespace(token_ids=[0] * new)],
                                    metrics=SimpleNamespace(first_token_ts=10.0 + i, last_token_ts=20.0 + i))
                    for i, p in enumerate(ids)]

    fake = types.ModuleType("vllm")
    fake.LLM, fake.SamplingParams = FakeLLM, SimpleNamespace
    monkeypatch.setitem(sys.modules, "vllm", fake)
    work = bench_vllm.Workload("decode", 2, 3, 2)
    engines = ["attnres", "llama", "llama-2"]
    plan = {"order": engines, "engines": {n: {"path": n, "kwargs": {}} for n in engines}, "max_model_len": 32,
            "max_num_seqs": 2, "seed": 0, "vocab": 50, "repeats": 2, "label": "forward",
            "workloads": [dataclasses.asdict(work)]}
    result = bench_vllm.run_engines(plan)
    groups = [log[3 * i: 3 * i + 3] for i in range(3)]                                # warm-up, repeats 0, 1
    for group in groups:
        assert sorted(name for name, _ in group) == engines and all(ids == group[0][1] for _, ids in group)
        assert len(group[0][1]) == 2 and all(len(p) == 3 for p in group[0][1])
    assert groups[0][0][1] != groups[1][0][1] != groups[2][0][1] != groups[0][0][1]
    assert all(run[n]["seconds"] == 10.0 for run in result["workloads"][work.name] for n in engines)   # 21 - 11
    extra["llama-2"] = 1
    with pytest.raises(common.UnequalWork, match="repeat 0"):
        bench_vllm.run_engines(plan)


def test_bench_vllm_rows_put_each_engine_in_its_column_and_the_aa_over_the_baseline():
    import bench_vllm

    work = bench_vllm.Workload("decode", 2, 3, 2)

    def runs(label, pairs):
        return {"label": label, "workloads": {work.name: [
            {n: {"seconds": s, "prompt_tokens": 6, "generated_tokens": 4} for n, s in zip(("attnres", "llama",
                                                                                             "llama-2"), p)}
            for p in pairs]}}

    rows = bench_vllm.timing_rows(argparse.Namespace(compare="llama"), [runs("forward", PAIRS[:2]),
                                                                        runs("reverse", PAIRS[2:])], [work])
    assert rows == [[work.name, "decode phase", "6 / 4", "6.400", "4.000", "4.400", RATIO, AA,
                     "forward: 1.550 / 1.100; reverse: 2.000 / 0.900", 3]]


def test_bench_serve_rounds_share_fresh_prompts_leave_out_the_warm_up_and_put_the_aa_beside_the_ratio(monkeypatch):
    """`measure` with a stand-in for vLLM's client: every round's prompts (its seed) are new and the same for
    the three servers, round 0 (the warm-up) is not pooled, unequal token counts stop the run; `rows_for`
    gives each metric's AttnRes / Llama ratio with the A/A (Llama (A/A) / Llama) beside it."""
    import bench_serve

    calls, bad = [], {}

    def fake_client(args, server, tokenizer, concurrency, seed, out_dir, name):
        calls.append((server, seed))
        return {"seed": seed, "total_input_tokens": 8, "total_output_tokens": 4 + bad.get(server, 0),
                **dict.fromkeys(bench_serve.METRICS.values(), 1.0)}

    monkeypatch.setattr(bench_serve, "client", fake_client)
    args = argparse.Namespace(concurrency=[1])
    plan = {"label": "reverse", "order": bench_serve.START_ORDERS["reverse"], "repeats": 2, "seed": 1005}
    servers, paths = {name: name for name in bench_serve.RUNNERS}, {"attnres": Path("a"), "llama": Path("l")}
    rounds, orders = bench_serve.measure(args, servers, paths, "eager", plan, Path("unused"))
    assert orders == [common.rotation(list(bench_serve.RUNNERS), r) for r in range(3)]
    assert [seed for _, seed in calls] == [1005] * 3 + [1006] * 3 + [1007] * 3
    assert [[r[name]["seed"] for name in servers] for r in rounds[1]] == [[1006] * 3, [1007] * 3]
    bad["llama-aa"] = 1
    with pytest.raises(common.UnequalWork, match="reverse start order, round 0"):
        bench_serve.measure(args, servers, paths, "eager", plan, Path("unused"))
    timed = {name: {"median_tpot_ms": 2.0, "median_ttft_ms": 5.0, "duration": 1.0} for name in servers}
    bench_serve.check_measured(timed, "here")
    timed["attnres"]["median_tpot_ms"] = 0.0                      # every token in one chunk: no TPOT
    with pytest.raises(RuntimeError, match="here: attnres's TPOT is 0.0, not measured"):
        bench_serve.check_measured(timed, "here")

    results = [{name: {**dict.fromkeys(bench_serve.METRICS.values(), s), "output_throughput": 1.0,
                       "total_input_tokens": 8, "total_output_tokens": 4}
                for name, s in zip(bench_serve.RUNNERS, p)} for p in PAIRS]
    (row,) = bench_serve.rows_for(argparse.Namespace(num_prompts=2), "eager", {1: results})
    assert row[2:] == ["2 x 4 / 2", "1.0", "1.0", RATIO, AA, RATIO, AA, RATIO, AA, 3], row
    for compilation in bench_serve.COMPILATIONS:              # every server: the same flags, prefix caching off
        flags = [bench_serve.server_args(bench_serve.parse_args(TINY), Path(p), compilation) for p in ("a", "l")]
        assert flags[0][1:] == flags[1][1:] and "--no-enable-prefix-caching" in flags[0], flags


def test_bench_boundary_row_gives_each_side_per_call_and_divides_both_ratios_by_llama(monkeypatch):
    import bench_boundary

    def fake_alternate(runs, repeats, warmup, paired):        # seconds per timed unit of 2 calls
        paired += [dict(zip(runs, (2e-6 * s for s in p))) for p in PAIRS]
        return {name: statistics.median(run[name] for run in paired) for name in runs}

    monkeypatch.setattr(bench_boundary, "alternate", fake_alternate)
    names = ("AttnRes", "Llama", "Llama (A/A)")
    makers = {name: lambda: (lambda: None, torch.zeros(1)) for name in names}
    row = bench_boundary.measure(argparse.Namespace(calls=2, repeats=3), names, makers, 4, 1, None)
    assert row == [4, 1, "6.4", "4.0", "4.4", RATIO, AA, "600.0", 3]         # (6.4 - 4.0) us / 4 tokens


def test_gpu_bench_models_rows_divide_each_attnres_backend_and_the_aa_by_llama(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench" / "gpu"))
    import bench_models

    kinds = ("attnres-triton", "attnres-torch", "llama", "llama-2")
    runs = [dict(zip(kinds, (s / 1e3 for s in (p[0], p[0] * 2, *p[1:])))) for p in PAIRS]
    rows = bench_models.workload_rows("w", runs, dict.fromkeys(runs[0]))
    assert rows == [["w", "triton", "6.4", "4.0", "4.4", RATIO, AA, 3],
                    ["w", "torch", "12.8", "4.0", "4.4", "**3.200** (3.000-4.000)", AA, 3]]


def test_profile_step_profiles_the_models_in_rotating_order_on_fresh_shared_prompts(monkeypatch, capsys):
    import profile_step
    import torch._inductor.config as inductor_config

    models = {kind: SimpleNamespace(name=kind, config=SimpleNamespace(vocab_size=50)) for kind in profile_step.MODELS}
    monkeypatch.setattr(profile_step, "build_models", lambda args, dtype: models)
    monkeypatch.setattr(profile_step, "generate_fn", lambda model, mode, new, device: lambda ids: model.name)
    profiled = []

    def fake_profiled_step_ms(run, ids, steps):
        profiled.append((run(ids), ids.clone()))
        return dict.fromkeys((*profile_step.PARTS, profile_step.OUTSIDE, "whole call"), 1.0)

    monkeypatch.setattr(profile_step, "profiled_step_ms", fake_profiled_step_ms)
    # main sets it; `patch` restores it (monkeypatch's undo would hide the option from Inductor for good).
    with inductor_config.patch({"cpp.enable_kernel_profile": False}):
        profile_step.main([*TINY, "--repeats", "6"])
    groups = [profiled[3 * r: 3 * r + 3] for r in range(6)]
    assert [[kind for kind, _ in group] for group in groups] == [common.rotation(list(profile_step.MODELS), r)
                                                                 for r in range(6)]
    assert all(torch.equal(ids, group[0][1]) for group in groups for _, ids in group)
    assert not torch.equal(groups[0][0][1], groups[1][0][1])
    assert "| whole call | 1.000 | 1.000 | 1.000 | +0.000 | +0.000 |" in capsys.readouterr().out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_llama_kernel_is_llamas_norm_bit_for_bit_where_the_sum_of_squares_is_exact(dtype):
    """Where every order of summing the squares gives the same float32 sum (multiples of 1/16, a power-of-two
    width), the kernel's output is `LlamaRMSNorm`'s exactly, its rounding of the normalised row to the dtype
    before the gain included (a kernel without that rounding stays within assert_close's tolerances)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    x, residual = ((torch.randint(-16, 17, (37, 128), generator=gen) / 16).to(dtype) for _ in range(2))
    norm = LlamaRMSNorm(128, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(128, generator=gen) + 0.5)
        expected = norm((residual.float() + x.float()).to(dtype))
        fused_llama.fused_add_rms_norm_op()(x, residual, norm.weight, 1e-5)
    assert torch.equal(x, expected), (x.float() - expected.float()).abs().max()
