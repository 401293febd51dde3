"""vLLM offline: the AttnRes plugin against vLLM's own Llama on the same weights, with an A/A control.

    python bench/bench_vllm.py --smollm2 --dtype bfloat16            # real weights (built on first use)
    python bench/bench_vllm.py --model OUT --source SRC              # any attnres-convert output vs its source
    python bench/bench_vllm.py --hidden-size 256 --num-hidden-layers 4 --prefill-tokens 512 --decode-batches 1 8
    python bench/bench_vllm.py --compare transformers-backend --smollm2   # the plugin vs vLLM's Transformers backend

Three engines live in one process (in-process engine cores): the subject (the AttnRes plugin), the
baseline (vLLM's own Llama on the source weights) and the A/A control (a second baseline engine on the
same weights). `--compare transformers-backend` makes vLLM's Transformers backend on the AttnRes
checkpoint the subject and the plugin the baseline (twice). Every ratio is printed next to the A/A
ratio (control / baseline, measured the same way): what separates two engines that do exactly the same
work is the error bar of the ratio beside it.

The rules, each against a way the numbers have misled before:
- prefix caching off, and fresh random prompts in every repeat (the engines of one repeat share them):
  a repeated prompt would be served from the cache;
- the engines of a repeat run in a rotating order (`common.rotation`: each one first equally often);
- the construction order is swapped between two processes run one after the other (`--build-order
  both`, the default: subject, baseline, control, then control, baseline, subject), and their pairs
  pooled: which engine is built first moved a ratio by ~4 % in an A/A control;
- the warm-up runs each workload once per engine at the timed size;
- the prompt and generated token counts of every engine are compared in every repeat (a mismatch
  stops the run);
- versions, machine (CPU model, AMX), load and every setting are printed with the tables;
- the compiled modes run as `attnres-serve` does (`serving.cli.server_environment`), for every engine:
  `ATTNRES_CPU_KERNEL=compiled` on a CPU (the C++ boundary op inside the graphs) and, for `--compile
  dynamo`, `VLLM_USE_AOT_COMPILE=0` (without it vLLM hashes its configuration on every forward call),
  each unless the variable is set.

Workloads (each list may be given empty): prefill of one `--prefill-tokens` prompt (1 new token,
chunked in steps of `--max-num-batched-tokens`; timed: the whole request); decode of `--decode-batches`
prompts of `--decode-context` tokens and of `--long-decode-batches` prompts of `--long-context` tokens,
`--new-tokens` each (timed: from the last request's first token to the last token, the engine's own
timestamps, so the prefill is left out). The memory table gives per model the bytes of AttnRes's bank
per token (stored sources x (hidden x bank dtype + a float32 inverse RMS)), the peak memory growth of
one prefill step (RSS on a CPU, allocated memory on a GPU) and the KV cache capacity in tokens, both
for the `--kv-cache-bytes` budget and as vLLM sizes it itself (memory profiling, each model alone in a
fresh process; `--no-kv-profile` skips it).
"""

import argparse
import ctypes
import gc
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (  # noqa: E402
    add_model_arguments,
    add_size_arguments,
    balanced,
    build,
    check_equal_work,
    check_model_arguments,
    describe,
    footer,
    header,
    markdown_table,
    rotation,
    run_logged,
    spread,
)

from attnres.serving.cli import DEFAULT_COMPILATION, installed_vllm, server_environment  # noqa: E402

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TOKENIZERS_PARALLELISM": "false"}
COMPILE = {"eager": None, "dynamo": json.loads(DEFAULT_COMPILATION), "inductor": {}}
COMPILE_NAMES = {"eager": "eager (enforce_eager)",
                 "dynamo": 'Dynamo only ({"mode": 2, "backend": "eager"}, the C++ boundary op in the graphs and '
                           "VLLM_USE_AOT_COMPILE=0 unless set: what `make serve` runs)",
                 "inductor": "vLLM's default compilation (Inductor; the C++ boundary op in the graphs unless "
                             "ATTNRES_CPU_KERNEL is set, as `attnres-serve` runs it)"}
# name: (subject, baseline, control); the control is a second engine of the baseline.
COMPARISONS = {"llama": ("attnres", "llama", "llama-2"),
               "transformers-backend": ("transformers-backend", "plugin", "plugin-2")}
