"""The converter tests' one-thread setting stays inside tests/conversion."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

OUTSIDE = """
import torch
def test_threads_outside_conversion():
    assert torch.get_num_threads() == {threads}
"""
INSIDE = """
import torch
def test_threads_inside_conversion():
    assert torch.get_num_threads() == 1
"""


def test_one_thread_setting_does_not_leak_to_other_directories(tmp_path):
    """A session that runs a module under this conftest first, then one elsewhere: the second sees the
    thread count torch started with (2, set by the environment, so the check cannot pass by accident)."""
    (tmp_path / "conversion").mkdir()
    (tmp_path / "conversion" / "conftest.py").write_text((ROOT / "tests/conversion/conftest.py").read_text())
    (tmp_path / "conversion" / "test_inside.py").write_text(INSIDE)
    (tmp_path / "test_zz_outside.py").write_text(OUTSIDE.format(threads=2))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "conversion/test_inside.py",
               "test_zz_outside.py"]
    proc = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout
