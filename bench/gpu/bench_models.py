"""AttnRes vs the same-size Llama in transformers on one GPU: prefill, decode and peak memory, paired.

    python bench/gpu/bench_models.py                          # bfloat16, Llama-3-8B shapes, block size 4
    python bench/gpu/bench_models.py --compiled --num-hidden-layers 8 --decode-batches 1
    TRITON_INTERPRET=1 python bench/gpu/bench_models.py --device cpu --hidden-size 64 --num-hidden-layers 2 \\
        --num-attention-heads 2 --num-key-value-heads 1 --intermediate-size 128 --vocab-size 256 \\
        --prefill-tokens 8 --prompt-tokens 4 --new-tokens 2 --decode-batches 1 --repeats 1   # a dry run

Both models are random with the same dimensions (`bench/common.build`) and held at once. Prefill
runs alternate (AttnRes, Llama, AttnRes, ...); decoding runs the models in lock step, one token each
in turn, the order rotated every step. Each repeat gives a paired AttnRes/Llama ratio; the table
gives their median and range. AttnRes runs in two variants, its depth sites on the Triton kernels
(the default on a GPU) and on the torch path (`enable_triton_kernel(False)`); `--compiled` runs
both models under torch.compile instead (a StaticCache for decoding), where Inductor compiles the
torch path. Peak memory is the weights plus the most allocated during one prefill.
"""

import argparse
import os
import statistics
import sys
import time

import torch
from transformers import DynamicCache, StaticCache

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from common import add_size_arguments, build, markdown_table  # noqa: E402

from modeling_attnres.depth_attention_ops import site_backend  # noqa: E402
from modeling_attnres.depth_attention_triton import enable_triton_kernel  # noqa: E402

LLAMA_3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256, block_size=4)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Runner:
    """One model as the benchmark runs it: `forward` (compiled or not) and, for AttnRes, which
    depth-attention backend is on while it runs."""

    def __init__(self, model, forward, triton: bool | None = None):
        self.model, self.forward, self.triton = model, forward, triton

    def __call__(self, *args, **kwargs):
        if self.triton is not None:
            enable_triton_kernel(self.triton)
        with torch.inference_mode():
            return self.forward(*args, **kwargs)


class Decoder:
    """Greedy decoding of one runner, one step per `step()`; the prompt is prefilled untimed. `cache`
    is a StaticCache reused (reset) across runs, so that a compiled forward sees the same cache
    object and never recompiles; `None` means a fresh DynamicCache."""

    def __init__(self, runner: Runner, prompt: torch.Tensor, cache: StaticCache | None):
        model = runner.model
        if cache is None:
            cache = DynamicCache(config=model.config)
        else:
            cache.reset()
        self.runner, self.cache, self.pos = runner, cache, prompt.shape[1]
        forward, runner.forward = runner.forward, model                # the prompt runs uncompiled
        try:
            out = runner(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1,
                         cache_position=torch.arange(self.pos, device=prompt.device))
        finally:
            runner.forward = forward
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)

    def step(self) -> None:
        position = torch.tensor([self.pos], device=self.next.device)
        out = self.runner(self.next, past_key_values=self.cache, use_cache=True, cache_position=position,
                          position_ids=position.expand(self.next.shape[0], 1))
        self.next = out.logits[:, -1].argmax(-1, keepdim=True)
        self.pos += 1


def paired(seconds: list[dict[str, float]], kind: str, baseline: str) -> str:
    ratios = [s[kind] / s[baseline] for s in seconds]
    return f"**{statistics.median(ratios):.3f}** ({min(ratios):.3f}-{max(ratios):.3f})"


def time_prefill(runners: dict[str, Runner], ids: torch.Tensor, repeats: int, device: str) -> list[dict]:
    """Seconds per runner per repeat, the runners alternating (one untimed warm-up round)."""
    results = []
    for repeat in range(repeats + 1):
        order = list(runners) if repeat % 2 == 0 else list(runners)[::-1]
        seconds = {}
        for kind in order:
            sync(device)
            start = time.perf_counter()
            runners[kind](ids, use_cache=False, logits_to_keep=1)
            sync(device)
            seconds[kind] = time.perf_counter() - start
        if repeat:
            results.append(seconds)
    return results


def time_decode(runners: dict[str, Runner], prompt: torch.Tensor, args, static: bool) -> list[dict]:
    """Seconds per runner per repeat of `new_tokens` steps in lock step (one untimed warm-up repeat)."""
    length = prompt.shape[1] + args.new_tokens + 1
    caches = {kind: StaticCache(config=r.model.config, max_cache_len=length) if static else None
              for kind, r in runners.items()}
    results = []
    for repeat in range(args.repeats + 1):
        decoders = {kind: Decoder(r, prompt, caches[kind]) for kind, r in runners.items()}
        seconds = dict.fromkeys(runners, 0.0)
        kinds = list(runners)
        for i in range(args.new_tokens if repeat else 3):
            for kind in kinds[i % len(kinds):] + kinds[: i % len(kinds)]:
                sync(args.device)
                start = time.perf_counter()
                decoders[kind].step()
                sync(args.device)
                seconds[kind] += time.perf_counter() - start
        if repeat:
            results.append(seconds)
    return results


