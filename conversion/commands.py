"""The console scripts of the checkpoint tools (`[project.scripts]` in pyproject.toml).

Each imports its command only once called, under the same Ctrl-C handling the command has while it
works: loading torch and transformers takes the first seconds of every run, and an interrupt there
would otherwise end in a traceback rather than in the one line every later interrupt gives. This
module, and the package's `__init__`, import nothing heavy for that reason.
"""

import importlib

from .errors import EXIT_INTERRUPTED, fail


def run(prog: str, module: str) -> int:
    """Import `module` (in this package) and return what its `main()` returns; an interrupt while
    importing ends in one line and exit status 130, before anything was read or written, and so does one
    that reaches here past the command's own handler."""
    try:
        main = importlib.import_module(module, __package__).main
    except KeyboardInterrupt:
        return fail(prog, "interrupted while starting; nothing was read or written.", status=EXIT_INTERRUPTED)
    try:
        return main()
    except KeyboardInterrupt:    # one that escaped the command's own handler, e.g. between publishing and its summary
        return fail(prog, "interrupted; every output is published whole or not at all (staged, then renamed).",
                    status=EXIT_INTERRUPTED)


def convert() -> int:
    """`attnres-convert` (`cli.main`)."""
    return run("attnres-convert", ".cli")


def quantize() -> int:
    """`attnres-quantize` (`quantize.main`)."""
    return run("attnres-quantize", ".quantize")


def retrofit() -> int:
    """`attnres-retrofit` (`retrofit.main`)."""
    return run("attnres-retrofit", ".retrofit")
