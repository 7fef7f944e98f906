"""Finding one error inside the exception groups that trio nurseries wrap errors in."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["find_exception"]

E = TypeVar("E", bound=BaseException)


def find_exception(error: BaseException, wanted: type[E], match: Callable[[Any], bool] | None = None) -> E | None:
    """The first ``wanted`` (for which ``match`` holds, if given) that is ``error`` or nested in
    its exception groups, else None."""
    if isinstance(error, wanted) and (match is None or match(error)):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = find_exception(inner, wanted, match)
        if found is not None:
            return found
    return None
