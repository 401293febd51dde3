"""AttnRes vs Llama in transformers, run as users run them (`model.generate()`), with an A/A control.

    python bench/bench_transformers.py                   # random weights at hidden 1024, 16 layers
    python bench/bench_transformers.py --hidden-size 256 --num-hidden-layers 4 --repeats 6
    python bench/bench_transformers.py --smollm2 --accuracy --dtypes bfloat16   # real weights vs their source

Three models are held at once: AttnRes, the same-size Llama (with `--model` / `--source`, the real
weights, the source in transformers' own Llama class) and a second instance of that Llama built the
same way (the A/A control). Every repeat makes fresh random prompts, shared by the three, which then
run one whole `generate()` call each in the rotating order of `common.rotation` (each model first
equally often, a linear drift cancelled within each pair of repeats), after an untimed warm-up at the
timed size; every call must produce the same number of tokens (else the run stops). The models are built
in one order in one fresh process and in the reverse order in another, one after the other (`--build-order
both`, the default; the repeats split between them, their pairs pooled): which model is built first, where
its tensors land, must not pass for a difference between models. The table gives each model's median
time, the median and min-max of the paired AttnRes/Llama ratios and, beside it, the same for Llama
(A/A)/Llama: two identical models measured the same way, the error bar of the ratio; and both per build
order.

Workloads: prefill (one `--prefill-tokens` prompt, one new token) and decode (`--decode-batches` x
`--prompt-tokens` prompts, `--new-tokens` new tokens each, greedy, EOS ignored). Modes: `eager`
(transformers' default path: sdpa attention, a `DynamicCache`; AttnRes as `from_pretrained` gives it,
which includes its fused C++ boundary kernel where it builds, unless `ATTNRES_CPU_KERNEL=0`),
`torch-path` (AttnRes with that kernel off, `enable_cpu_kernel(False)`: the torch reference; Llama
unchanged), `fused-llama` (AttnRes as in `eager`, against a Llama and its A/A control whose residual
adds are fused into the next RMSNorm by a C++ kernel built like AttnRes's, `fused_llama.py`: the same
residual-path fusion as AttnRes's boundary kernel, so the ratio is what depth attention itself costs) and
`compiled` (`generate(..., cache_implementation="static", compile_config=...)`, transformers' recipe:
it compiles the decoding steps, with CUDA graphs on a GPU; the prefill stays eager there, so compiled
mode has no prefill row). Peak memory: each model in `--memory-probes` fresh processes, the peak RSS
of a prefill, its own peak over the RSS it started from, and the allocator's bytes at its peak over
those before, beside the bank's size (medians). `--accuracy` first compares each
model's bfloat16 logits with its own float64 logits, AttnRes with each bank dtype.
"""

import argparse
import contextlib
import ctypes
import gc
import json
import os
import re
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import CompileConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    TIMED,
    add_model_arguments,
    add_size_arguments,
    balanced,
    build,
    check_model_arguments,
    describe,
    footer,
    header,
    markdown_table,
    median_ms,
    ratios,
    rotate_runs,
    rotation,
    run_logged,
    spread,
)
from fused_llama import fused_add_norm, fused_add_rms_norm_op  # noqa: E402

from modeling_attnres import enable_cpu_kernel  # noqa: E402
from modeling_attnres.depth_attention import bank_dtype  # noqa: E402
from modeling_attnres.depth_attention_ops import site_bank  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODELS = ("attnres", "llama", "llama-2")        # subject, baseline, A/A control (a second baseline)
MODES = ("eager", "fused-llama", "torch-path", "compiled")
LABELS = {"attnres": "AttnRes", "llama": "Llama", "llama-2": "Llama (A/A)"}
BUILD_ORDERS = {"forward": list(MODELS), "reverse": list(MODELS)[::-1]}     # construction orders


def compile_config(device: str) -> CompileConfig:
    """transformers' compile settings for `generate`: CUDA graphs (`reduce-overhead`) on a GPU; on a CPU,
    where `generate` compiles only when told to, Inductor's default mode."""
    if device.startswith("cuda"):
        return CompileConfig(fullgraph=True, mode="reduce-overhead")
    config = CompileConfig(fullgraph=True, mode="default")
    config._compile_all_devices = True
    return config


