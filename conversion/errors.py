"""The errors of the command-line tools, and the one way they end a run.

Every message names the offending value, what was expected and how to fix it, because the user sees
it as the final line of a failed run. All four commands (`attnres-convert`, `attnres-quantize`,
`attnres-retrofit`, `attnres-serve`) print it as `PROG: error: MESSAGE` on stderr and exit with

- 0: done;
- 1: the work failed: an input that cannot be used (missing, corrupt, the wrong kind of model), a
  failed verification, an unreachable registry or Hub;
- 2: bad usage: the command line itself is wrong (argparse's own errors, an option value out of range,
  options that do not go together), found before any input is read.
"""

import sys

EXIT_FAILED = 1
EXIT_USAGE = 2


class ConversionError(ValueError):
    """A checkpoint or option the converter cannot turn into a faithful AttnRes checkpoint (exit 1)."""

    exit_status = EXIT_FAILED


class UsageError(ConversionError):
    """The command line itself is wrong: an option value or a combination of options (exit 2)."""

    exit_status = EXIT_USAGE


def fail(prog: str, err: BaseException | str, status: int | None = None) -> int:
    """End a command on `err`: print `PROG: error: MESSAGE` on stderr and return the exit status
    (`status`, else the error's own `exit_status`, else `EXIT_FAILED`)."""
    print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return status if status is not None else getattr(err, "exit_status", EXIT_FAILED)


def hub_reason(err: BaseException, revision: str | None = None) -> str:
    """Why a Hub call failed, in one line: `huggingface_hub`'s messages span several lines (a URL, a request
    id, advice), and the command's message must stay the last line of the run. Known cases are named
    with their fix; anything else is its type and the first line of its message."""
    from huggingface_hub import errors

    if isinstance(err, (errors.OfflineModeIsEnabled, errors.LocalEntryNotFoundError)):
        return ("it is not in the local Hub cache and HF_HUB_OFFLINE=1 forbids downloading (unset it, or "
                "download the repo on a connected machine)")
    if isinstance(err, errors.LocalTokenNotFoundError):
        return "no Hub token was found (log in with `hf auth login` or set HF_TOKEN)"
    if isinstance(err, errors.RevisionNotFoundError):
        return f"the repo has no revision {revision!r} (check --revision)"
    if isinstance(err, errors.GatedRepoError):
        return "the repo is gated (accept its terms on the Hub, then set HF_TOKEN to a token of that account)"
    if isinstance(err, errors.RepositoryNotFoundError):
        return "the Hub has no such repo, or it is private and your token (HF_TOKEN) has no access to it"
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status in (401, 403):
        return f"the Hub refused the request (HTTP {status}: check that HF_TOKEN is valid and may write there)"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else 'no message'}"


def listing(items, limit: int = 20) -> str:
    """Sorted, comma-separated names; long lists are cut with a count so the error stays readable."""
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