LABELS = {"attnres": "AttnRes", "llama": "Llama", "llama-2": "Llama (A/A)",
          "transformers-backend": "Transformers backend", "plugin": "plugin", "plugin-2": "plugin (A/A)"}
LOG_TAIL = 6000
# `--norms vllm-c`: vLLM's own C++ RMSNorm kernels as an implementation of its IR norm ops on a CPU,
# first in every engine's priority list (vLLM 0.32 registers its `vllm_c` ones for GPUs only).
C_NORMS = "attnres_bench_c"
NORMS = {"vllm-default": "vLLM's own choice (on a CPU: native torch ops, which only Inductor fuses)",
         "vllm-c": "vLLM's C++ rms_norm / fused_add_rms_norm kernels for every engine's vLLM RMSNorm"}


@dataclass(frozen=True)
class Workload:
    """`prompts` prompts of `prompt_tokens` random tokens, `new_tokens` generated each."""

    kind: str            # "prefill" (timed: whole requests) or "decode" (timed: the decode phase)
    prompts: int
    prompt_tokens: int
    new_tokens: int

    @property
    def name(self) -> str:
        if self.kind == "prefill":
            return f"prefill 1 x {self.prompt_tokens}"
        return f"decode {self.prompts} x {self.new_tokens} (context {self.prompt_tokens})"

    @property
    def length(self) -> int:
        return self.prompt_tokens + self.new_tokens


def workloads(args) -> list[Workload]:
    """The selected workloads, in the order they run."""
    found = [Workload("prefill", 1, n, 1) for n in args.prefill_tokens]
    found += [Workload("decode", b, args.decode_context, args.new_tokens) for b in args.decode_batches]
    found += [Workload("decode", b, args.long_context, args.new_tokens) for b in args.long_decode_batches]
    return found


def register_c_norms() -> None:
    """Register vLLM's own C++ RMSNorm kernels (`torch.ops._C.rms_norm` / `fused_add_rms_norm`, in vLLM's CPU
    build too) as the `C_NORMS` implementation of its IR ops `rms_norm` / `fused_add_rms_norm`, for a CPU.
    With vLLM's default, a CPU runs them as native torch ops: one call each after Inductor's fusion, about
    eight separate ones in a graph run without Inductor (`--compile dynamo`), where a Llama's residual add
    and norm cost more than AttnRes's fused boundary op. Once per process; the engines' `kernel_config`
    puts it first (`ir_op_priority`)."""
    import torch
    from torch import Tensor
    from vllm import ir
    from vllm.platforms import current_platform

    if C_NORMS in ir.ops.rms_norm.impls:
        return
    current_platform.import_kernels()                                    # torch.ops._C

    def plain(x, weight, epsilon, variance_size=None) -> bool:               # what the C++ kernels take
        return weight is not None and weight.dtype == x.dtype and x.is_contiguous() and variance_size is None

    def plain_add(x, x_residual, weight, epsilon, variance_size=None) -> bool:
        return plain(x, weight, epsilon, variance_size) and x_residual.is_contiguous()

    @ir.ops.rms_norm.register_impl(C_NORMS, supported=current_platform.is_cpu(), supports_args=plain)
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None) -> Tensor:
        out = torch.empty_like(x)
        torch.ops._C.rms_norm(out, x, weight, epsilon)
        return out

    @ir.ops.fused_add_rms_norm.register_impl(C_NORMS, supported=current_platform.is_cpu(), inplace=True,
                                             supports_args=plain_add)
    def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                           variance_size: int | None = None) -> tuple[Tensor, Tensor]:
        torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)   # x_residual <- x + x_residual, x <- norm
        return x, x_residual


def c_norms_kernel_config() -> dict:
    """The `kernel_config` of `--norms vllm-c`: `C_NORMS` first for vLLM's norm ops (registered by
    `register_c_norms` in the same process), then `vllm_c` where vLLM has it (GPUs), then its native ones."""
    first = [C_NORMS, "vllm_c", "native"]
    return {"ir_op_priority": {"rms_norm": first, "fused_add_rms_norm": first}}