def generate_fn(model, mode: str, new_tokens: int, device: str):
    """One greedy `generate()` call of exactly `new_tokens` tokens per prompt; returns the output ids."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if mode == "compiled":
        kwargs.update(cache_implementation="static", compile_config=compile_config(device))

    def run(ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return run


def random_ids(args, batch: int, tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, args.vocab_size, (batch, tokens), generator=gen).to(args.device)


def kernel_by_default() -> bool:
    """Whether `from_pretrained` users get the C++ kernel here: on unless `ATTNRES_CPU_KERNEL` turns it
    off (a machine that cannot build it makes `enable_cpu_kernel(True)` raise, with the reason)."""
    return os.environ.get("ATTNRES_CPU_KERNEL", "auto").strip().lower() not in ("0", "false", "no", "off")


def time_mode(args, models: dict, dtype_name: str, mode: str) -> list[list]:
    """The rows of one dtype and mode (`fused-llama`: both Llamas with fused add+norm, see `fused_llama`)."""
    with contextlib.ExitStack() as stack:
        if mode == "fused-llama":
            op = fused_add_rms_norm_op()
            for kind in ("llama", "llama-2"):
                stack.enter_context(fused_add_norm(models[kind], op))
        return _time_mode(args, models, dtype_name, mode)


def _time_mode(args, models: dict, dtype_name: str, mode: str) -> list[dict]:
    """The timed runs of one dtype and mode: prefill (not in compiled mode) and each decode batch, each as
    `{"workload", "dtype", "mode", "runs"}` with `runs` the seconds of every model in every repeat."""
    enable_cpu_kernel(mode != "torch-path" and kernel_by_default())    # AttnRes only: Llama never calls it
    shapes = [] if mode == "compiled" else [("prefill", 1, args.prefill_tokens, 1)]
    shapes += [("decode", b, args.prompt_tokens, args.new_tokens) for b in args.decode_batches]
    timed = []
    for index, (kind, batch, tokens, new) in enumerate(shapes):
        runners = {k: generate_fn(models[k], mode, new, args.device) for k in MODELS}   # rotation: MODELS order

        def inputs(repeat: int, batch=batch, tokens=tokens, index=index) -> torch.Tensor:
            return random_ids(args, batch, tokens, args.seed + 1000 * index + repeat)

        runs = rotate_runs(runners, inputs, args.repeats, count=lambda out: tuple(out.shape))
        name = f"prefill 1x{tokens}" if kind == "prefill" else f"decode {batch}x{new} (prompt {tokens})"
        timed.append({"workload": name, "dtype": dtype_name, "mode": mode, "runs": runs})
    enable_cpu_kernel(False)
    return timed


def build_models(args, dtype: torch.dtype, order: tuple[str, ...] | list[str] = MODELS) -> dict:
    """AttnRes, Llama and a second Llama (the same weights, its own tensors), eval mode, built in `order`."""
    models = {kind: build(kind.removesuffix("-2"), args, dtype, device=args.device) for kind in order}
    if args.bank_dtype:
        models["attnres"].config.attn_res_bank_dtype = args.bank_dtype
    return models


def time_order(args) -> dict:
    """This process's timings, the models built in `--build-order` (forward or reverse): every dtype and
    mode, and the wall and CPU seconds of the timed calls."""
    before, timed = dict(TIMED), []
    for dtype_name in args.dtypes:
        models = build_models(args, DTYPES[dtype_name], BUILD_ORDERS[args.build_order])
        for mode in args.modes:
            timed += time_mode(args, models, dtype_name, mode)
        del models
    return {"label": args.build_order, "timed": timed, "wall": TIMED["wall"] - before["wall"],
            "cpu": TIMED["cpu"] - before["cpu"]}


def time_orders(args) -> list[dict]:
    """`time_order` in this process for one build order; for `both`, in two fresh processes one after the
    other (forward, then reverse), each with half the repeats and its own prompts."""
    if args.build_order != "both":
        return [time_order(args)]
    per_order, results = -(-args.repeats // 2), []
    with tempfile.TemporaryDirectory(prefix="attnres-bench-orders-") as tmp:
        for i, label in enumerate(BUILD_ORDERS):
            out, log = Path(tmp) / f"{label}.json", Path(tmp) / f"{label}.log"
            cmd = [sys.executable, __file__, *args.argv, "--build-order", label, "--repeats", str(per_order),
                   "--seed", str(args.seed + 1_000_000 * (i + 1)), "--timing-out", str(out)]
            code = run_logged(cmd, log, timeout=args.timeout)
            if code != 0 or not out.exists():
                why = "timed out" if code is None else f"exit {code}"
                raise RuntimeError(f"the {label} build order failed ({why}):\n{log.read_text()[-4000:]}")
            results.append(json.loads(out.read_text()))
    return results


def timing_rows(results: list[dict]) -> list[list]:
    """One row per workload, dtype and mode: the pairs of every build order pooled, and per order its
    median ratio beside its median A/A ratio."""
    rows = []
    for i, first in enumerate(results[0]["timed"]):
        mine = [r["timed"][i] for r in results]
        pooled = [run for t in mine for run in t["runs"]]
        by_order = "; ".join(f"{r['label']}: {statistics.median(ratios(t['runs'], 'attnres', 'llama')):.3f} / "
                             f"{statistics.median(ratios(t['runs'], 'llama-2', 'llama')):.3f}"
                             for r, t in zip(results, mine))
        rows.append([first["workload"], first["dtype"], first["mode"], *(median_ms(pooled, k) for k in MODELS),
                     spread(ratios(pooled, "attnres", "llama")), spread(ratios(pooled, "llama-2", "llama")),
                     by_order, len(pooled)])
    return rows


def _status_mib(field: str) -> float:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in MiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) / 1024


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def allocated_peak_probe(model: torch.nn.Module) -> tuple[Callable[[], float], Callable[[], float], dict]:
    """`(allocated, peak, layer_peaks)`: glibc's bytes in use (MiB; torch's CPU tensors are malloc'ed), and
    their largest value seen at the entry and exit of every module of `model` since the probe was made,
    overall and (`layer_peaks`, filled as the model runs) within each decoder layer `model.layers.{i}`.

    RSS also counts what the allocator freed but kept, which moves a 512-token prefill's own peak by
    +-25 MiB between identical processes; the bytes in use are what the model's tensors hold."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def allocated() -> float:
        info = libc.mallinfo2()
        return (info.uordblks + info.hblkhd) / 2**20

    seen, layer_peaks = [0.0], {}

    def sample(layer: int | None) -> None:
        now = allocated()
        seen[0] = max(seen[0], now)
        if layer is not None:
            layer_peaks[layer] = max(layer_peaks.get(layer, 0.0), now)

    for name, module in model.named_modules():
        found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
        layer = int(found.group(1)) if found else None
        module.register_forward_pre_hook(lambda *_args, layer=layer: sample(layer))
        module.register_forward_hook(lambda *_args, layer=layer: sample(layer))
    return allocated, lambda: seen[0], layer_peaks


