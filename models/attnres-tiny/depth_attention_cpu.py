"""A fused C++ CPU kernel for a sublayer boundary (`depth_attention.site_boundary`), for inference.

In eager PyTorch a depth-attention site is about twenty small tensor operations, each paying
dispatch overhead whatever its size; at one decoded token that overhead is most of the site's cost,
and Llama does not pay it (README, "Performance"). This kernel does a whole sublayer boundary in one
call, per token in one pass over its bank row: the sublayer output added into the partial (in place
where the caller passes `reuse_partial`), the scores, softmax and weighted sum (a bfloat16/float16
bank read as float32, the key-norm gain folded into the query), the block store in place when the site
closes one, and the next sublayer's RMSNorm of the mix (rounded as transformers' `LlamaRMSNorm`), written
over the sublayer output where the caller passes `consume_output` (as vLLM's fused add+norm writes Llama's).
`mix_site` and `push_source` are the same kernel's parts on their own, for callers that still run them
separately.

It is a sibling backend of the torch functions, not a second definition: `depth_attention` stays
the reference (the tests hold this kernel to it and to the float64 oracle) and the only path under
autograd and on other devices. The kernel is on by default: it is built from its C++ source
(`depth_attention_cpu_source.py`) with `torch.utils.cpp_extension.load_inline` at first use (a C++
compiler and ninja are needed; 35-60 s on 2 cores, logged in one line, then cached in torch's
extensions directory). Where it cannot be built, one line says so and depth attention stays on the
torch path (the same maths; a bfloat16/float16 model's blocks stay float32 there, `site_bank`, so its
outputs differ by their rounding). It is turned off by `ATTNRES_CPU_KERNEL=0` or `enable_cpu_kernel(False)`.

Inside `torch.compile` the sites are left to Inductor's generated code unless asked for with
`enable_cpu_kernel(compiled=True)` / `ATTNRES_CPU_KERNEL=compiled`: then they run as the custom ops
`attnres::mix_site` / `attnres::site_boundary[_store|_reuse][_into]` (with fake implementations for tracing). In
transformers' compiled decoding the ops measured no faster than Inductor's code, so graphs do not use
them by default; `attnres-serve` turns them on for vLLM's graphs, where they measured faster
(docs/performance.md).
"""

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import sysconfig
import time

import torch
from torch import Tensor

from .depth_attention import DepthBank, SiteBoundary, acc, fold_queries, push_source, site_boundary
from .depth_attention_cpu_source import KERNEL_SOURCE

logger = logging.getLogger(__name__)


_module = None
_OFF = ("0", "false", "no", "off")
_ENV = os.environ.get("ATTNRES_CPU_KERNEL", "auto").strip().lower()
if _ENV not in (*_OFF, "1", "true", "yes", "on", "auto", "compiled"):    # a typo would pass for "on" unsaid
    logger.warning("AttnRes: ATTNRES_CPU_KERNEL=%r is not a known value (0 or off: the kernel off; compiled: also "
                   "inside torch.compile graphs; 1 or auto: the default); using the default, on.", _ENV)
_enabled = _ENV not in _OFF                           # the default ("auto"): on where it can be built
_in_graphs = _ENV == "compiled"                       # also inside torch.compile, as the `attnres::` ops


def extension_name(prefix: str, source: str) -> str:
    """The name of a build of C++ `source` for this CPU (`-march=native`): `prefix` and a digest of the
    CPU's feature flags and of the source, so that a home directory shared by different machines never loads a
    foreign binary, and two versions of a source (say an installed package and a checkpoint's remote code)
    each keep their own build instead of rebuilding over each other in every process. The digest also covers
    the torch it builds against (its version and directory, whose headers the build includes): two
    environments sharing one home directory would otherwise rebuild over each other, in turn."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    against = f"torch {torch.__version__} {os.path.dirname(torch.__file__)}"
    built = f"{platform.machine()} {platform.processor()} {flags}\n{against}\n{source}"
    return f"{prefix}_{hashlib.sha1(built.encode()).hexdigest()[:10]}"


def _extension_name() -> str:
    """The kernel's build name (`extension_name` of its source)."""
    return extension_name("attnres_depth_attention_cpu", KERNEL_SOURCE)


