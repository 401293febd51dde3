"""The one exception type of the converters.

Every message names the offending value, what was expected and how to fix it, because the user of
`attnres-convert` sees it as the final line of a failed run.
"""


class ConversionError(ValueError):
    """A checkpoint or option the converter cannot turn into a faithful AttnRes checkpoint."""


def listing(items, limit: int = 20) -> str:
    """Sorted, comma-separated names; long lists are cut with a count so the error stays readable."""
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