def memory_probe(args) -> dict:
    """In a fresh process: one model, a prefill; the peak RSS of the whole process, the peak of the
    prefill alone over the RSS it started from, and its peak of allocated bytes over the start (MiB).

    Loading peaks higher than a short prefill, so the lifetime peak (`ru_maxrss`) would hide the
    prefill. A first prefill pages in the weights (a checkpoint is memory-mapped) and the kernels'
    one-time state; then freed memory is returned to the system (`malloc_trim`) and the kernel's
    high-water mark is reset (`/proc/self/clear_refs`), so that `VmHWM` is the second prefill's peak."""
    torch.set_num_threads(args.threads)
    model = build(args.memory_probe.removesuffix("-2"), args, DTYPES[args.dtype])
    if args.bank_dtype and args.memory_probe == "attnres":
        model.config.attn_res_bank_dtype = args.bank_dtype
    tokens = torch.randint(0, args.vocab_size, (1, args.prefill_tokens))
    run = generate_fn(model, "eager", 1, "cpu")
    run(tokens)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    allocated, allocated_peak, layer_peaks = allocated_peak_probe(model)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")                                                 # VmHWM := VmRSS
    start, start_allocated = _status_mib("VmRSS"), allocated()
    run(tokens)
    bank = 0.0
    if args.memory_probe == "attnres":                       # the bank this prefill allocated, as the model does
        embeds = torch.empty(1, args.prefill_tokens, model.config.hidden_size, dtype=model.dtype)
        with torch.inference_mode():
            bank = sum(t.nbytes for t in site_bank(embeds, model.config)[:2]) / 2**20
    return {"start_mib": start, "peak_mib": _status_mib("VmHWM"), "allocated_mib": allocated_peak() - start_allocated,
            "layer_allocated_mib": [layer_peaks[i] - start_allocated for i in sorted(layer_peaks)], "bank_mib": bank}


