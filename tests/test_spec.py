"""The repository states its own semantics (docs/spec.md), and the code keeps to what it states."""

import re
import subprocess
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.support.models import tiny_model

ROOT = Path(__file__).resolve().parent.parent
SPEC = ROOT / "docs" / "spec.md"


def spec_name_table() -> list[str]:
    """The parameter names of the spec's section 6, as written there (one pattern per line)."""
    section = SPEC.read_text().split("## 6.")[1].split("## 7.")[0]
    block = section.split("```")[1]
    return [line.split()[0] for line in block.strip().splitlines()]


def expand(pattern: str, layers: list[int], experts: int) -> list[str]:
    """`model.layers.{i}.self_attn.{q,k}_norm.weight` -> every concrete name (`{i}` over `layers`, `{e}`
    over the experts, `{a,b}` over its options)."""
    names = [pattern]
    while any("{" in n for n in names):
        name = next(n for n in names if "{" in n)
        names.remove(name)
        field = re.search(r"\{([^}]*)\}", name)
        options = ([str(i) for i in layers] if field.group(1) == "i" else
                   [str(e) for e in range(experts)] if field.group(1) == "e" else field.group(1).split(","))
        names += [name[:field.start()] + option + name[field.end():] for option in options]
    return names


def rows_layers(pattern: str, config) -> list[int] | None:
    """The layers a row of the table applies to under `config` (`None`: the row does not apply)."""
    dense = [i for i in range(config.num_hidden_layers) if not config.is_sparse_layer(i)]
    if "mlp.{gate,up,down}_proj" in pattern:
        return dense
    if "shared_expert" in pattern:
        return config.sparse_layers if config.shared_expert_intermediate_size else None
    if ".mlp.gate.weight" in pattern or ".mlp.experts." in pattern:
        return config.sparse_layers
    if "self_attn.{q,k}_norm" in pattern:
        return list(range(config.num_hidden_layers)) if config.qk_norm else None
    if pattern.startswith("lm_head"):
        return None if config.tie_word_embeddings else []
    return list(range(config.num_hidden_layers))


@pytest.mark.parametrize("options", [dict(), dict(qk_norm=True, attention_bias=True, tie_word_embeddings=True),
                                     dict(num_experts=2, moe_intermediate_size=16, mlp_only_layers=[1],
                                          shared_expert_intermediate_size=8)])
def test_checkpoints_hold_exactly_the_spec_table(options, tmp_path):
    """Every tensor of a saved checkpoint is in the spec's table and vice versa (optional rows by config)."""
    model = tiny_model(randomize=False, **options)
    model.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = set(f.keys())
    expected = set()
    for pattern in spec_name_table():
        layers = rows_layers(pattern, model.config)
        if layers is not None:
            expected |= set(expand(pattern, layers, model.config.num_experts))
    if options.get("attention_bias"):
        expected |= {f"model.layers.{i}.self_attn.{p}_proj.bias" for i in range(model.config.num_hidden_layers)
                     for p in "qkvo"}
    assert saved == expected


def test_nothing_cites_a_spec_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=30,
                             check=True).stdout.split()
    this = Path(__file__).resolve().relative_to(ROOT).as_posix()
    citing = [f for f in tracked if f.endswith((".py", ".md")) and f != this
              and "attnres-spec.md" in (ROOT / f).read_text()]
    assert not citing, f"these files cite shared/attnres-spec.md, which is not in the repository: {citing}"