def engine_specs(args, paths: dict[str, Path]) -> dict[str, dict]:
    """`{name: {"path", "kwargs"}}` of the subject, the baseline and the control."""
    subject, baseline, control = COMPARISONS[args.compare]
    common = dict(dtype=args.dtype, kv_cache_memory_bytes=args.kv_cache_bytes, seed=0, enable_prefix_caching=False,
                  skip_tokenizer_init=True, disable_log_stats=False)
    if args.norms == "vllm-c":
        common["kernel_config"] = c_norms_kernel_config()
    if args.max_num_batched_tokens:
        common["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.compile == "eager":
        common["enforce_eager"] = True
    else:
        common["compilation_config"] = COMPILE[args.compile]
    bank = {"hf_overrides": {"attn_res_bank_dtype": args.bank_dtype}} if args.bank_dtype else {}
    if args.compare == "llama":
        specs = {subject: (paths["attnres"], bank), baseline: (paths["llama"], {}), control: (paths["llama"], {})}
    else:
        backend = dict(bank, model_impl="transformers", trust_remote_code=True)
        specs = {subject: (paths["attnres"], backend), baseline: (paths["attnres"], bank),
                 control: (paths["attnres"], bank)}
    return {name: {"path": str(path), "kwargs": {**common, **extra}} for name, (path, extra) in specs.items()}


def prompt_ids(vocab: int, count: int, tokens: int, seed: int) -> list[list[int]]:
    """`count` prompts of `tokens` random ids (special tokens at the bottom of the vocabulary left out)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(tokens)] for _ in range(count)]


def vm_mib(field: str) -> float:
    """A `/proc/self/status` memory field (`VmRSS`, `VmHWM`) in MiB."""
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field + ":")).split()[1]) / 1024


def step_peak_mib(llm, prompts, params) -> float:
    """The memory one `generate` call adds at its peak: allocated CUDA memory on a GPU, else the RSS
    high-water mark over the RSS it started from (freed memory returned first, the mark reset)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")                                                  # VmHWM := VmRSS
    start = vm_mib("VmRSS")
    llm.generate(prompts, params, use_tqdm=False)
    return vm_mib("VmHWM") - start


def kv_tokens(llm) -> int:
    """The KV cache capacity in tokens, as the engine sized it."""
    cache = llm.llm_engine.vllm_config.cache_config
    return int(cache.num_gpu_blocks * cache.block_size)


def timed_generate(llm, work: Workload, prompts, params) -> dict:
    """One `generate` call: seconds of the timed part, the tokens processed, the call's wall and
    process CPU seconds (their ratio says how much of the cores the benchmark got: other jobs on the
    machine show as a share well below the thread count) and the process's minor page faults during it
    (memory the allocator had to map afresh)."""
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults   # the engine core runs in this process
    timed = wall
    if work.kind == "decode":                  # engine timestamps: from the last first token to the last token
        timed = max(o.metrics.last_token_ts for o in outputs) - max(o.metrics.first_token_ts for o in outputs)
    return {"seconds": timed, "wall": wall, "cpu": cpu, "faults": faults,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
            "generated_tokens": sum(len(o.outputs[0].token_ids) for o in outputs)}


def run_engines(plan: dict) -> dict:
    """In a fresh process: the engines built in `plan["order"]`, then per workload a warm-up of each at
    the timed size and `plan["repeats"]` repeats in rotating order on fresh prompts; the token counts
    of the engines compared in every repeat; one more prefill per engine for its memory peak."""
    from vllm import LLM, SamplingParams

    engines, startup, kv = {}, {}, {}
    for name in plan["order"]:
        spec = plan["engines"][name]
        start = time.perf_counter()
        engines[name] = LLM(model=spec["path"], max_model_len=plan["max_model_len"], max_num_seqs=plan["max_num_seqs"],
                            **spec["kwargs"])
        startup[name] = time.perf_counter() - start                     # loading + compilation
        kv[name] = kv_tokens(engines[name])
    scheduler = engines[plan["order"][0]].llm_engine.vllm_config.scheduler_config
    results, peaks = {}, {}
    for index, fields in enumerate(plan["workloads"]):
        work = Workload(**fields)
        params = SamplingParams(max_tokens=work.new_tokens, min_tokens=work.new_tokens, ignore_eos=True,
                                temperature=0.0, detokenize=False)

        def prompts(repeat: int, work=work, index=index):
            seed = plan["seed"] + 100_000 * index + repeat + 1
            return [{"prompt_token_ids": ids}
                    for ids in prompt_ids(plan["vocab"], work.prompts, work.prompt_tokens, seed)]

        batch = prompts(-1)
        for name in rotation(list(engines), 0):                          # warm-up at the timed size
            engines[name].generate(batch, params, use_tqdm=False)
        runs = []
        for repeat in range(plan["repeats"]):
            batch, run = prompts(repeat), {}
            for name in rotation(list(engines), repeat):
                run[name] = timed_generate(engines[name], work, batch, params)
            check_equal_work({k: (v["prompt_tokens"], v["generated_tokens"]) for k, v in run.items()},
                             f"{work.name}, repeat {repeat} of the {plan['label']} build order")
            runs.append(run)
            print(f"bench_vllm: {work.name}, repeat {repeat + 1}/{plan['repeats']}: "   # progress, in the log
                  + ", ".join(f"{k} {v['seconds']:.3f} s" for k, v in run.items()), file=sys.stderr, flush=True)
        results[work.name] = runs
        if work.kind == "prefill" and not peaks:
            batch = prompts(plan["repeats"])
            peaks = {name: step_peak_mib(engines[name], batch, params) for name in engines}
    import torch

    return {"order": plan["order"], "label": plan["label"], "startup": startup, "kv_tokens": kv, "peak_mib": peaks,
            "max_num_batched_tokens": scheduler.max_num_batched_tokens, "workloads": results,
            "threads": torch.get_num_threads()}


def profile_kv(plan: dict) -> dict:
    """In a fresh process: one engine alone, the KV cache sized by vLLM itself (memory profiling)."""
    from vllm import LLM

    spec = plan["engines"][plan["engine"]]
    kwargs = {k: v for k, v in spec["kwargs"].items() if k != "kv_cache_memory_bytes"}
    if plan["gpu_memory_utilization"]:
        kwargs["gpu_memory_utilization"] = plan["gpu_memory_utilization"]
    llm = LLM(model=spec["path"], max_model_len=plan["max_model_len"], max_num_seqs=plan["max_num_seqs"], **kwargs)
    return {"kv_tokens": kv_tokens(llm)}


def child(plan: dict, log_dir: Path) -> dict:
    """Run `plan` in a fresh interpreter (one at a time: never two engine processes at once); its vLLM
    logs go to a file, whose tail is raised with the error if the child fails."""
    name = plan["label"] if plan["task"] == "engines" else f"kv-{plan['engine']}"
    plan_path, out_path, log_path = (log_dir / f"{name}.{ext}" for ext in ("plan.json", "result.json", "log"))
    plan_path.write_text(json.dumps(plan))
    env = {**os.environ, **ENV}
    # vLLM's CPU platform lets it override both the profiling and --kv-cache-bytes (the budget the header states)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    returncode = run_logged([sys.executable, __file__, "--child", str(plan_path), str(out_path)], log_path,
                            plan["timeout"], env=env)
    if returncode != 0 or not out_path.exists():
        why = "timed out" if returncode is None else f"exit {returncode}"
        raise RuntimeError(f"{name} failed ({why}):\n{log_path.read_text()[-LOG_TAIL:]}")
    return json.loads(out_path.read_text())