def memory_rows(args) -> tuple[list[list], list[list]]:
    """Per dtype: each model's probe in `--memory-probes` fresh processes, the models in rotating order;
    the medians, and the same per decoder layer (`layer_memory_rows`). The bank (its sources x prefill
    tokens x (hidden x the bank dtype's bytes + 4)) is the memory AttnRes adds: the floor of the
    allocated difference."""
    rows, layer_rows = [], []
    for dtype_name in args.dtypes:
        res = {kind: [] for kind in MODELS}
        with tempfile.TemporaryDirectory(prefix="attnres-bench-memory-") as tmp:
            for repeat in range(args.memory_probes):
                for kind in rotation(list(MODELS), repeat):
                    out, log = Path(tmp) / f"{kind}.json", Path(tmp) / f"{kind}.log"
                    cmd = [sys.executable, __file__, *args.argv, "--memory-probe", kind, "--dtype", dtype_name,
                           "--probe-out", str(out)]
                    code = run_logged(cmd, log, timeout=1800)
                    if code != 0 or not out.exists():
                        raise RuntimeError(f"memory probe of {kind} failed ({code}):\n{log.read_text()[-4000:]}")
                    res[kind].append(json.loads(out.read_text()))
                    out.unlink()
        peak = {k: statistics.median(r["peak_mib"] for r in v) for k, v in res.items()}
        own = {k: statistics.median(r["peak_mib"] - r["start_mib"] for r in v) for k, v in res.items()}
        held = {k: statistics.median(r["allocated_mib"] for r in v) for k, v in res.items()}
        rows.append([f"prefill 1x{args.prefill_tokens}", dtype_name, *(f"{peak[k]:.0f}" for k in MODELS),
                     f"**{peak['attnres'] / peak['llama']:.3f}**", f"**{peak['llama-2'] / peak['llama']:.3f}**",
                     *(f"{own[k]:.1f}" for k in MODELS), *(f"{held[k]:.1f}" for k in MODELS),
                     f"{held['attnres'] - held['llama']:+.1f}", f"{held['llama-2'] - held['llama']:+.1f}",
                     f"{res['attnres'][0]['bank_mib']:.3f}", args.memory_probes])
        layer_rows += layer_memory_rows(res, dtype_name)
    return rows, layer_rows


def layer_memory_rows(res: dict, dtype_name: str) -> list[list]:
    """Per decoder layer: each model's median peak of allocated bytes within the layer, over the start of
    the prefill, and the differences to Llama's: where the allocated difference comes from."""
    layers = {k: [statistics.median(values) for values in zip(*(r["layer_allocated_mib"] for r in v))]
              for k, v in res.items()}
    llama = layers["llama"]
    return [[i, dtype_name, *(f"{layers[k][i]:.2f}" for k in MODELS), f"{layers['attnres'][i] - llama[i]:+.2f}",
             f"{layers['llama-2'][i] - llama[i]:+.2f}"] for i in range(len(llama))]


MEMORY_COLUMNS = ["memory", "dtype", *(f"{LABELS[k]} peak RSS MiB" for k in MODELS), "AttnRes / Llama", "A/A",
                  *(f"{LABELS[k]} prefill's own RSS MiB" for k in MODELS),
                  *(f"{LABELS[k]} prefill's own allocated MiB" for k in MODELS),
                  "allocated: AttnRes - Llama MiB", "allocated: A/A - Llama MiB", "AttnRes bank MiB", "probes"]
LAYER_MEMORY_COLUMNS = ["layer", "dtype", *(f"{LABELS[k]} allocated at the layer's peak MiB" for k in MODELS),
                        "AttnRes - Llama MiB", "A/A - Llama MiB"]
