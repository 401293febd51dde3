"""The benchmark scripts behind `make bench` run end to end at a tiny size and report their ratios.

Timings are never asserted (they depend on the machine); what must hold is that each script runs,
compares AttnRes with the same-size Llama side by side and prints a table with a ratio.
"""

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.support.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "128", "--num-hidden-layers", "4", "--num-attention-heads", "2",   # head_dim 64:
        "--num-key-value-heads", "1", "--intermediate-size", "256", "--vocab-size", "256"]  # vLLM CPU attention


def run(script: str, *args: str) -> str:
    done = run_bounded([sys.executable, str(ROOT / "bench" / script), *TINY, *args], timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def ratios(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\*\*(\d+\.\d+)x?\*\*", text)]


@pytest.mark.timeout(660)
def test_bench_transformers_reports_prefill_decode_and_memory_ratios():
    out = run("bench_transformers.py", "--repeats", "1", "--prefill-tokens", "16", "--prompt-tokens", "4",
              "--new-tokens", "3", "--decode-batches", "1", "2", "--dtypes", "float32", "bfloat16",
              "--modes", "eager", "cpu-kernel")
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    for mode in ("eager", "cpu-kernel"):                    # (prefill, decode b1, decode b2) x 2 dtypes
        assert len([r for r in rows if f"| {mode} |" in r]) == 6, out
    memory = [r.split("|") for r in rows if "peak RSS" in r]
    assert len(memory) == 2, out
    # The prefill's own peak (over the RSS it started from) is measured apart from the load's peak.
    assert all(float(m[5]) > 0 and float(m[6]) > 0 for m in memory), out
    assert len(ratios(out)) == 12 + 2 * 2 and all(r > 0 for r in ratios(out)), out


@pytest.mark.timeout(660)
def test_bench_vllm_pairs_both_engines_in_one_process():
    out = run("bench_vllm.py", "--prompts", "2", "--prompt-tokens", "4", "--new-tokens", "2", "--prefill-tokens", "8",
              "--repeats", "2", "--enforce-eager", "--kv-cache-bytes", str(64 << 20), "--skip-transformers")
    rows = [line for line in out.splitlines() if line.startswith(("| decode", "| prefill"))]
    assert len(rows) == 2 and "2 alternating repeats" in out, out
    assert len(ratios(out)) == 2 and all(r > 0 for r in ratios(out)), out


@pytest.mark.timeout(660)
def test_bench_depth_checks_every_path_against_mix_site_and_reports_each_lever():
    """The cat-bank and two-phase paths are compared with per-site `mix_site` inside the script before
    they are timed; each row reports three paired ratios (one per lever)."""
    out = run("bench_depth.py", "--num-hidden-layers", "2", "--tokens", "1", "5", "--modes", "eager", "cpu-kernel",
              "piecewise", "--repeats", "1", "--work", "1024", "--dtype", "bfloat16")
    rows = [line for line in out.splitlines() if line.startswith(("| eager", "| cpu-kernel", "| piecewise"))]
    assert len(rows) == 6, out
    assert len(ratios(out)) == 18 and all(r > 0 for r in ratios(out)), out


@pytest.mark.timeout(900)
def test_bench_transformers_on_a_converted_checkpoint_and_its_source(tmp_path):
    """`--model` / `--source`: an attnres-convert output against the Llama it came from, both loaded
    from their folders (the sizes come from them), with the bfloat16-vs-float64 accuracy table."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=256, max_position_embeddings=128)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    convert = run_bounded([sys.executable, "-m", "attnres.conversion.cli", str(tmp_path / "llama"),
                           str(tmp_path / "attnres"), "--block-size", "2", "--stream-scale", "1"],
                          timeout=600, cwd=ROOT)
    assert convert.returncode == 0, convert.stderr[-3000:]
    done = run_bounded([sys.executable, str(ROOT / "bench" / "bench_transformers.py"), "--model",
                           str(tmp_path / "attnres"), "--source", str(tmp_path / "llama"), "--accuracy", "--repeats",
                           "1", "--prefill-tokens", "8", "--prompt-tokens", "4", "--new-tokens", "2",
                        "--decode-batches", "1", "--dtypes", "bfloat16", "--no-memory"], timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "hidden 64, 4 layers, block size 2" in out and str(tmp_path / "llama") in out, out
    accuracy = [line for line in out.splitlines() if line.startswith(("| llama", "| attnres"))]
    assert len(accuracy) == 3, out
    # Each AttnRes row measures the bank it names: "auto" keeps bfloat16 where the kernel reads it.
    assert "| attnres | float32 | float32 |" in out and "| attnres | auto | bfloat16 |" in out, out
    assert len(ratios(out)) == 2 and all(r > 0 for r in ratios(out)), out
