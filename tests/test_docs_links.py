"""Every relative link in README.md and docs/*.md leads somewhere: the file exists and, where the link names
a `#section`, that file has a heading with that anchor (GitHub's rule, which the pages are read under)."""

import re
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces as dashes."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()   # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings (outside code blocks); a repeated heading gets -1, -2, ..."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    seen, found = Counter(), set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", text, re.M):
        base = anchor(heading)
        found.add(base if not seen[base] else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]   # not http(s):, mailto:


def test_anchor_follows_githubs_rule():
    assert anchor("vLLM's per-step configuration hashing") == "vllms-per-step-configuration-hashing"
    assert anchor("Faster eager decoding on a CPU: the C++ kernel, on by default") == (
        "faster-eager-decoding-on-a-cpu-the-c-kernel-on-by-default")
    assert anchor("`attnres-serve` and [vLLM](https://docs.vllm.ai)") == "attnres-serve-and-vllm"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, section = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(REPO) if file.is_relative_to(REPO) else file})")
        elif section and file.suffix == ".md" and section not in anchors(file):
            broken.append(f"{target} (no heading with anchor #{section} in {file.name})")
    assert not broken, f"{page.name}: broken links:\n" + "\n".join(broken)
