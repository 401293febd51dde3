"""The committed model: loads through the Auto classes, writes Python, and measures what its card says."""

import json
import math
import os
import re
import sys

import attnres_data
import pytest
import torch
from model_card import HELDOUT_FILE

from modeling_attnres import AttnResForCausalLM
from tests.examples.conftest import SHIPPED_MODEL
from tests.support.processes import run_bounded

PYTHON_MARKERS = ("def ", "import ", "self", "return", "class ", " = ", "if ", "for ", "None")


def card_value(pattern: str) -> float:
    text = (SHIPPED_MODEL / "README.md").read_text()
    match = re.search(pattern, text)
    assert match, f"model card has no line matching {pattern!r}"
    return float(match.group(1))


def test_is_a_small_block_attnres_model(shipped):
    model, tokenizer = shipped
    assert isinstance(model, AttnResForCausalLM)
    cfg = model.config
    assert cfg.attn_res_mode == "block" and cfg.num_depth_sources - 1 >= 3      # several blocks + embedding
    params = sum(p.numel() for p in model.parameters())
    assert 1e6 < params < 2e7
    assert (SHIPPED_MODEL / "model.safetensors").stat().st_size < 40e6
    assert len(tokenizer) == cfg.vocab_size
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("prompt", ["class Reader:\n    def __init__(self", "    def close(self):\n        "])
def test_greedy_generation_reads_as_python(shipped, prompt):
    model, tokenizer = shipped
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
    text = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    found = [m for m in PYTHON_MARKERS if m in text]
    assert len(found) >= 2, f"continuation does not look like Python: {text!r}"


def test_heldout_loss_matches_the_card_and_beats_uniform(shipped):
    model, tokenizer = shipped
    text = (SHIPPED_MODEL / HELDOUT_FILE).read_text(encoding="utf-8")
    loss, windows = attnres_data.heldout_loss(model, tokenizer, text, model.config.max_position_embeddings)
    assert windows >= 4
    uniform = math.log(model.config.vocab_size)
    assert loss < uniform - 2.5, f"held-out loss {loss:.3f} is not far below uniform {uniform:.3f}"
    assert loss == pytest.approx(card_value(r"Held-out sample loss: ([0-9.]+) nats/token"), abs=2e-3)


def test_card_metrics_and_files_agree():
    metrics = json.loads((SHIPPED_MODEL / "metrics.json").read_text())
    assert metrics["arch"] == "block"
    assert card_value(r"Validation loss: ([0-9.]+) nats/token") == pytest.approx(metrics["val_loss"], abs=1e-4)
    generation = json.loads((SHIPPED_MODEL / "generation_config.json").read_text())
    assert generation["do_sample"] is False and generation["eos_token_id"] is not None


def test_tokenizer_round_trips_code_and_has_a_chat_template(shipped):
    _, tokenizer = shipped
    code = "def f(x):\n    return x ** 2  # square\n"
    assert tokenizer.decode(tokenizer(code).input_ids) == code
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "import sys"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "import sys"
    # messages joined by newlines, as transformers and vLLM render templates (trim_blocks)
    turns = [{"role": "system", "content": "import os"}, {"role": "user", "content": "import sys"}]
    assert tokenizer.apply_chat_template(turns, tokenize=False) == "import os\nimport sys"


def test_shipped_remote_code_is_the_current_modeling_code():
    """The model folder's copy of the modeling files (Hub remote code) must not drift from the package."""
    from pathlib import Path

    import modeling_attnres
    from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES

    package = Path(modeling_attnres.__file__).parent
    for name in REMOTE_CODE_FILES:
        assert (SHIPPED_MODEL / name).read_text() == (package / name).read_text(), (
            f"{SHIPPED_MODEL / name} is stale: copy it from {package / name} (or re-run save_pretrained)")


def card_snippet(folder) -> str:
    """The Python code block of the card's `## Use` section."""
    use = (folder / "README.md").read_text().split("## Use", 1)[1]
    return use.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.timeout(120)
def test_the_cards_use_snippet_runs_outside_the_checkout(tmp_path):
    """A user of the wheel has no `models/` folder: the card's snippet finds the shipped copy through the
    package, from any folder, and completes the code."""
    snippet = card_snippet(SHIPPED_MODEL)
    done = run_bounded([sys.executable, "-c", snippet], timeout=100, cwd=tmp_path,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.startswith("class Reader:\n    def __init__(self") and len(done.stdout) > 60, done.stdout
