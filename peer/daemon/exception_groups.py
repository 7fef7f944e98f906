"""Finding one error inside the exception groups that trio nurseries wrap errors in."""

from __future__ import annotations

__all__ = ["find_exception"]


def find_exception(error: BaseException, wanted: type[BaseException]) -> BaseException | None:
    """The first ``wanted`` that is ``error`` or nested in its exception groups, else None."""
    if isinstance(error, wanted):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = find_exception(inner, wanted)
        if found is not None:
            return found
    return None