CUDA_MEMORY_COLUMNS = ["memory", "dtype", *(f"{LABELS[k]} MiB" for k in MODELS),
                       *(f"{LABELS[k]} prefill's own MiB" for k in MODELS), "AttnRes / Llama", "A/A",
                       "prefill's own: AttnRes / Llama", "prefill's own: A/A"]


def cuda_memory_rows(args) -> list[list]:
    """Peak allocated GPU memory of a prefill, per model and dtype (one model on the GPU at a time)."""
    rows = []
    for dtype_name in args.dtypes:
        res = {}
        for kind in MODELS:
            torch.cuda.empty_cache()
            model = build(kind.removesuffix("-2"), args, DTYPES[dtype_name], device=args.device)
            torch.cuda.synchronize()
            built = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
            generate_fn(model, "eager", 1, args.device)(random_ids(args, 1, args.prefill_tokens, 7))
            torch.cuda.synchronize()
            res[kind] = (torch.cuda.max_memory_allocated() / 2**20, built)
            del model
        peak = {k: v[0] for k, v in res.items()}
        own = {k: v[0] - v[1] for k, v in res.items()}
        rows.append([f"peak allocated, prefill 1x{args.prefill_tokens}", dtype_name,
                     *(f"{peak[k]:.0f}" for k in MODELS), *(f"{own[k]:.1f}" for k in MODELS),
                     f"**{peak['attnres'] / peak['llama']:.3f}**", f"**{peak['llama-2'] / peak['llama']:.3f}**",
                     f"**{own['attnres'] / own['llama']:.2f}**", f"**{own['llama-2'] / own['llama']:.2f}**"])
    return rows


