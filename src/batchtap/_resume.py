"""Which run ``tap.run(resume=...)`` continues, and where: the full id a short id (a unique id
prefix, as ``batchtap runs`` prints) names in the stores of the run's SQL sinks, and the step after
the last one they hold."""

from __future__ import annotations

import re
from collections.abc import Sequence

from batchtap.errors import ConfigError
from batchtap.pipeline.transport.host import PipelineHost

__all__ = ["resume_point", "resume_id", "sql_stores"]


def resume_point(
    pipeline: PipelineHost, ref: str | None, sinks: Sequence[object] = ()
) -> tuple[str | None, int, str | None]:
    """The full id of the run ``ref`` names (its id, or a unique id prefix such as the 8-character
    short id ``batchtap runs`` prints: see :func:`resume_id`), the first step of the resumed run
    (one after the last step any sink has stored) and the name the run was stored under; asks the
    sinks through the pipeline (a wait, at run start only). ``None`` (a new run): ``(None, 0, None)``."""
    if ref is None:
        return None, 0, None
    run_id = resume_id(sinks, ref)
    stored, names = pipeline.stored_position(run_id)
    if not stored and not names:
        raise ConfigError(
            f"cannot resume run {run_id!r}: no sink holds that run; resume needs a sink that can tell "
            "(bt.sinks.SQLite or bt.sinks.Postgres) holding it; fix: check the id (batchtap runs) and the store"
        )
    # a run stored before its first flush (killed early) has no step yet: it resumes at step 0
    return run_id, (max(stored) + 1 if stored else 0), (names[0] if names else None)


#: A full run id as batchtap makes them (``uuid4().hex``): taken as it is, no store is asked.
_FULL_ID = re.compile(r"[0-9a-f]{32}")


def resume_id(sinks: Sequence[object], ref: str) -> str:
    """The id of the run ``ref`` names for ``resume=``: ``ref`` itself when it is a full id or a
    store holds a run of that exact id; else the one run whose id starts with ``ref`` in the stores
    of the SQL sinks (the short id ``batchtap runs`` prints). Run names are not taken: resuming
    "the latest run called x" could continue the wrong one.

    Raises:
        ConfigError: the prefix matches several runs (the message names them).
    """
    if _FULL_ID.fullmatch(ref):
        return ref
    matches: set[str] = set()
    for _, where, schema in sql_stores(sinks):
        import batchtap.store

        try:
            with batchtap.store.open(where, schema=schema, migrate=False) as store:
                found = store.run(ref)
        except batchtap.store.RunNotFound as exc:
            if exc.candidates and all(c.startswith(ref) for c in exc.candidates):  # an ambiguous prefix
                matches.update(exc.candidates)
            continue
        except batchtap.store.StoreError:
            continue  # a store not made yet, or down: resume_point says that no sink holds the run
        if found.id == ref:
            return ref
        if found.id.startswith(ref):  # a unique prefix here (a run's name is not taken)
            matches.add(found.id)
    if len(matches) > 1:
        raise ConfigError(
            f"cannot resume run {ref!r}: that id prefix matches {len(matches)} runs "
            f"({', '.join(sorted(matches)[:10])}); expected a prefix of one run's id; fix: pass more "
            "characters of the id (batchtap runs lists them)"
        )
    return matches.pop() if matches else ref


def sql_stores(sinks: Sequence[object]) -> list[tuple[str, str, str | None]]:
    """Where the SQL sinks among ``sinks`` (unwrapped from their retrying wrapper) store runs:
    ``("sqlite", path, None)`` or ``("postgresql", DSN, schema)``."""
    from batchtap.sinks.postgres import Postgres
    from batchtap.sinks.resilient import ResilientSink
    from batchtap.sinks.sqlite import SQLite

    out: list[tuple[str, str, str | None]] = []
    for sink in sinks:
        if isinstance(sink, ResilientSink):
            sink = sink.sink
        if isinstance(sink, SQLite):
            out.append(("sqlite", sink.path, None))
        elif isinstance(sink, Postgres) and "***" not in sink.dsn:
            # the sink shows its DSN without a password: one in the URL leaves that store unasked
            # (a full id still resumes; PGPASSWORD or ~/.pgpass keep the DSN whole)
            out.append(("postgresql", sink.dsn, sink.schema))
    return out
