"""The repository states its own semantics (docs/spec.md), and the code keeps to what it states."""

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec.md"


def spec_name_table() -> list[str]:
    """The parameter names of the spec's section 6, as written there (one pattern per line)."""
    section = SPEC.read_text().split("## 6.")[1].split("## 7.")[0]
    block = section.split("```")[1]
    return [line.split()[0] for line in block.strip().splitlines()]


def expand(pattern: str, num_layers: int) -> list[str]:
    """`model.layers.{i}.self_attn.{q,k}_norm.weight` -> every concrete name."""
    names = [pattern]
    while any("{" in n for n in names):
        name = next(n for n in names if "{" in n)
        names.remove(name)
        field = re.search(r"\{([^}]*)\}", name)
        options = [str(i) for i in range(num_layers)] if field.group(1) == "i" else field.group(1).split(",")
        names += [name[:field.start()] + option + name[field.end():] for option in options]
    return names


@pytest.mark.parametrize("options", [dict(), dict(qk_norm=True, attention_bias=True, tie_word_embeddings=True)])
def test_model_parameters_are_the_spec_table(options):
    """Every parameter of the model is in the spec's table and vice versa (optional rows by config)."""
    model = tiny_model(randomize=False, **options)
    layers = model.config.num_hidden_layers
    optional = {".bias": options.get("attention_bias", False), "_norm.weight": options.get("qk_norm", False),
                "lm_head": not options.get("tie_word_embeddings", False)}
    expected = set()
    for pattern in spec_name_table():
        if pattern.startswith("lm_head"):
            keep = optional["lm_head"]
        elif "self_attn.{q,k}_norm" in pattern:
            keep = optional["_norm.weight"]
        else:
            keep = True
        expected |= set(expand(pattern, layers)) if keep else set()
    if optional[".bias"]:
        expected |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(layers) for p in "qkvo"}
    assert set(dict(model.named_parameters())) | ({"lm_head.weight"} if optional["lm_head"] else set()) == expected


def test_nothing_cites_a_spec_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                             check=True).stdout.split()
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    citing = [f for f in tracked if f.endswith((".py", ".md")) and f != this
              and "attnres-spec.md" in (ROOT / f).read_text()]
    assert not citing, f"these files cite shared/attnres-spec.md, which is not in the repository: {citing}"
