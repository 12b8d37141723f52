"""Names every sink can store: checked where they enter (``run()``, ``step()``, ``log()``), so a
name no store can hold is refused at once instead of poisoning the blocks that carry it."""

from __future__ import annotations

from batchtap.errors import InputError

__all__ = ["unstorable", "check_storable"]


def unstorable(name: str) -> str | None:
    """Why ``name`` cannot be stored by every sink, or None when it can.

    PostgreSQL text cannot hold a NUL character, and no UTF-8 store (PostgreSQL, SQLite, JSON
    lines, CSV, TensorBoard) can hold a lone surrogate.

    Example:
        >>> unstorable("loss/train ✓"), unstorable("a\\x00b")
        (None, 'it contains a NUL character (\\\\x00) at index 1, which PostgreSQL text cannot hold')
    """
    at = name.find("\x00")
    if at >= 0:
        return f"it contains a NUL character (\\x00) at index {at}, which PostgreSQL text cannot hold"
    try:
        name.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"it contains {name[exc.start]!r} at index {exc.start}, which is not valid Unicode text (UTF-8)"
    return None


def check_storable(label: str, name: str) -> None:
    """Raise :class:`~batchtap.errors.InputError` when ``name`` is not :func:`storable <unstorable>`.

    Example:
        >>> check_storable("run name", "a\\x00b")
        Traceback (most recent call last):
        ...
        batchtap.errors.InputError: run name 'a\\x00b' cannot be stored: it contains a NUL character (\\x00) at index 1, which PostgreSQL text cannot hold; expected text without NUL characters or lone surrogates; fix: remove or replace that character
    """
    why = unstorable(name)
    if why is not None:
        raise InputError(
            f"{label} {name!r} cannot be stored: {why}; expected text without NUL characters or lone "
            "surrogates; fix: remove or replace that character"
        )