@contextlib.contextmanager
def _build_lock(build_dir: str):
    """Held while building: an OS lock (released by the OS when its holder dies), so that a lock file
    torch's builder left behind in a killed process (torch would wait on it forever) is known stale."""
    try:
        import fcntl
    except ImportError:                               # not POSIX: torch's own lock file only
        yield
        return
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "attnres.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(build_dir, "lock"))   # any build that held it is dead: we hold the OS lock
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compiler_flags() -> tuple[list[str], list[str]]:
    """The compile and link flags of the kernel (`load_inline`'s `extra_cflags`, `extra_ldflags`): for
    this CPU, OpenMP where the compiler has it."""
    flags, ldflags = ["-O3", "-march=native"], []
    if platform.system() == "Linux":
        # OpenMP makes at::parallel_for split tokens across torch's threads; the library it links
        # (libgomp.so.1) resolves to the copy torch already loaded. Apple clang has no -fopenmp.
        flags.append("-fopenmp")
        ldflags.append("-fopenmp")
    else:
        flags.append("-fopenmp-simd")
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-mprefer-vector-width=512")  # full AVX-512 width where there is one
    return flags, ldflags


@contextlib.contextmanager
def _package_ninja_first():
    """While held, the `ninja` that pip installed beside this Python (the PyPI package, a dependency of attnres)
    comes first on PATH, where torch's builder looks for it. Without this, which ninja builds depends on how
    Python was started: an activated virtual environment finds the package's, `.venv/bin/python` run directly
    finds the system's or none (then the build fails with ninja installed). And two ninja versions hash a
    build command differently (1.11 and 1.13 here), so each took the other's build for a changed command and
    rebuilt it, 30-100 s a process. (PATH is the process's: other threads see it during the build.)"""
    schemes = [sysconfig.get_path("scripts"), sysconfig.get_path("scripts", f"{os.name}_user")]
    found = next(filter(None, (shutil.which("ninja", path=folder) for folder in schemes if folder)), None)
    if found is None:                                  # not installed by pip here: PATH's ninja, as torch finds it
        yield
        return
    before = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(found)] + ([before] if before else []))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = before


def load_inline(name: str, source: str, functions: list[str], build_directory: str | None = None):
    """`torch.utils.cpp_extension.load_inline` of C++ `source` with this CPU's `compiler_flags()`, without the
    `#include <torch/extension.h>` it otherwise puts first (where this torch can leave it out): all of
    libtorch's C++ API, a sixth of the kernel's build time. `source` includes what it uses (ATen,
    `<torch/python.h>` for the bindings)."""
    import inspect

    import torch.utils.cpp_extension as cpp_extension

    flags, ldflags = compiler_flags()
    options = dict(extra_cflags=flags, extra_ldflags=ldflags, build_directory=build_directory)
    if "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters:
        options["no_implicit_headers"] = True
    with _package_ninja_first():
        return cpp_extension.load_inline(name, cpp_sources=source, functions=functions, **options)


def _build():
    """Compile (or load from torch's extension cache) the kernel module; one line of log when compiled."""
    global _module
    if _module is None:
        import torch.utils.cpp_extension as cpp_extension

        name, start = _extension_name(), time.perf_counter()
        try:
            build_dir = cpp_extension._get_build_directory(name, False)      # where load_inline builds it
            with _build_lock(build_dir):
                functions = ["site_boundary", "mix_site", "push_source", "register_ops"]
                module = load_inline(name, KERNEL_SOURCE, functions, build_directory=build_dir)
        except Exception as error:  # compiler missing, ninja missing, headers missing, ...
            raise RuntimeError(
                f"Could not build the AttnRes CPU kernel ({type(error).__name__}: {error}). It needs a C++ "
                "compiler (g++ or clang++) and `ninja` (pip install ninja); without them turn it off "
                "(ATTNRES_CPU_KERNEL=0): the torch path computes the same depth attention."
            ) from error
        seconds = time.perf_counter() - start
        if seconds > 5:                               # compiled now, not loaded from the cache
            logger.warning("AttnRes: built the fused C++ CPU kernel for depth attention in %.0f s (cached in %s; "
                           "ATTNRES_CPU_KERNEL=0 turns it off)", seconds, build_dir)
        _module = module
    return _module