def accuracy_rows(args, batch: int = 4, tokens: int = 64) -> list[list]:
    """Each model's bfloat16 logits against its own float64 logits on the same random tokens.

    AttnRes runs with the fused CPU kernel (held to the same float64 oracle as the torch path in the
    tests): `"auto"` keeps a bfloat16 bank only where a fused reader reads it, and the eager torch path
    on a CPU is not one (`depth_attention_ops.site_bank`), so without the kernel both rows would
    measure a float32 bank."""
    ids = torch.randint(3, args.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(0))
    rows = []
    for kind in ("llama", "attnres"):
        model = build(kind, args, torch.float64)
        with torch.no_grad():
            reference = model(ids).logits
            model.to(torch.bfloat16)
            enable_cpu_kernel(kind == "attnres")
            for choice in ("float32", "auto") if kind == "attnres" else ("-",):
                if kind == "attnres":
                    model.config.attn_res_bank_dtype = choice
                bank = bank_dtype(choice, torch.bfloat16) if kind == "attnres" else "-"
                logits = model(ids).logits
                err = logits.double() - reference
                agree = (logits.argmax(-1) == reference.argmax(-1)).double().mean()
                rows.append([kind, choice, str(bank).removeprefix("torch."), f"{err.abs().max():.3f}",
                             f"{err.pow(2).mean().sqrt():.4f}", f"{err.norm() / reference.norm():.5f}",
                             f"{agree:.3f}"])
            enable_cpu_kernel(False)
        del model
    return rows


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--bank-dtype", choices=("auto", "float32"),
                        help="AttnResConfig.attn_res_bank_dtype for AttnRes (default: the config's)")
    parser.add_argument("--accuracy", action="store_true",
                        help="first: bfloat16 vs float64 logit error of each model (and each bank dtype)")
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=list(DTYPES))
    parser.add_argument("--modes", nargs="+", default=["eager"], choices=MODES,
                        help="eager: transformers' default path (AttnRes with its C++ kernel where it builds); "
                             "fused-llama: the same against Llamas whose residual adds are fused into the next "
                             "RMSNorm (bench/fused_llama.py); torch-path: AttnRes with the kernel off; compiled: "
                             "generate() with a static cache and transformers' compile_config")
    parser.add_argument("--repeats", type=int, default=12,
                        help="paired repeats in all, split between the build orders (6 per order is balanced)")
    parser.add_argument("--build-order", choices=("both", *BUILD_ORDERS), default="both",
                        help="both (default): the models built forward (AttnRes, Llama, Llama (A/A)) in one fresh "
                             "process, then reversed in another, pairs pooled; forward/reverse: one order, here")
    parser.add_argument("--seed", type=int, default=0, help="of the random prompts")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per build order's process")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--inductor-cpp-wrapper", action="store_true",
                        help="compiled mode: Inductor's C++ wrapper (torch._inductor.config.cpp_wrapper) for every "
                             "model, which calls a graph's kernels from C++ instead of a generated Python function")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory probes")
    parser.add_argument("--memory-probes", type=int, default=3, help="fresh processes per model (medians)")
    parser.add_argument("--memory-probe", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--probe-out", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--timing-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    check_model_arguments(parser, args)
    return args


def apply_inductor_settings(args) -> None:
    """`--inductor-cpp-wrapper`: the same Inductor setting for every model of the run (torch's own, global).
    And the three models share transformers' one compiled `generate` step, whose Dynamo cache holds an entry
    per model class, dtype and batch shape: past torch's limit of 8 the next would silently run eager in a
    table that says compiled, so the limit is raised and hitting it is an error."""
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config

    inductor_config.cpp_wrapper = bool(args.inductor_cpp_wrapper)
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    dynamo_config.fail_on_recompile_limit_hit = True


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.memory_probe:
        Path(args.probe_out).write_text(json.dumps(memory_probe(args)))
        return
    torch.set_num_threads(args.threads)
    apply_inductor_settings(args)
    if args.timing_out:
        Path(args.timing_out).write_text(json.dumps(time_order(args)))
        return
    orders = list(BUILD_ORDERS) if args.build_order == "both" else [args.build_order]
    per_order = -(-args.repeats // len(orders))
    settings = {"dtypes": ", ".join(args.dtypes), "modes": ", ".join(args.modes),
                "bank dtype": args.bank_dtype or "from the config", "attention": "sdpa", "device": args.device,
                "build orders": " then ".join(f"{o} ({', '.join(LABELS[k] for k in BUILD_ORDERS[o])})" for o in orders)
                                + (", each in a fresh process" if len(orders) > 1 else ""),
                "repeats": f"{per_order} per build order in rotating order ("
                           f"{'balanced' if balanced(per_order, 3) else 'not a multiple of 6: unbalanced'}), pooled",
                "prompts": "fresh random token ids every repeat, shared by the three models; warm-up at the timed "
                           "size", "timed": "one whole generate() call",
                "Inductor's wrapper": "C++ (cpp_wrapper)" if args.inductor_cpp_wrapper else "Python (torch's default)"}
    print(header(f"transformers, AttnRes / Llama with an A/A control: {describe(args)}", settings) + "\n")
    if args.accuracy:
        print(markdown_table(["model", "attn_res_bank_dtype", "bank kept in", "max |logit error|", "RMS error",
                              "relative error", "top-1 agreement"], accuracy_rows(args)))
        print("\n(bfloat16 vs the same model in float64, 4 x 64 random tokens; AttnRes with the CPU kernel)\n")
    results = time_orders(args)
    share = sum(r["cpu"] for r in results) / max(sum(r["wall"] for r in results), 1e-9) / args.threads
    print(markdown_table(["workload", "dtype", "mode", *(f"{LABELS[k]} ms" for k in MODELS),
                          "AttnRes / Llama (median, min-max)", "A/A: Llama (A/A) / Llama (median, min-max)",
                          "by build order: ratio / A/A", "pairs"], timing_rows(results)))
    print(f"\nCPU share of the timing (process CPU time / wall time / threads; 100 % = the cores to itself): "
          f"{100 * share:.0f} %")
    if not args.no_memory and args.device.startswith("cuda"):
        print("\n" + markdown_table(CUDA_MEMORY_COLUMNS, cuda_memory_rows(args)))
    elif not args.no_memory:
        memory, layers = memory_rows(args)
        print("\n" + markdown_table(MEMORY_COLUMNS, memory))
        print("\n" + markdown_table(LAYER_MEMORY_COLUMNS, layers))
        print("\n(allocated bytes within each decoder layer of the prefill, over its start: medians of the probes)")
    print(footer())


if __name__ == "__main__":
    main()