def write_models(args, root: Path) -> dict[str, Path]:
    """The checkpoint folders: `--model` / `--source`, else random same-size models saved under `root`."""
    import torch

    if args.model:
        return {"attnres": Path(args.model), "llama": Path(args.source)}
    paths = {}
    for kind in ("attnres", "llama"):
        model = build(kind, args, getattr(torch, args.dtype))
        paths[kind] = root / kind
        model.save_pretrained(paths[kind])
        del model
    return paths


def bank_bytes_per_token(path: Path, args, engine: str) -> tuple[int, str]:
    """Bytes AttnRes's bank holds per token in `engine`, and its dtype: every stored source (the schedule's
    `depth_sites[-1].num_stored`) at hidden x the bank dtype, plus a float32 inverse RMS. The plugin
    decides the dtype from the config alone; the Transformers backend runs the transformers model, whose
    eager CPU path keeps a float32 bank (`depth_attention_ops.site_bank`)."""
    import torch

    from modeling_attnres import AttnResConfig
    from modeling_attnres.depth_attention import bank_dtype

    config = AttnResConfig.from_pretrained(path)
    choice = args.bank_dtype or config.attn_res_bank_dtype
    fused = engine != "transformers-backend" or args.compile != "eager" or torch.cuda.is_available()
    dtype = bank_dtype(choice if fused else "float32", getattr(torch, args.dtype))
    stored = config.depth_sites[-1].num_stored
    return stored * (config.hidden_size * dtype.itemsize + 4), str(dtype).removeprefix("torch.")


