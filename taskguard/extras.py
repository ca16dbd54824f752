"""The one message for a feature whose optional dependencies (a packaging extra) are missing.

taskguard is installed from its wheel or a checkout, never by name from PyPI, where the name
``taskguard`` belongs to an unrelated project (see the README's Quick start); so the message
names the extra to install with, not a ``pip install taskguard[...]`` that would fetch that
project."""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(what: str, extra: str, error: BaseException | None = None) -> str:
    """``"<what> needs the '<extra>' extra ..."``: how to install it, and the import error seen."""
    seen = f" ({error})" if error is not None else ""
    return (
        f"{what} needs taskguard's {extra!r} extra{seen}: reinstall taskguard from its wheel or checkout with it, "
        f"e.g. pip install \"/path/to/taskguard[{extra}]\" (not from PyPI, where 'taskguard' is another project)"
    )
