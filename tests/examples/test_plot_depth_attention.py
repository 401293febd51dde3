"""The heat-map command: headless PNG + terminal table for AttnRes; clear errors for everything else."""

import os
import struct
import subprocess
import sys

import plot_depth_attention as plot
import pytest
import torch

from tests.examples.conftest import EXAMPLES, REPO, SHIPPED_MODEL
from tests.support.models import tiny_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    """(width, height) from the IHDR chunk; fails unless the file starts like a PNG."""
    head = path.read_bytes()[:24]
    assert head[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_cli_runs_headless_on_the_shipped_model(tmp_path):
    out = tmp_path / "depth.png"
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "MPLBACKEND", "WAYLAND_DISPLAY")}
    command = [sys.executable, str(EXAMPLES / "plot_depth_attention.py"), str(SHIPPED_MODEL),
               "--out", str(out), "--max-tokens", "256"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    width, height = png_size(out)
    assert width > 300 and height > 300
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["site", "emb", "B1", "B2", "B3", "partial"]
    assert [line.split()[0] for line in lines[1:4]] == ["L0.attn", "L0.mlp", "L1.attn"]
    out_row = next(line for line in lines if line.startswith("out "))
    weights = [float(v) for v in out_row.split()[1:]]
    assert len(weights) == 5 and abs(sum(weights) - 1) < 5e-3       # the output site sees every source
    assert not list(tmp_path.glob(".*tmp*"))                          # temp file renamed away


def test_rows_are_distributions_and_respect_causality(shipped):
    model, tokenizer = shipped
    rows = plot.mean_depth_weights(model, tokenizer, plot.FALLBACK_TEXT, max_tokens=64)
    sites, sources = plot.site_labels(model.config), plot.source_labels(model.config)
    assert len(rows) == len(sites) == 2 * model.config.num_hidden_layers + 1
    assert rows[0][0] == pytest.approx(1.0)                            # L0.attn sees only the embedding
    for site, row in zip(sites, rows):
        seen = [v for v in row if v == v]
        assert sum(seen) == pytest.approx(1.0, abs=1e-4), site
    # Layer 2's MLP site (second block) sees emb, B1 and its partial, but not B2/B3 yet.
    row = rows[sites.index("L2.mlp")]
    assert [v == v for v in row] == [True, True, False, False, True]
    assert sources == ["emb", "B1", "B2", "B3", "partial"]


def test_full_attnres_labels_every_sublayer():
    config = tiny_config(attn_res_mode="full", num_hidden_layers=2)
    assert plot.source_labels(config) == ["emb", "L0.attn", "L0.mlp", "L1.attn", "L1.mlp"]
    assert plot.place(torch.tensor([0.5, 0.5]), 5, "full")[:3] == [0.5, 0.5, pytest.approx(float("nan"), nan_ok=True)]


def test_format_table_leaves_unseen_sources_blank():
    text = plot.format_table([[1.0, float("nan"), 0.0]], ["L0.attn"], ["emb", "B1", "partial"])
    assert text.splitlines()[1].split() == ["L0.attn", "1.000", "0.000"]


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "file.txt").write_text("x") and p / "file.txt", "is a file"),
    (lambda p: p, "has no config.json"),
])
def test_bad_paths_give_clear_errors(tmp_path, capsys, make, message):
    rc = plot.main([str(make(tmp_path)), "--out", str(tmp_path / "x.png")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "x.png").exists()


def test_llama_checkpoint_is_refused_by_name(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "llama")
    rc = plot.main([str(tmp_path / "llama"), "--out", str(tmp_path / "x.png")])
    assert rc == 2
    assert "is a 'llama' checkpoint, not an AttnRes one" in capsys.readouterr().err


def test_bad_output_path_is_refused_before_loading(tmp_path, capsys):
    assert plot.main([str(SHIPPED_MODEL), "--out", str(tmp_path / "x.jpg")]) == 2
    assert "must end in .png" in capsys.readouterr().err
    assert plot.main([str(SHIPPED_MODEL), "--out", str(tmp_path / "no" / "x.png")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_too_few_tokens_name_the_option(tmp_path, capsys):
    """--max-tokens 0 is the option's fault, not the text's."""
    with pytest.raises(SystemExit) as exited:
        plot.main([str(SHIPPED_MODEL), "--out", str(tmp_path / "x.png"), "--max-tokens", "0"])
    assert exited.value.code == 2
    assert "--max-tokens must be at least 2 (the weights are averaged over the tokens), got 0" in \
        capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_a_text_longer_than_the_context_averages_every_window(shipped):
    """Every token of the text counts, window after window of the model's context, not the first window again."""
    from modeling_attnres import AttnResForCausalLM
    from tests.support.models import randomize_depth_parameters

    _, tokenizer = shipped
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=8)).eval()
    randomize_depth_parameters(model, seed=1, scale=3.0)
    rows = plot.mean_depth_weights(model, tokenizer, plot.FALLBACK_TEXT, max_tokens=20)
    ids = torch.tensor(tokenizer.backend_tokenizer.encode(plot.FALLBACK_TEXT, add_special_tokens=False).ids[:20])
    with torch.no_grad():
        sites = [model(input_ids=ids[s : s + 8][None], output_depth_attentions=True).depth_attentions
                 for s in range(0, 20, 8)]
    columns = len(plot.source_labels(model.config))
    for i, row in enumerate(rows):
        mean = sum(window[i].float().sum(dim=(0, 1)) for window in sites) / 20
        assert row == pytest.approx(plot.place(mean, columns, "block"), nan_ok=True, abs=1e-6)


def test_the_text_comes_from_text_file_then_the_models_heldout_sample_then_the_snippet(tmp_path):
    """--text-file wins; without it the model folder's heldout_sample.txt, else the built-in snippet."""
    (tmp_path / "heldout_sample.txt").write_text("held out")
    (tmp_path / "mine.txt").write_text("my text")
    assert plot.read_text(tmp_path, tmp_path / "mine.txt") == ("my text", "mine.txt")
    assert plot.read_text(tmp_path, None) == ("held out", "heldout_sample.txt")
    assert plot.read_text(tmp_path / "other", None) == (plot.FALLBACK_TEXT, "built-in snippet")
