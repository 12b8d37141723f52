"""``Webhook``: alerts that reach someone — chosen events posted as JSON to a URL (a Slack, Mattermost
or Discord incoming webhook, or a service of your own).

The body is Slack-compatible: ``{"text": "...", "batchtap": {...}}`` — ``text`` is what a chat shows,
``batchtap`` the same facts as fields (run, step, kind, metric, status) for a service that parses
them. The events of one block go out in one post, one line each; a run's end in one post of its own.

Delivery runs on the sink's own worker thread, never on the training thread: each post has a
``timeout`` and is tried ``retries`` more times with a doubling pause. A post that fails every try
is dropped, counted and reported as a warning event through the other sinks, and the endpoint is
left alone for ``cooldown`` seconds (what it would have received is counted as dropped too), so a
dead endpoint costs one post's tries per cooldown and never backs up the pipeline into training.

The URL's secrets (its path and query, where Slack and Discord keep the token, and any user or
password) are never printed, logged or put in an event: the sink shows ``https://host/…``. A
``user:password@`` in the URL is sent as HTTP Basic authorization, never as part of the host name
(which would go to the name resolver).

Redirects: a 307 or 308 is followed with the same POST (at most 5 hops; the authorization is dropped
when the host changes); a 301, 302 or 303 is refused with a clear warning and counted as not
delivered, because a client following it would send a GET without the alert's body.

The run's end (``stopped``, ``failed``, ...) is always tried, even while the endpoint is left alone
after earlier failures; if it fails, the sink says so on stderr and the warning is stored by the
other sinks at the Tap's close.
"""

from __future__ import annotations

import base64
import json
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any, ClassVar

from batchtap.errors import ConfigError
from batchtap.records import Event, EventKind, Record, RunInfo, RunStatus
from batchtap.sinks.base import Sink

__all__ = ["Webhook", "redact_url", "WEBHOOK_EVENTS"]

#: what a webhook can post: event kinds, and the statuses a run can end with
WEBHOOK_EVENTS = ("anomaly", "action", "warning", "info", "skip", "stopped", "finished", "failed", "killed")
_DEFAULT_EVENTS = ("anomaly", "action", "stopped", "finished", "failed", "killed")


def redact_url(url: str) -> str:
    """The URL as it may be shown: scheme and host (and port) only.

    Example:
        >>> redact_url("https://hooks.slack.com/services/T000/B000/XXXXSECRET")
        'https://hooks.slack.com/…'
        >>> redact_url("http://user:pw@127.0.0.1:8080/hook?token=abc")
        'http://127.0.0.1:8080/…'
    """
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return f"{parts.scheme}://{host}/…"


_MAX_HOPS = 5


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Hand every 3xx back as an HTTPError: the sink decides (urllib would turn a POST into a GET)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


def _split_credentials(url: str) -> tuple[str, str | None]:
    """``url`` without its ``user:password@``, and the Basic authorization header value for it.

    Example:
        >>> _split_credentials("https://bob:s3@hooks.example:8443/x?y=1")
        ('https://hooks.example:8443/x?y=1', 'Basic Ym9iOnMz')
        >>> _split_credentials("https://hooks.example/x")
        ('https://hooks.example/x', None)
    """
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, None
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
    bare = urllib.parse.urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return bare, "Basic " + base64.b64encode(pair).decode("ascii")


