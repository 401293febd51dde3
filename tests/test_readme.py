"""The README's commands that run offline, run as a user would, against what the README says they print.

(The `make` targets run in CI through `make test`; the Hub and registry commands are covered by the
conversion and default-model tests against a local Hub and a local index.)
"""

import re
import sys
from pathlib import Path

import pytest

from tests.support.processes import run_bounded

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def section(title: str) -> str:
    """The text of the README section headed `## title...` (up to the next `## `)."""
    start = README.index(f"\n## {title}")
    end = README.find("\n## ", start + 4)
    return README[start:end if end > 0 else None]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


@pytest.mark.timeout(300)
def test_load_and_generate_prints_what_the_readme_shows(tmp_path):
    text = section("Load and generate")
    (code,), (shown,) = blocks(text, "python"), blocks(text, "text")
    done = run_bounded([sys.executable, "-c", code], timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == shown, f"README shows:\n{shown}\nthe code prints:\n{done.stdout}"


@pytest.mark.timeout(300)
def test_quantize_prints_what_the_readme_shows(tmp_path):
    text = section("Quantize")
    command = blocks(text, "bash")[0].splitlines()[0].split("#")[0].split()
    assert command[:2] == ["attnres-quantize", "builtin:attnres-tiny"]
    out = tmp_path / "w8a8"                              # run outside the checkout: a wheel user has none
    done = run_bounded([str(Path(sys.executable).parent / command[0]), command[1], str(out)], timeout=240,
                       cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    shown = re.search(r"prints `(Quantized \d+ linear weights[^`]*)`", text).group(1)
    assert done.stdout.strip() == shown.replace(command[2], str(out)), (done.stdout, shown)


def test_the_readme_links_resolve_and_speak_to_users():
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (REPO / target).exists(), f"README links to {target}, which does not exist"
    assert len(README.splitlines()) <= 250
    for word in ("issue ", "this session", "run A", "for the record"):
        assert word not in README, f"README speaks of {word!r}"
