"""Names renamed in the public API, kept working for one release: the old name is accepted with
a `DeprecationWarning` that names the new one.

`renamed_keywords` wraps a function; `renamed_keyword` is the same check for a hot function
that takes the old name itself (keyword-only, default `UNSET`), so no wrapper adds a call;
`renamed_attribute` is a class's old attribute name, read through to the new one.
"""

from __future__ import annotations

import functools
import warnings

UNSET = object()
"""The default of an old keyword a function takes itself: the caller did not pass it."""


def renamed_keyword(where: str, old: str, new: str, old_value, new_value, stacklevel: int = 3):
    """The value of `new` when a caller passed `old` (`old_value`): warns, and refuses both at once."""
    if new_value is not None and new_value is not UNSET:
        raise TypeError(f"{where}: pass {new}= only ({old}= is its deprecated name)")
    _warn(f"{where}: the keyword {old}= is deprecated", f"use {new}=", stacklevel + 1)
    return old_value


def renamed_attribute(owner: str, old: str, new: str) -> property:
    """A read-only property `old` of class `owner` that warns and returns attribute `new`."""

    def get(self):
        _warn(f"{owner}.{old} is deprecated", f"use {owner}.{new}", 3)
        return getattr(self, new)

    return property(get, doc=f"The deprecated name of ``{new}`` (removed in the next release).")


def _warn(what: str, instead: str, stacklevel: int) -> None:
    warnings.warn(
        f"{what} and will be removed in the next release; {instead}", DeprecationWarning, stacklevel=stacklevel
    )


def renamed_keywords(**renames: str):
    """Decorator: each ``old="new"`` keyword is accepted under its old name too (with a warning)."""

    def wrap(fn):
        where = fn.__qualname__

        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    kwargs[new] = renamed_keyword(where, old, new, kwargs.pop(old), kwargs.get(new, UNSET))
            return fn(*args, **kwargs)

        return call

    return wrap