class Webhook(Sink):
    """Post chosen events of a run as JSON to ``url``.

    Args:
        url: an ``http://`` or ``https://`` URL taking a JSON POST (e.g. a Slack incoming webhook).
        events: what to post, among :data:`WEBHOOK_EVENTS`: the event kinds ``"anomaly"``,
            ``"action"`` (what a rule did), ``"warning"``, ``"info"`` (a note), ``"skip"``, and the run's end as
            ``"stopped"`` (a stop rule, Ctrl-C), ``"finished"``, ``"failed"``, ``"killed"``.
            Default: anomalies, actions and every end.
        timeout: seconds one post may take.
        retries: further tries of a failed post (a connection error, a timeout, a 5xx or 429).
            Any other 4xx, and a 301/302/303 redirect, is not tried again.
        backoff: seconds before the first retry, doubled at each next one.
        cooldown: seconds the endpoint is left alone after a post failed every try.
        max_lines: most event lines in one post (the rest are counted in a last line).

    Example:
        >>> hook = Webhook("https://hooks.slack.com/services/T000/B000/XXXX", events=("anomaly", "failed"))
        >>> hook
        Webhook('https://hooks.slack.com/…', events=('anomaly', 'failed'))
    """

    #: a terminal-like sink: an alert replayed at a later run's start would be stale, and the sink
    #: never raises (it reports what it could not deliver)
    wrap_in_spool: ClassVar[bool] = False

    def __init__(
        self,
        url: str,
        *,
        events: Iterable[str] = _DEFAULT_EVENTS,
        timeout: float = 5.0,
        retries: int = 2,
        backoff: float = 0.5,
        cooldown: float = 60.0,
        max_lines: int = 20,
    ) -> None:
        if not isinstance(url, str) or urllib.parse.urlsplit(url).scheme not in ("http", "https"):
            shown = redact_url(url) if isinstance(url, str) else type(url).__name__
            raise ConfigError(f"Webhook url must be an http:// or https:// URL, got {shown}")
        chosen = (events,) if isinstance(events, str) else tuple(events)
        unknown = [e for e in chosen if e not in WEBHOOK_EVENTS]
        if unknown or not chosen:
            raise ConfigError(
                f"Webhook events must be among {', '.join(WEBHOOK_EVENTS)}, got {list(chosen)!r}; "
                "fix: e.g. events=('anomaly', 'failed')"
            )
        for name, value, low in (
            ("timeout", timeout, 0),
            ("backoff", backoff, -1e-300),
            ("cooldown", cooldown, -1e-300),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low:
                raise ConfigError(
                    f"Webhook {name} must be a number of seconds {'> 0' if low == 0 else '>= 0'}, got {value!r}"
                )
        for name, count, minimum in (("retries", retries, 0), ("max_lines", max_lines, 1)):
            if isinstance(count, bool) or not isinstance(count, int) or count < minimum:
                raise ConfigError(f"Webhook {name} must be an integer >= {minimum}, got {count!r}")
        self._url, self._auth = _split_credentials(url)
        self.shown_url = redact_url(url)
        self.events = chosen
        self.timeout, self.retries, self.backoff, self.cooldown = (
            float(timeout),
            retries,
            float(backoff),
            float(cooldown),
        )
        self.max_lines = max_lines
        self.delivered = 0  #: posts the endpoint accepted
        self.dropped = 0  #: events and run ends not delivered (failed posts and cooldown)
        self._quiet_until = 0.0
        self._names: dict[str, str] = {}  # run id -> name, for the lines
        self._reports: list[Event] = []
        self._last_run_id = ""

    def __repr__(self) -> str:
        return f"Webhook({self.shown_url!r}, events={self.events!r})"

    # -- the sink calls ----------------------------------------------------------------------
    def start_run(self, run: RunInfo) -> None:
        self._names[run.id] = run.name
        self._last_run_id = run.id

    def write(self, records: Sequence[Record], events: Sequence[Event] = ()) -> None:
        chosen = [e for e in events if e.kind.value in self.events]
        if not chosen:
            return
        chosen.sort(key=lambda e: e.step)
        lines = [self._line(e) for e in chosen[: self.max_lines]]
        if len(chosen) > self.max_lines:
            lines.append(f"… and {len(chosen) - self.max_lines} more events")
        first = chosen[0]
        facts = {
            "run_id": first.run_id,
            "run_name": self._names.get(first.run_id, ""),
            "events": [
                {"kind": e.kind.value, "step": e.step, "metric": e.metric, "message": e.message, "rank": e.rank}
                for e in chosen
            ],
        }
        self._post("\n".join(lines), facts, count=len(chosen), run_id=first.run_id, step=chosen[-1].step)

    def end_run(self, run: RunInfo) -> None:
        status = run.status.value
        if status not in self.events or run.status is RunStatus.RUNNING:
            return
        reason = f" ({run.stop_reason})" if run.stop_reason else ""
        text = f"batchtap: run '{run.name}' ({run.id[:8]}) {status}{reason}"
        facts = {"run_id": run.id, "run_name": run.name, "status": status, "stop_reason": run.stop_reason}
        # the run's end is the alert people wait for: tried even inside a cooldown
        error = self._post(text, facts, count=1, run_id=run.id, step=-1, always=True)
        if error is not None:
            # at the run's end no later block carries the warning: say it now (stored at close)
            print(
                f"batchtap: webhook {self.shown_url} did not take the run's {status!r} alert ({error})",
                file=sys.stderr,
                flush=True,
            )
        self._names.pop(run.id, None)

    def take_events(self) -> list[Event]:
        out, self._reports = self._reports, []
        return out

    # -- delivery ----------------------------------------------------------------------------
    def _line(self, event: Event) -> str:
        name = self._names.get(event.run_id)
        run = f"run '{name}' " if name else ""
        return f"batchtap {run}{event.kind.value} at step {event.step}: {event.message}"

    def _post(
        self, text: str, facts: dict[str, Any], *, count: int, run_id: str, step: int, always: bool = False
    ) -> str | None:
        """Post one body; None when delivered, else why not (the warning event is queued)."""
        now = time.monotonic()
        if now < self._quiet_until and not always:
            self.dropped += count
            return "left alone after an earlier failure"
        body = json.dumps({"text": text, "batchtap": facts}, allow_nan=False, default=str).encode()
        error = self._send(body)
        if error is None:
            self.delivered += 1
            return None
        self.dropped += count
        self._quiet_until = time.monotonic() + self.cooldown
        self._reports.append(
            Event(
                run_id or self._last_run_id,
                max(step, 0),
                EventKind.WARNING,
                f"webhook {self.shown_url} did not take a post after {self.retries + 1} tries ({error}); "
                f"{count} event(s) not delivered, {self.dropped} so far; next try in {self.cooldown:g} s",
                time.time(),
            )
        )
        return error

    def _send(self, body: bytes) -> str | None:
        """Post ``body`` with retries: None when delivered, else why not (without the URL)."""
        why = ""
        pause = self.backoff
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(pause)
                pause *= 2
            try:
                self._post_once(body)
                return None
            except _Refused as e:
                return str(e)  # the endpoint refuses this body: trying again cannot help
            except urllib.error.HTTPError as e:
                why = f"HTTP {e.code}"  # 5xx, 429: the endpoint may take it next time
            except (urllib.error.URLError, OSError, ValueError) as e:
                reason = getattr(e, "reason", e)
                why = type(reason).__name__ if isinstance(reason, BaseException) else "connection failed"
        return why

    def _post_once(self, body: bytes) -> None:
        """One POST, following 307/308 redirects with the same body; raises on anything but 2xx."""
        url, auth = self._url, self._auth
        for _ in range(_MAX_HOPS + 1):
            headers = {"Content-Type": "application/json"}
            if auth is not None:
                headers["Authorization"] = auth
            request = urllib.request.Request(url, data=body, method="POST", headers=headers)
            try:
                with _OPENER.open(request, timeout=self.timeout) as response:
                    response.read()
                return
            except urllib.error.HTTPError as e:
                code = e.code
                location = e.headers.get("Location") if e.headers is not None else None
                e.close()
                if code in (307, 308) and location:
                    target = urllib.parse.urljoin(url, location)
                    if urllib.parse.urlsplit(target).scheme not in ("http", "https"):
                        raise _Refused(f"HTTP {code} redirect to a non-HTTP URL refused") from None
                    target, target_auth = _split_credentials(target)
                    if urllib.parse.urlsplit(target).netloc != urllib.parse.urlsplit(url).netloc:
                        auth = None  # credentials are for the host they were given for
                    url, auth = target, target_auth or auth
                    continue
                if code in (301, 302, 303):
                    raise _Refused(
                        f"HTTP {code} redirect to {redact_url(urllib.parse.urljoin(url, location or ''))} refused: "
                        "a POST redirected this way arrives as a GET without the alert; fix: give the URL it "
                        "redirects to"
                    ) from None
                if code < 500 and code != 429:
                    raise _Refused(f"HTTP {code}") from None
                raise
        raise _Refused(f"more than {_MAX_HOPS} redirects")


class _Refused(Exception):
    """The endpoint will not take this body however often it is tried."""
