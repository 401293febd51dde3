"""The benchmark scripts behind `make bench` run end to end at a tiny size and report their ratios.

Timings are never asserted (they depend on the machine); what must hold is that each script runs,
compares AttnRes with the same-size Llama side by side and prints a table with a ratio.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--hidden-size", "128", "--num-hidden-layers", "4", "--num-attention-heads", "2",   # head_dim 64:
        "--num-key-value-heads", "1", "--intermediate-size", "256", "--vocab-size", "256"]  # vLLM CPU attention


def run(script: str, *args: str) -> str:
    done = subprocess.run([sys.executable, str(ROOT / "bench" / script), *TINY, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def ratios(text: str) -> list[float]:
    return [float(x) for x in re.findall(r"\*\*(\d+\.\d+)x?\*\*", text)]


def test_bench_transformers_reports_prefill_decode_and_memory_ratios():
    out = run("bench_transformers.py", "--repeats", "1", "--prefill-tokens", "16", "--prompt-tokens", "4",
              "--new-tokens", "3", "--decode-batches", "1", "2", "--dtypes", "float32", "bfloat16",
              "--modes", "eager", "cpu-kernel")
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    for mode in ("eager", "cpu-kernel"):                    # (prefill, decode b1, decode b2) x 2 dtypes
        assert len([r for r in rows if f"| {mode} |" in r]) == 6, out
    assert sum("peak RSS" in r for r in rows) == 2, out
    assert len(ratios(out)) == 14 and all(r > 0 for r in ratios(out)), out


def test_bench_vllm_pairs_both_engines_in_one_process():
    out = run("bench_vllm.py", "--prompts", "2", "--prompt-tokens", "4", "--new-tokens", "2", "--repeats", "2",
              "--enforce-eager", "--kv-cache-bytes", str(64 << 20), "--skip-transformers")
    assert "vLLM attnres" in out and "vLLM llama" in out, out
    assert "2 alternating repeats" in out, out
    assert len(ratios(out)) == 1 and ratios(out)[0] > 0, out


def test_bench_depth_checks_two_phase_against_mix_site_and_reports_both():
    """The two-phase alternative is compared with `mix_site` inside the script before it is timed."""
    out = run("bench_depth.py", "--num-hidden-layers", "2", "--tokens", "1", "5", "--modes", "eager", "cpu-kernel",
              "piecewise", "--repeats", "1", "--work", "1024")
    rows = [line for line in out.splitlines() if line.startswith(("| eager", "| cpu-kernel", "| piecewise"))]
    assert len(rows) == 6, out
    assert len(ratios(out)) == 6 and all(r > 0 for r in ratios(out)), out