def _first_use() -> bool:
    """The default path's first call: build or load the kernel; where that fails, say so in one line and
    stay on the torch path for the rest of the process (no exception reaches the caller)."""
    global _enabled
    try:
        _build()
    except Exception as error:                        # whatever it is, the torch path still works
        _enabled = False
        cause = str(error.__cause__ or error).strip().splitlines()
        logger.warning("AttnRes: the fused C++ CPU kernel could not be built (%s: %s); depth attention runs on "
                       "the torch path (the same maths, slower eager decoding). It needs a C++ compiler and ninja "
                       "(pip install ninja); ATTNRES_CPU_KERNEL=0 silences this.",
                       type(error.__cause__ or error).__name__, (cause[0] if cause else "")[:200])
        return False
    return True


def enable_cpu_kernel(enabled: bool = True, compiled: bool = False) -> None:
    """Turn the fused CPU kernel on (the default; this builds it now and raises if it cannot) or off
    (`enable_cpu_kernel(False)`: every site on the torch path). `compiled=True` also runs it inside
    `torch.compile` graphs (as the custom ops `attnres::site_boundary` / `attnres::mix_site`: faster in
    vLLM's graphs, no faster than Inductor's code in transformers' compiled decoding, in our measurements)."""
    global _enabled, _in_graphs
    if enabled:
        _build()
    _enabled, _in_graphs = enabled, enabled and compiled


def cpu_kernel_applies(partial: Tensor) -> bool:
    """Whether a site mixing `partial` runs the fused kernel: it is enabled (the default), the tensors
    are on the CPU, no gradient is being recorded, and this is eager code or the kernel is enabled for
    graphs. The first `True` builds the kernel (or finds that it cannot: then `False` from then on)."""
    if not _enabled or partial.device.type != "cpu" or torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():
        return _in_graphs                             # built by then: enable_cpu_kernel(), or at import (env)
    return _module is not None or _first_use()


def _mix_site_impl(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor, query: Tensor,
                   gain: Tensor | None, eps: float, dtype: torch.dtype, keep_weights: bool) -> list[Tensor]:
    mixed, weights = _build().mix_site(storage, inv_storage, num_stored, partial, query, gain, eps, dtype,
                                       keep_weights)
    return [mixed, weights if keep_weights else partial.new_empty(0)]      # an op returns tensors only


def _mix_site_fake(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor, query: Tensor,
                   gain: Tensor | None, eps: float, dtype: torch.dtype, keep_weights: bool) -> list[Tensor]:
    weights_shape = (*partial.shape[:-1], num_stored + 1) if keep_weights else (0,)
    return [partial.new_empty(partial.shape, dtype=dtype), partial.new_empty(weights_shape)]


if not hasattr(torch.ops.attnres, "mix_site"):      # once per process (the package and a Hub copy may both load)
    torch.library.custom_op("attnres::mix_site", _mix_site_impl, mutates_args=())
    torch.library.register_fake("attnres::mix_site", _mix_site_fake)

_SIGNATURE = ("({storage}, {inv_storage}, int num_stored, {partial}, {output}, Tensor query, "
              "Tensor? gain, float eps, Tensor? norm_weight, float norm_eps) -> {returns}")


def _boundary_fake(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor | None,
                   output: Tensor | None, query: Tensor, gain: Tensor | None, eps: float,
                   norm_weight: Tensor | None, norm_eps: float) -> tuple[Tensor, Tensor]:
    """`attnres::site_boundary`'s results, shapes and dtypes only: (new partial or `[0]`, the normed mix)."""
    ref = partial if output is None else output
    dtype = query.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, query.dtype)
    return (ref.new_empty(ref.shape if output is not None else (0,), dtype=inv_storage.dtype),
            ref.new_empty(ref.shape, dtype=dtype))


def _boundary_store_fake(*args) -> Tensor:
    """`attnres::site_boundary_store`'s and `attnres::site_boundary_reuse`'s result: the normed mix (the
    block goes into the bank; the new partial into `partial`)."""
    return _boundary_fake(*args)[1]


def _boundary_into_fake(*args) -> Tensor:
    """`attnres::site_boundary_into`'s result: the new partial (the normed mix goes into `output`)."""
    return _boundary_fake(*args)[0]