def max_positions(path: Path) -> int:
    from transformers import AutoConfig

    import modeling_attnres  # noqa: F401  (registers the AttnRes config)

    return AutoConfig.from_pretrained(path).max_position_embeddings


def measure(args, paths: dict[str, Path], work: list[Workload], log_dir: Path) -> tuple[list[dict], dict]:
    """The engine processes (one per build order, one after the other), then the KV profiling ones."""
    specs = engine_specs(args, paths)
    subject, baseline, control = COMPARISONS[args.compare]
    orders = {"forward": [subject, baseline, control], "reverse": [control, baseline, subject]}
    labels = ["forward", "reverse"] if args.build_order == "both" else [args.build_order]
    per_order = -(-args.repeats // len(labels))
    base = dict(engines=specs, norms=args.norms, max_model_len=max(w.length for w in work) + 8,
                max_num_seqs=max(w.prompts for w in work), vocab=args.vocab_size, timeout=args.timeout)
    runs = [child(dict(base, task="engines", label=label, order=orders[label], repeats=per_order,
                       seed=1_000_000 * (i + 1), workloads=[asdict(w) for w in work]), log_dir)
            for i, label in enumerate(labels)]
    kv = {}
    if args.kv_profile:
        for name in (subject, baseline):
            try:
                kv[name] = child(dict(base, task="kv", engine=name, label=name,
                                      gpu_memory_utilization=args.gpu_memory_utilization), log_dir)["kv_tokens"]
            except RuntimeError as err:
                kv[name] = "failed: " + str(err).splitlines()[0][:200]
    return runs, kv


def timing_rows(args, runs: list[dict], work: list[Workload]) -> list[list]:
    subject, baseline, control = COMPARISONS[args.compare]
    rows = []
    for w in work:
        pooled = [run for r in runs for run in r["workloads"][w.name]]
        first = pooled[0][subject]
        seconds = {k: statistics.median(run[k]["seconds"] for run in pooled) for k in (subject, baseline, control)}
        by_order = []
        for r in runs:
            mine = r["workloads"][w.name]
            ratio = statistics.median(run[subject]["seconds"] / run[baseline]["seconds"] for run in mine)
            aa = statistics.median(run[control]["seconds"] / run[baseline]["seconds"] for run in mine)
            by_order.append(f"{r['label']}: {ratio:.3f} / {aa:.3f}")
        timed = "whole request" if w.kind == "prefill" else "decode phase"
        rows.append([w.name, timed, f"{first['prompt_tokens']} / {first['generated_tokens']}",
                     f"{seconds[subject]:.3f}", f"{seconds[baseline]:.3f}", f"{seconds[control]:.3f}",
                     spread([run[subject]["seconds"] / run[baseline]["seconds"] for run in pooled]),
                     spread([run[control]["seconds"] / run[baseline]["seconds"] for run in pooled]),
                     "; ".join(by_order), len(pooled)])
    return rows


def memory_rows(args, paths: dict[str, Path], runs: list[dict], kv_profiled: dict) -> list[list]:
    subject, baseline, control = COMPARISONS[args.compare]
    specs = engine_specs(args, paths)
    step = runs[0]["max_num_batched_tokens"]
    rows = []
    for name in (subject, baseline, control):
        path = Path(specs[name]["path"])
        if args.compare == "llama" and name != subject:
            bank = "- (no bank)"
        else:
            per_token, dtype = bank_bytes_per_token(path, args, name)
            bank = f"{per_token} ({dtype}); {per_token * step / 2**20:.1f} MiB per {step}-token step"
        peaks = [r["peak_mib"][name] for r in runs if r["peak_mib"]]
        peak = " / ".join(f"{p:.1f}" for p in peaks) if peaks else "- (no prefill workload)"
        budget = " / ".join(str(r["kv_tokens"][name]) for r in runs)
        profiled = kv_profiled.get(name, "-" if args.kv_profile else "not measured (--no-kv-profile)")
        rows.append([LABELS[name], bank, peak, budget, profiled])
    return rows


def report(args, runs: list[dict], kv: dict, paths: dict[str, Path], work: list[Workload], skipped: list[str]) -> None:
    subject, baseline, control = COMPARISONS[args.compare]
    per_order = len(runs[0]["workloads"][work[0].name])
    title = (f"vLLM offline, {LABELS[subject]} / {LABELS[baseline]}: {describe(args)}" if args.compare == "llama"
             else f"vLLM offline, the Transformers backend / the AttnRes plugin on {args.model or 'random AttnRes'}")
    settings = {
        "dtype": args.dtype, "bank dtype": args.bank_dtype or "from the config",
        "compilation": COMPILE_NAMES[args.compile], "norms": NORMS[args.norms], "prefix caching": "off",
        "chunked prefill": f"max_num_batched_tokens {runs[0]['max_num_batched_tokens']}",
        "KV cache budget": f"{args.kv_cache_bytes} bytes per engine",
        "engines": f"{LABELS[subject]}, {LABELS[baseline]} and {LABELS[control]} in one process",
        "build orders": " then ".join(f"{r['label']} ({', '.join(LABELS[n] for n in r['order'])})" for r in runs),
        "repeats": f"{per_order} per build order in rotating order "
                   f"({'balanced' if balanced(per_order, 3) else 'not a multiple of 6: unbalanced'}), pooled",
        "prompts": "fresh random token ids every repeat, shared by the engines of the repeat; warm-up at the "
                   "timed size",
    }
    print(header(title, settings) + "\n")
    ratio, aa = f"{LABELS[subject]} / {LABELS[baseline]}", f"A/A: {LABELS[control]} / {LABELS[baseline]}"
    print(markdown_table(["workload", "timed", "tokens in / out per engine and run (checked equal)",
                          f"{LABELS[subject]} s", f"{LABELS[baseline]} s", f"{LABELS[control]} s",
                          f"{ratio} (median, min-max)", f"{aa} (median, min-max)",
                          "by build order: ratio / A/A", "pairs"], timing_rows(args, runs, work)))
    for note in skipped:
        print(f"\nskipped: {note}")
    print()
    utilization = args.gpu_memory_utilization or "vLLM's default"
    print(markdown_table(["model", "bank bytes per token", "peak growth of a prefill step, MiB (per build order)",
                          "KV capacity, tokens, in the budget (per build order)",
                          f"KV capacity, tokens, vLLM's profiling (gpu_memory_utilization {utilization})"],
                         memory_rows(args, paths, runs, kv)))
    startup = "; ".join(f"{r['label']}: " + ", ".join(f"{LABELS[k]} {v:.1f} s" for k, v in r["startup"].items())
                        for r in runs)
    print(f"\nengine start-up (loading + compilation), in build order: {startup}")
    print(f"CPU share of the timed calls (process CPU time / wall time / threads; 100 % = the cores to itself): "
          f"{cpu_share(runs)}")
    print("minor page faults per timed call (median; memory mapped afresh during the call), per build order: "
          + "; ".join(f"{w.name}: {page_faults(runs, w.name)}" for w in work))
    print(footer())


def page_faults(runs: list[dict], workload: str) -> str:
    """Per build order, each engine's median minor page faults per timed call of `workload`."""
    return ", ".join(f"{r['label']} " + " / ".join(
        f"{LABELS[name]} {statistics.median(run[name]['faults'] for run in r['workloads'][workload]):.0f}"
        for name in r["order"]) for r in runs)


def cpu_share(runs: list[dict]) -> str:
    """Per build order, the process's CPU time over the wall time of every timed call, per thread."""
    shares = []
    for r in runs:
        calls = [call for work in r["workloads"].values() for run in work for call in run.values()]
        share = sum(c["cpu"] for c in calls) / sum(c["wall"] for c in calls) / r["threads"]
        shares.append(f"{r['label']} {100 * share:.0f} %")
    return ", ".join(shares)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_size_arguments(parser)
    add_model_arguments(parser)
    parser.add_argument("--compare", choices=list(COMPARISONS), default="llama",
                        help="llama: the plugin vs vLLM's Llama on the source; transformers-backend: vLLM's "
                             "Transformers backend vs the plugin, both on the AttnRes checkpoint")
    parser.add_argument("--prefill-tokens", type=int, nargs="*", default=[4096, 16384],
                        help="one prompt of each length, one new token (chunked prefill)")
    parser.add_argument("--decode-batches", type=int, nargs="*", default=[1, 32, 128, 256])
    parser.add_argument("--decode-context", type=int, default=32, help="prompt tokens of --decode-batches")
    parser.add_argument("--long-decode-batches", type=int, nargs="*", default=[1, 8])
    parser.add_argument("--long-context", type=int, default=4096, help="prompt tokens of --long-decode-batches")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per decode request (>= 2)")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    parser.add_argument("--bank-dtype", choices=("auto", "float32"),
                        help="AttnResConfig.attn_res_bank_dtype for the AttnRes engines (default: the checkpoint's)")
    parser.add_argument("--compile", choices=list(COMPILE), default="inductor",
                        help="eager: enforce_eager; dynamo: what `make serve` runs; inductor: vLLM's default")
    parser.add_argument("--norms", choices=list(NORMS), default="vllm-default",
                        help="vllm-c: every engine's vLLM RMSNorm layers on vLLM's C++ kernels (register_c_norms), "
                             "so that a Llama's add+norm is one call as AttnRes's boundary is")
    parser.add_argument("--repeats", type=int, default=12, help="pairs in all, split between the build orders")
    parser.add_argument("--build-order", choices=("both", "forward", "reverse"), default="both",
                        help="forward: subject, baseline, control; reverse: the opposite; both: one process "
                             "each, one after the other, pairs pooled")
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30, help="KV cache budget of each timed engine")
    parser.add_argument("--max-num-batched-tokens", type=int, help="the chunked-prefill step (default: vLLM's)")
    parser.add_argument("--no-kv-profile", dest="kv_profile", action="store_false",
                        help="skip the KV capacity vLLM's own memory profiling gives each model")
    parser.add_argument("--gpu-memory-utilization", type=float,
                        help="for that profiling (on a CPU: the share of memory vLLM takes; default 0.2 there)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds allowed to each engine process")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    if args.decode_batches or args.long_decode_batches:
        if args.new_tokens < 2:
            parser.error("--new-tokens must be at least 2: the decode phase starts after the first token")
    if args.gpu_memory_utilization is None and not _cuda():
        args.gpu_memory_utilization = 0.2       # vLLM's 0.92 of this machine's memory exceeds what is free
    check_model_arguments(parser, args, source_required=args.compare == "llama")
    return args


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.child:
        plan = json.loads(Path(args.child[0]).read_text())
        if plan["norms"] == "vllm-c":                                   # in the process that builds the engines
            register_c_norms()
        result = run_engines(plan) if plan["task"] == "engines" else profile_kv(plan)
        Path(args.child[1]).write_text(json.dumps(result))
        return
    compilation = (["--enforce-eager"] if COMPILE[args.compile] is None
                   else ["--compilation-config", json.dumps(COMPILE[args.compile])])
    os.environ.update(server_environment(compilation, cpu=installed_vllm()[1]))   # attnres-serve's own rules
    with tempfile.TemporaryDirectory(prefix="attnres-bench-vllm-") as tmp:
        args.max_positions = max([*args.prefill_tokens, args.decode_context, args.long_context]) + args.new_tokens + 8
        paths = write_models(args, Path(tmp))
        limit = min(max_positions(paths["attnres"]), max_positions(paths["llama"]) if args.compare == "llama"
                    else 1 << 30)
        work = [w for w in workloads(args) if w.length + 8 <= limit]
        skipped = [f"{w.name}: longer than the model's {limit} positions" for w in workloads(args) if w not in work]
        if not work:
            sys.exit("bench_vllm: no workload fits the model's context; see --prefill-tokens and --long-context")
        runs, kv = measure(args, paths, work, Path(tmp))
        report(args, runs, kv, paths, work, skipped)


if __name__ == "__main__":
    main()
