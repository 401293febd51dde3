"""Measure what conversion costs at a given rms_norm_eps: `python -m attnres.conversion.eps_report`.

Builds random-init source models of each supported architecture (transformers' own init, embedding
std 0.02: the worst case the spec names, since `mean(H^2)` is then closest to eps), converts them
with `attnres-convert`'s code at several stream scales (and the calibrated one) and prints a
Markdown table of the relative logit error `max|converted - source| / max|source|`, in float64.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from .converter import convert
from .datatypes import ConvertOptions

CONFIGS = {"Llama": LlamaConfig, "Qwen2": Qwen2Config, "Qwen3": Qwen3Config, "Mistral": MistralConfig}
SHAPE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, tie_word_embeddings=False, sliding_window=None)


def relative_error(src: Path, dst: Path, ids: torch.Tensor) -> float:
    """max |logit difference| / max |source logit|, both models in float64."""
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float64)(ids).logits
        got = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float64)(ids).logits
    return float((got - ref).abs().max() / ref.abs().max())


def measure(arch: str, layers: int, eps: float, scales: list, block_size, work: Path) -> list[str]:
    """One table row: the error for each scale (None: the converter's calibrated choice)."""
    config = CONFIGS[arch](**SHAPE, num_hidden_layers=layers, rms_norm_eps=eps)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(work / "src")
    ids = torch.randint(0, SHAPE["vocab_size"], (4, 32), generator=torch.Generator().manual_seed(1))
    cells = []
    for scale in scales:
        result = convert(work / "src", work / "dst", ConvertOptions(
            stream_scale=scale, block_size=block_size, verify=False, overwrite=True, dtype="float32"))
        cells.append(f"{relative_error(work / 'src', work / 'dst', ids):.1e}"
                     + (f" (s={result.stream_scale:g})" if scale is None else ""))
    return cells


def main() -> None:
    """Print the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=None, help="layers per block (default ceil(L/8))")
    parser.add_argument("--eps", type=float, nargs="+", default=[1e-6, 1e-5])
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 2.0])
    args = parser.parse_args()
    scales = [*args.scales, None]
    print("| source | eps | " + " | ".join(f"s={s:g}" if s else "calibrated" for s in scales) + " |")
    print("|---" * (len(scales) + 2) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for arch in CONFIGS:
            for eps in args.eps:
                cells = measure(arch, args.layers, eps, scales, args.block_size, Path(tmp))
                print(f"| {arch} | {eps:g} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