def _boundary_nothing_fake(*args) -> None:
    """`attnres::site_boundary_store_into` and `attnres::site_boundary_reuse_into` return nothing: they write
    the bank or the partial, and the normed mix into `output`."""
    return None


def _boundary_first_call(name: str):
    """The ops' kernel until the C++ one is registered: builds (or loads) the extension, registers its CPU
    kernels with the dispatcher, which take precedence from then on, and calls the op again."""
    def first_call(*args):
        _build().register_ops()
        return getattr(torch.ops.attnres, name)(*args)
    return first_call


# Each op is registered once per process: the package and a Hub copy of this file (possibly an older one,
# with fewer ops) may both be imported. The boundary is six ops, so that each declares (and does) only
# its writes: the one that stores a block writes the bank, the one that reuses the partial writes the new
# partial into it, and each has an `_into` twin that also writes the normed mix over the sublayer output.
# Schemas and fake implementations are defined here, the CPU kernels in C++ (`register_ops`), so a compiled
# graph calls the C++ without a Python hop; until the extension is loaded a Python kernel for any backend
# (CompositeExplicitAutograd, below the CPU kernel in precedence) loads it.
_LIBRARY = torch.library.Library("attnres", "FRAGMENT")  # a registration lives as long as its Library
_BOUNDARY_OPS = (  # name, bank written, partial written, output written, returns, fake
    ("site_boundary", "", "", "", "(Tensor, Tensor)", _boundary_fake),
    ("site_boundary_store", "(a!)", "", "", "Tensor", _boundary_store_fake),
    ("site_boundary_reuse", "", "(a!)", "", "Tensor", _boundary_store_fake),
    ("site_boundary_into", "", "", "(c!)", "Tensor", _boundary_into_fake),
    ("site_boundary_store_into", "(a!)", "", "(c!)", "()", _boundary_nothing_fake),
    ("site_boundary_reuse_into", "", "(a!)", "(c!)", "()", _boundary_nothing_fake),
)
for _name, _bank, _partial, _output, _returns, _fake in _BOUNDARY_OPS:
    if not hasattr(torch.ops.attnres, _name):
        _LIBRARY.define(_name + _SIGNATURE.format(storage=f"Tensor{_bank} storage",
                                                  inv_storage=f"Tensor{_bank and '(b!)'} inv_storage",
                                                  partial=f"Tensor{_partial}? partial",
                                                  output=f"Tensor{_output}? output", returns=_returns))
        torch.library.register_fake(f"attnres::{_name}", _fake)
        _LIBRARY.impl(_name, _boundary_first_call(_name), "CompositeExplicitAutograd")


if _in_graphs:          # ATTNRES_CPU_KERNEL=compiled: graphs are traced before any eager call could build it
    _first_use()


def fused_push_source(bank: DepthBank, partial: Tensor, eps: float) -> DepthBank:
    """`depth_attention.push_source` in one C++ call, in place (a bank with no room left grows by
    concatenation as in the torch function). Forward only: call it where `cpu_kernel_applies`."""
    if bank.num_stored >= bank.storage.shape[-2] or torch.compiler.is_compiling():   # compiled: fused by Inductor
        return push_source(bank, partial, eps)
    _build().push_source(bank.storage, bank.inv_storage, bank.num_stored, acc(partial), eps)
    return DepthBank(bank.storage, bank.inv_storage, bank.num_stored + 1)


