"""Render what an AttnRes model's depth attention learned: a site x source heat-map PNG and a table.

    .venv/bin/python examples/plot_depth_attention.py models/attnres-tiny --out docs/depth_attention.png

For every site (before the attention and before the MLP of each layer, then the output site) the
cell in column `s` is the depth-attention weight on source `s`, averaged over every token of the
text (`--text-file`; by default the model folder's `heldout_sample.txt`, else a built-in snippet).
Block AttnRes sources are the embedding (`emb`), the completed blocks (`B1`, `B2`, ...) and the
running partial block (`partial`); Full AttnRes sources are the embedding and every sublayer
output. Rows of a site that cannot see a source are blank. Runs headless (matplotlib's Agg).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from attnres.conversion.publish import staged_file

FALLBACK_TEXT = '''import os


class Config:
    """A small configuration holder."""

    def __init__(self, path, verbose=False):
        self.path = path
        self.verbose = verbose

    def load(self):
        with open(self.path) as f:
            return [line.strip() for line in f if line.strip()]
'''


class PlotError(Exception):
    """A user-facing error: bad path, wrong model type, bad output."""


def read_config(path: Path) -> dict:
    """`config.json` of a checkpoint folder, with errors that say what is wrong and what to pass."""
    if not path.exists():
        raise PlotError(f"model path {str(path)!r} does not exist; "
                        "pass a checkpoint folder such as models/attnres-tiny")
    if not path.is_dir():
        raise PlotError(f"model path {str(path)!r} is a file; pass the checkpoint folder that contains config.json")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise PlotError(f"{str(path)!r} has no config.json, so it is not a transformers checkpoint folder; "
                        f"pass a folder written by save_pretrained (e.g. models/attnres-tiny)")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise PlotError(f"{config_file} is not valid JSON ({err}); re-export the checkpoint") from err


def load_model(path: Path):
    """The AttnRes model and tokenizer at `path`; refuses other architectures by name."""
    model_type = read_config(path).get("model_type")
    if model_type != "attnres":
        raise PlotError(f"{str(path)!r} is a {model_type!r} checkpoint, not an AttnRes one (model_type 'attnres'); "
                        f"only AttnRes models have depth attention to plot. Pass an AttnRes checkpoint folder, "
                        f"or convert this model first (see the conversion section of the README).")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_attnres  # noqa: F401  (registers the architecture with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def site_labels(config) -> list[str]:
    """`L0.attn`, `L0.mlp`, ..., `out`: the order of `depth_attentions`."""
    labels = [f"L{i}.{kind}" for i in range(config.num_hidden_layers) for kind in ("attn", "mlp")]
    return labels + ["out"]


def source_labels(config) -> list[str]:
    """Column labels. Block: `emb`, `B1`..., `partial`; Full: `emb` and every sublayer output."""
    if config.attn_res_mode == "full":
        return ["emb"] + site_labels(config)[:-1]
    return ["emb"] + [f"B{i}" for i in range(1, config.num_depth_sources - 1)] + ["partial"]


def place(weights: torch.Tensor, columns: int, mode: str) -> list[float]:
    """Put one site's mean weights `[n]` into the table's columns (NaN where the site has no such source).

    Full AttnRes sources line up from the left; in Block AttnRes the stored blocks line up from the
    left and the site's own partial block goes in the last column. The first site sees only the
    embedding (which is its partial), so it goes in the `emb` column.
    """
    row = [float("nan")] * columns
    values = weights.tolist()
    if mode == "full" or len(values) == 1:   # a lone source is the embedding (layer 0's attention site)
        row[: len(values)] = values
    else:
        row[: len(values) - 1] = values[:-1]
        row[-1] = values[-1]
    return row


@torch.no_grad()
def mean_depth_weights(model, tokenizer, text: str, max_tokens: int) -> list[list[float]]:
    """Per site, the depth-attention weights averaged over all tokens of `text` (windows of the context)."""
    # The backend tokenizer directly: the text is longer than the context on purpose (it is windowed).
    ids = torch.tensor(tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids[:max_tokens])
    if ids.numel() < 2:
        raise PlotError("the text has fewer than 2 tokens; pass a longer --text-file")
    window = model.config.max_position_embeddings
    sums, count = None, 0
    for start in range(0, ids.numel(), window):
        chunk = ids[start : start + window][None]
        sites = model(input_ids=chunk, output_depth_attentions=True).depth_attentions
        batch_sums = [site.float().sum(dim=(0, 1)) for site in sites]
        sums = batch_sums if sums is None else [a + b for a, b in zip(sums, batch_sums)]
        count += chunk.numel()
    columns = len(source_labels(model.config))
    return [place(s / count, columns, model.config.attn_res_mode) for s in sums]


def format_table(rows: list[list[float]], sites: list[str], sources: list[str]) -> str:
    """A fixed-width text table; blank where a site cannot see a source."""
    width = max(7, *(len(s) + 1 for s in sources))
    lines = ["site".ljust(8) + "".join(s.rjust(width) for s in sources)]
    for label, row in zip(sites, rows):
        cells = ["".rjust(width) if v != v else f"{v:.3f}".rjust(width) for v in row]
        lines.append(label.ljust(8) + "".join(cells))
    return "\n".join(lines)


def render_png(rows, sites, sources, out: Path, title: str) -> None:
    """Draw the heat map with matplotlib's Agg backend; write to a temporary name, then rename."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.ma.masked_invalid(np.array(rows, dtype=float))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.0 + 0.8 * len(sources)), 1.4 + 0.38 * len(sites)), dpi=110)
    image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(sources)), sources, rotation=45 if len(sources) > 8 else 0)
    ax.set_yticks(range(len(sites)), sites)
    ax.set_xlabel("source")
    ax.set_ylabel("site")
    ax.set_title(title, fontsize=10)
    fontsize = 8 if len(sources) <= 8 else 6
    for (r, c), value in np.ndenumerate(np.array(rows, dtype=float)):
        if value == value:
            ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=fontsize,
                    color="black" if value > 0.6 else "white")
    fig.colorbar(image, ax=ax, label="mean depth-attention weight")
    fig.tight_layout()
    with staged_file(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def check_output(out: Path) -> None:
    """The output must be a .png whose folder exists."""
    if out.suffix.lower() != ".png":
        raise PlotError(f"--out {str(out)!r} must end in .png")
    if not out.parent.is_dir():
        raise PlotError(f"the folder of --out {str(out)!r} does not exist; create {str(out.parent)!r} first")


def read_text(model_path: Path, text_file: Path | None) -> tuple[str, str]:
    """The text to average over and a short description of where it came from."""
    if text_file is not None:
        if not text_file.is_file():
            raise PlotError(f"--text-file {str(text_file)!r} is not a file; pass a UTF-8 text file")
        return text_file.read_text(encoding="utf-8", errors="replace"), text_file.name
    sample = model_path / "heldout_sample.txt"
    if sample.is_file():
        return sample.read_text(encoding="utf-8"), sample.name
    return FALLBACK_TEXT, "built-in snippet"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="AttnRes checkpoint folder (e.g. models/attnres-tiny)")
    p.add_argument("--out", type=Path, default=Path("depth_attention.png"), help="PNG to write")
    p.add_argument("--text-file", type=Path, help="text to average over (default: the model's heldout_sample.txt)")
    p.add_argument("--max-tokens", type=int, default=2048)
    args = p.parse_args(argv)
    if args.max_tokens < 2:
        p.error(f"--max-tokens must be at least 2 (the weights are averaged over the tokens), got {args.max_tokens}")
    try:
        check_output(args.out)
        text, origin = read_text(args.model, args.text_file)
        model, tokenizer = load_model(args.model)
        rows = mean_depth_weights(model, tokenizer, text, args.max_tokens)
    except PlotError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sites, sources = site_labels(model.config), source_labels(model.config)
    print(format_table(rows, sites, sources))
    mode = "Block" if model.config.attn_res_mode == "block" else "Full"
    title = f"{args.model.name} ({mode} AttnRes)\nmean depth-attention weight per site over {origin}"
    render_png(rows, sites, sources, args.out, title)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