def peak_memory_rows(runners: dict[str, Runner], ids: torch.Tensor) -> list[list]:
    """Weights + the most allocated during one prefill, per runner (the other model stays resident,
    so only the growth over what was allocated before counts)."""
    peaks = {}
    for kind, runner in runners.items():
        weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        runner(ids, use_cache=False, logits_to_keep=1)
        torch.cuda.synchronize()
        peaks[kind] = (weights + torch.cuda.max_memory_allocated() - before) / 2**20
    return [[f"peak allocated, prefill 1x{ids.shape[1]}", kind, f"{peak:.0f}", f"{peaks['llama']:.0f}",
             f"**{peak / peaks['llama']:.3f}**"] for kind, peak in peaks.items() if kind != "llama"]


def check_backends_agree(runners: dict[str, Runner], vocab: int, device: str) -> str:
    """The AttnRes logits with the Triton kernels and with the torch path, on one prompt. The
    pseudo-queries start at zero (uniform weights); they get random values first (the timings do
    not depend on them) so that the check sees real softmaxes."""
    model = runners["attnres-torch"].model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_res_proj" in name:
                param.normal_(0, model.config.hidden_size**-0.5)
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    a = runners["attnres-triton"](ids, use_cache=False).logits.float()
    b = runners["attnres-torch"](ids, use_cache=False).logits.float()
    error = float((a - b).abs().max() / b.abs().max().clamp(min=1e-6))
    if error > 2e-2:                                   # bfloat16 activations: a few ulps of the largest logit
        raise SystemExit(f"FAILED: AttnRes logits differ between the Triton kernels and the torch path by "
                         f"{error:.3g} of the largest logit (expected <= 2e-2 in bfloat16).")
    return f"{error:.1e}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    parser.set_defaults(**LLAMA_3_8B)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compiled", action="store_true", help="torch.compile both models (Inductor)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the Triton kernels only under Triton's interpreter: set TRITON_INTERPRET=1")
    dtype = getattr(torch, args.dtype)
    models = {kind: build(kind, args, dtype, device=args.device) for kind in ("attnres", "llama")}
    if args.compiled:
        runners = {f"{k}-compiled": Runner(m, torch.compile(m.forward, fullgraph=True, dynamic=False),
                                           triton=False if k == "attnres" else None) for k, m in models.items()}
        runners["llama"] = runners.pop("llama-compiled")
    else:
        runners = {"attnres-triton": Runner(models["attnres"], models["attnres"], triton=True),
                   "attnres-torch": Runner(models["attnres"], models["attnres"], triton=False),
                   "llama": Runner(models["llama"], models["llama"])}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (Triton interpreter: a dry run)"
    with torch.inference_mode():
        enable_triton_kernel(True)
        backend = site_backend(torch.zeros(1, device=args.device))
    backend = "the torch path, compiled by Inductor" if args.compiled else f"{backend} (eager)"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, hidden {args.hidden_size}, {args.num_hidden_layers} "
          f"layers, block size {args.block_size}, vocab {args.vocab_size}; AttnRes sites in inference: {backend}"
          + ("" if args.compiled else f"; Triton vs torch-path logits agree to "
             f"{check_backends_agree(runners, args.vocab_size, args.device)} of the largest") + "\n")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (1, args.prefill_tokens), generator=gen).to(args.device)
    rows = [("prefill", f"1x{args.prefill_tokens}", time_prefill(runners, ids, args.repeats, args.device))]
    for batch in args.decode_batches:
        prompt = torch.randint(0, args.vocab_size, (batch, args.prompt_tokens), generator=gen).to(args.device)
        rows.append((f"decode (prompt {args.prompt_tokens})", f"{batch}x{args.new_tokens}",
                     time_decode(runners, prompt, args, static=args.compiled)))
    table = [[workload, shape, kind, f"{statistics.median(s[kind] for s in seconds) * 1e3:.1f}",
              f"{statistics.median(s['llama'] for s in seconds) * 1e3:.1f}", paired(seconds, kind, "llama")]
             for workload, shape, seconds in rows for kind in runners if kind != "llama"]
    print(markdown_table(["workload", "tokens", "AttnRes", "AttnRes ms", "Llama ms",
                          f"AttnRes / Llama (median of {args.repeats} pairs, range)"], table))
    if args.device == "cuda":
        print("\n" + markdown_table(["memory", "AttnRes", "AttnRes MiB", "Llama MiB", "ratio"],
                                    peak_memory_rows(runners, ids)))


if __name__ == "__main__":
    main()