def fused_mix_site(bank: DepthBank, partial: Tensor, query: Tensor, eps: float, dtype: torch.dtype,
                   keep_weights: bool = False, gain: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`depth_attention.mix_site` (same arguments, same results up to float rounding) in one C++
    call. With `gain` (the site's key-norm weight), `query` is the raw pseudo-query and the two are
    folded in C++, as `fold_queries` would. Forward only: call it where `cpu_kernel_applies`."""
    args = (bank.storage, bank.inv_storage, bank.num_stored, acc(partial), query, gain, eps, dtype, keep_weights)
    if torch.compiler.is_compiling():
        mixed, weights = torch.ops.attnres.mix_site(*args)
        return mixed, (weights if keep_weights else None)
    # Eager calls the extension directly: the op's dispatch, or one more Python frame, costs about as
    # much as a decoding site's arithmetic. Without `keep_weights` the extension returns no weights.
    return tuple((_module or _build()).mix_site(*args))


def fused_site_boundary(bank: DepthBank, partial: Tensor | None, output: Tensor | None, query: Tensor, eps: float,
                        closes_block: bool, norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype,
                        keep_weights: bool = False, keep_mixed: bool = False,
                        gain: Tensor | None = None, reuse_partial: bool = False,
                        consume_output: bool = False) -> SiteBoundary:
    """`depth_attention.site_boundary` (same arguments, same results up to float rounding) in one C++
    call; the block, when the site closes one, is stored in place. With `gain` (the site's key-norm
    weight), `query` is the raw pseudo-query, folded in C++. With `reuse_partial` (the caller no longer
    reads `partial`), the new partial is written into `partial`'s memory (when contiguous); with
    `consume_output` (the caller no longer reads `output`), the normed mix is written into `output`'s
    (when contiguous and of the normed mix's dtype). Forward only: call it where `cpu_kernel_applies`."""
    n = bank.num_stored
    no_room = closes_block and n >= bank.storage.shape[-2]              # the reference grows the bank
    # The ops return only what the models read, in the query's dtype: other compiled calls take the reference.
    not_the_models = torch.compiler.is_compiling() and (keep_weights or keep_mixed or dtype != query.dtype)
    if no_room or not_the_models:
        query = query if gain is None else fold_queries(query, gain[None])[0]
        return site_boundary(bank, partial, output, query, eps, closes_block, norm_weight, norm_eps, dtype,
                             keep_weights, keep_mixed)
    if output is None and partial.dtype not in (torch.float32, torch.float64):
        partial, output = None, partial                # the embedding: read (as the output) in float32
        consume_output = False                         # and not the caller's to give
    if torch.compiler.is_compiling():
        new_partial, result = _compiled_boundary(bank, partial, output, query, gain, eps, closes_block, norm_weight,
                                                 norm_eps, reuse_partial, consume_output)
        mixed, normed, weights = (result, None, None) if norm_weight is None else (None, result, None)
    else:
        # Eager calls the extension directly (see `fused_mix_site`); what it does not produce is None.
        new_partial, mixed, normed, weights = (_module or _build()).site_boundary(
            bank.storage, bank.inv_storage, n, partial, output, query, gain, eps, closes_block, norm_weight, norm_eps,
            dtype, keep_mixed, keep_weights, reuse_partial, consume_output)
    if closes_block:
        return SiteBoundary(DepthBank(bank.storage, bank.inv_storage, n + 1), None, mixed, normed, weights)
    return SiteBoundary(bank, partial if new_partial is None else new_partial, mixed, normed, weights)


def _compiled_boundary(bank: DepthBank, partial: Tensor | None, output: Tensor | None, query: Tensor,
                       gain: Tensor | None, eps: float, closes_block: bool, norm_weight: Tensor | None,
                       norm_eps: float, reuse_partial: bool, consume_output: bool) -> tuple[Tensor | None, Tensor]:
    """The boundary as a compiled graph's op: (the new partial, or None where there is none; the normed mix,
    or the mix without a norm)."""
    args = (bank.storage, bank.inv_storage, bank.num_stored, partial, output, query, gain, eps, norm_weight, norm_eps)
    reuse = reuse_partial and partial is not None and output is not None
    if (consume_output and output is not None and norm_weight is not None
            and output.dtype == torch.promote_types(norm_weight.dtype, query.dtype)):
        if closes_block:                                                # the normed mix written over `output`
            torch.ops.attnres.site_boundary_store_into(*args)
            return None, output
        if reuse:
            torch.ops.attnres.site_boundary_reuse_into(*args)
            return partial, output
        return torch.ops.attnres.site_boundary_into(*args), output
    if closes_block:
        return None, torch.ops.attnres.site_boundary_store(*args)
    if reuse:
        return partial, torch.ops.attnres.site_boundary_reuse(*args)       # the new partial written into it
    new_partial, result = torch.ops.attnres.site_boundary(*args)
    return (new_partial if output is not None else None), result
