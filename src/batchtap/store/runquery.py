"""A small query language over runs: ``lr<0.01 and status=finished``, parsed, never run as SQL.

A query is clauses joined by ``and`` / ``or`` (``and`` binds tighter; no parentheses). A clause is
``KEY OP VALUE``:

* ``KEY`` — a run field (``id``, ``name``, ``status``, ``steps``, ``best``, ``last``, ``duration``,
  ``anomalies``, ``tag``, ``notes``), else a config key (``lr``, ``optimizer.name``; ``config.lr``
  says config explicitly). A key no run has is an error, so a typo is never an empty table.
* ``OP`` — ``=`` (``==``), ``!=``, ``<``, ``<=``, ``>``, ``>=``, ``~`` (contains, case-insensitive).
  ``tag=x`` holds when ``x`` is one of the run's tags.
* ``VALUE`` — a number, or a word, or a quoted string (``name="my run"``). Two numbers compare as
  numbers, anything else as text.

The query is matched in Python against the values the reader returned: nothing of it reaches SQL.

Example:
    >>> q = parse("lr<0.01 and status=finished")
    >>> [r["id"] for r in q.filter([
    ...     {"id": "a", "status": "finished", "config": {"lr": 0.001}},
    ...     {"id": "b", "status": "finished", "config": {"lr": 0.1}},
    ...     {"id": "c", "status": "failed", "config": {"lr": 0.001}},
    ... ])]
    ['a']
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["parse", "Query", "QueryError", "FIELDS"]

#: The run fields a key names before config keys; each maps to the key of the run's dict.
FIELDS = {
    "id": "id",
    "name": "name",
    "status": "status",
    "steps": "steps",
    "best": "best_value",
    "last": "last_value",
    "duration": "duration",
    "anomalies": "anomalies",
    "tag": "tags",
    "tags": "tags",
    "notes": "notes",
    "note": "notes",
}
_OPS = ("<=", ">=", "!=", "==", "=", "<", ">", "~")
_TOKEN = re.compile(
    r"""\s*(?:(?P<word>and|or)(?=\s|$)|(?P<key>[A-Za-z_][\w.\-/]*)\s*(?P<op><=|>=|!=|==|=|<|>|~)\s*"""
    r"""(?:"(?P<dq>[^"]*)"|'(?P<sq>[^']*)'|(?P<bare>[^\s"']+)))""",
    re.IGNORECASE,
)
_MAX_LENGTH = 2000
_HELP = "expected clauses KEY OP VALUE joined by and/or, e.g. lr<0.01 and status=finished"


class QueryError(ValueError):
    """A query that does not parse, or names a key no run has."""


@dataclasses.dataclass(frozen=True, slots=True)
class Clause:
    """One ``KEY OP VALUE``."""

    key: str
    op: str
    value: str

    def holds(self, run: Mapping[str, Any]) -> bool:
        """Whether the run matches (a run without the key never does)."""
        found, got = lookup(run, self.key)
        if not found or got is None:
            return False
        if isinstance(got, (list, tuple)):  # tags: any of them
            return any(self._compare(item) for item in got)
        return self._compare(got)

    def _compare(self, got: Any) -> bool:
        want_num, got_num = _number(self.value), None if isinstance(got, str) else _number(got)
        if want_num is not None and got_num is not None:
            a, b = got_num, want_num
            if math.isnan(a):
                return self.op == "!="
        else:
            a, b = str(got).lower(), self.value.lower()  # type: ignore[assignment]
        if self.op == "~":
            return str(b) in str(a)
        return {
            "=": a == b,
            "==": a == b,
            "!=": a != b,
            "<": a < b,
            "<=": a <= b,
            ">": a > b,
            ">=": a >= b,
        }[self.op]


def _number(x: Any) -> float | None:
    if isinstance(x, bool):
        return float(x)
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    return None


def lookup(run: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    """The value a key names in a run's dict: a field, else a config key (dotted: nested)."""
    lowered = key.lower()
    if lowered in FIELDS and not lowered.startswith("config."):
        name = FIELDS[lowered]
        return name in run, run.get(name)
    config = run.get("config") or {}
    path = key[len("config.") :] if lowered.startswith("config.") else key
    if path in config:
        return True, config[path]
    node: Any = config
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node


@dataclasses.dataclass(frozen=True, slots=True)
class Query:
    """A parsed query: ``any`` of groups, each ``all`` of its clauses."""

    groups: tuple[tuple[Clause, ...], ...]
    text: str

    def matches(self, run: Mapping[str, Any]) -> bool:
        """Whether one run matches."""
        return any(all(c.holds(run) for c in group) for group in self.groups)

    def filter(self, runs: Sequence[Mapping[str, Any]]) -> list[Any]:
        """The runs that match, in their order.

        Raises:
            QueryError: a key that no run has (almost always a typo).
        """
        for group in self.groups:
            for clause in group:
                if runs and not any(lookup(r, clause.key)[0] for r in runs):
                    raise QueryError(
                        f"no run has {clause.key!r} in query {self.text!r}; expected a run field "
                        f"({', '.join(sorted(set(FIELDS) - {'note', 'tags'}))}) or a config key; fix: check "
                        "the spelling (config keys are shown as the runs table's columns)"
                    )
        return self.matching(runs)

    def matching(self, runs: Sequence[Mapping[str, Any]]) -> list[Any]:
        """The runs that match, in their order (no check of the keys)."""
        return [r for r in runs if self.matches(r)]


def parse(text: str) -> Query:
    """Parse a query (see the module's documentation); an empty one matches every run.

    Raises:
        QueryError: it does not parse; the message shows where and an example.
    """
    if not isinstance(text, str):
        raise QueryError(f"a query must be a str, got {type(text).__name__}")
    if len(text) > _MAX_LENGTH:
        raise QueryError(f"a query may be at most {_MAX_LENGTH} characters, got {len(text)}; fix: shorten it")
    groups: list[tuple[Clause, ...]] = []
    current: list[Clause] = []
    pos, want_clause = 0, True
    stripped = text.strip()
    if not stripped:
        return Query(((),), text)
    while pos < len(text):
        if not text[pos:].strip():
            break
        m = _TOKEN.match(text, pos)
        if m is None or (want_clause != (m.group("key") is not None)):
            what = "a clause KEY OP VALUE" if want_clause else "'and' or 'or'"
            got = text[pos:].strip()[:40]
            raise QueryError(f"cannot read query {text!r} at {got!r}: expected {what}; {_HELP}")
        if m.group("key") is not None:
            value = next(v for v in (m.group("dq"), m.group("sq"), m.group("bare")) if v is not None)
            current.append(Clause(m.group("key"), m.group("op"), value))
        elif m.group("word").lower() == "or":
            groups.append(tuple(current))
            current = []
        want_clause = m.group("key") is None
        pos = m.end()
    if want_clause:
        raise QueryError(f"query {text!r} ends after 'and'/'or': expected a clause KEY OP VALUE; {_HELP}")
    groups.append(tuple(current))
    return Query(tuple(groups), text)
