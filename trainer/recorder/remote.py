"""Recording into a dashboard over HTTP: the StepWriter (BufferAndDrop) with an HttpSink, the
dashboard's recording API (/api/record, server/webapp/routes/record.py), where the database is.

Everything else is the local writer's: `put` never blocks and never raises, steps wait in the
same byte budget while the dashboard is away (a restart, a network cut, a 503 or 429 under
load), the oldest lose their rollouts first and then go, and the backlog is sent in order when
the dashboard is back. Each step travels as a frame of server.exchange.wire, coded once on this
thread (not the training thread) and kept until the dashboard has it; a request carries up to
BATCH_STEPS frames within the request's byte cap. The run is created under a key of its own,
so a create retried after a lost answer finds the run it made, and steps carry their step
number: a retry after a lost answer is answered `already` and not written twice.

A trainer resumed from a checkpoint passes the key it saved and the checkpoint's step
(`resume_step`): the dashboard continues that run, and answers the record epoch its steps
carry. Only 408, 429, 5xx and network errors are retried; a step the dashboard refuses with another
4xx is dropped alone and counted (the run's notes say why); 401, 403 and 404 (a run deleted
from the dashboard) stop the recording, never the training. A run that has ended, or whose
resumed trainer superseded this one, answers 409 with its `status`
(server/webapp/routes/record.py): recording stops there, and a `cancelled` one sets
`stop_requested` (the callback stops training).

`close(timeout)` sends what waits until `timeout` has run out (a request sent while closing
waits at most until then); steps still waiting are dropped and counted on the run, and the
run's end is sent once more within FINAL_SECONDS, so that a run whose dashboard was busy or
slow at the end ends `completed` (or as close says) with its drops counted rather than stay
`running`. A request already under way when close is called keeps its own TIMEOUT.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
import numpy as np
from rollout_lens.server.core import textsafe
from rollout_lens.server.core.errors import RunEnded
from rollout_lens.server.core.records import StepRecord
from rollout_lens.server.exchange import wire
from rollout_lens.server.store.models import RunStatus
from rollout_lens.trainer.recorder.sinks import Drops
from rollout_lens.trainer.recorder.writer import (
    BufferAndDrop,
    OutOfTime,
    RunSpec,
    SinkAway,
    StepWriter,
    Wrote,
    lighten_record,
)

log = logging.getLogger("rollout_lens")

REQUEST_BYTES = 16 * 2**20  # a request's frames, at most (the dashboard's cap is 64 MiB)
# … and what they decode to, within half what a dashboard of the default cap decodes a request
DECODED_BYTES = wire.Budget.of().most // 2
# A dashboard busy with other trainers' steps may take a while to answer a batch; a timeout
# retries it, and a retry of steps it wrote meanwhile is answered at once (`steps=`).
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


class DashboardRefused(Exception):
    """The dashboard will not take them at all (a wrong token, a run that is gone)."""


class RemoteStepWriter(StepWriter):
    """A user's script recording into the dashboard at `url` (see the module docstring): the
    StepWriter with an HttpSink."""

    def __init__(
        self,
        *,
        url: str,
        token: str | None,
        spec: RunSpec,
        prepare: Any,
        lighten: Any = lighten_record,
        max_bytes: int = 256 * 2**20,
        heartbeat_seconds: float = 5.0,
        request_bytes: int = REQUEST_BYTES,
        key: str | None = None,
        resume_step: int | None = None,
        on_written: Any = None,
    ) -> None:
        self.http = HttpSink(
            url=url,
            token=token,
            spec=spec,
            request_bytes=request_bytes,
            key=key,
            resume_step=resume_step,
        )
        super().__init__(
            self.http,
            policy=BufferAndDrop(max_bytes=max_bytes),
            prepare=prepare,
            lighten=lighten,
            heartbeat_seconds=heartbeat_seconds,
            on_written=on_written,
        )

    @property
    def sent_bytes(self) -> int:
        """Request bodies of steps the dashboard took."""
        return self.http.sent_bytes


class HttpSink:
    """The dashboard at `url`: the run created under a key of its own, steps sent as wire
    frames (coded once, on the writer's thread), within a request's byte cap."""

    away = "the dashboard"
    final_seconds = 5.0  # the run's end, sent once more when close's timeout ran out

    def __init__(
        self,
        *,
        url: str,
        token: str | None,
        spec: RunSpec,
        request_bytes: int = REQUEST_BYTES,
        key: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.token = token or None
        self.spec = spec
        self.control_tokens = list(spec.control_tokens)
        self.key = key or uuid.uuid4().hex
        self.resume_step = resume_step  # the checkpoint's step: the key's run continues
        self.run_id: int | None = None
        self.epoch: int | None = None  # the run's record epoch, as the create answered
        self.request_bytes = request_bytes
        self.deadline: float | None = None
        self.sent_bytes = 0  # request bodies of steps the dashboard took
        self._http: httpx.Client | None = None
        self._acked = np.zeros(0, dtype=np.int64)  # token ids whose pieces the dashboard has
        self._promised = self._acked  # … or will have from a frame already coded
        self._frames: dict[int, wire.Encoded] = {}  # id(record) → its coded frame
        self._drops_seen: Drops = (0, 0)
        self._final_call = False  # the run's end after close's timeout: final_seconds

    # -- HTTP ------------------------------------------------------------------------------------

    def _client(self) -> httpx.Client:
        if self._http is None:
            # the key too: a request about a deleted run is a 404, never another run's
            headers = {"user-agent": "rollout-lens-recorder", "x-record-key": self.key}
            if self.token:
                headers["authorization"] = f"Bearer {self.token}"
            # no cookies kept: sent back, the dashboard's CSRF cookie would make these POSTs a
            # browser's (which need the form's CSRF token)
            jar = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
            self._http = httpx.Client(
                base_url=self.url, headers=headers, timeout=TIMEOUT, cookies=jar
            )
        return self._http

    def _timeout(self) -> httpx.Timeout | None:
        """While closing, a request waits at most until close's deadline (then OutOfTime), and
        the run's end after it final_seconds; otherwise TIMEOUT (None: the client's)."""
        if self._final_call:
            return httpx.Timeout(self.final_seconds)
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise OutOfTime("close's timeout ran out")
        return httpx.Timeout(min(TIMEOUT.read or left, left), connect=min(5.0, left))

    def _post(self, path: str, **kwargs: Any) -> httpx.Response:
        timeout = self._timeout()
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = self._client().post(path, **kwargs)
        except httpx.HTTPError as exc:  # connection refused or cut, a timeout
            raise SinkAway(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code in (408, 429) or response.status_code >= 500:
            raise SinkAway(
                f"HTTP {response.status_code}: {_detail(response)}", _retry_after(response)
            )
        ended = _ended(response, self.run_id)
        if ended is not None:  # cancelled, finished, or superseded by a resumed trainer
            raise ended
        if response.status_code in (401, 403, 404):
            raise DashboardRefused(f"HTTP {response.status_code}: {_detail(response)}")
        return response

    def _epoch(self) -> dict[str, int]:
        return {} if self.epoch is None else {"epoch": self.epoch}

    # -- the sink ----------------------------------------------------------------------------------

    def start(self) -> None:
        pass  # nothing to start: the dashboard is reached at `open`

    def open(self) -> None:
        if self.run_id is not None:
            return
        spec = self.spec
        body = {k: v for k, v in asdict(spec).items() if k not in ("source",) and v is not None} | {
            "key": self.key,
            "worker_host": socket.gethostname(),
        }
        if self.resume_step is not None:
            body["resume_step"] = self.resume_step
        response = self._post(
            "/api/record/runs",
            # text UTF-8 can hold and numbers JSON has: what the dashboard refuses (a lone
            # surrogate, a 422) or stores as null (NaN) is never sent
            content=textsafe.finite_json(textsafe.storable_value(body), default=str),
            headers={"content-type": "application/json"},
        )
        if response.status_code not in (200, 201):
            raise DashboardRefused(f"HTTP {response.status_code}: {_detail(response)}")
        answer = response.json()
        self.run_id = int(answer["id"])
        self.epoch = answer.get("epoch")  # None from a dashboard older than resumes
        log.info("Rollout Lens: recording run %d (%s) at %s", self.run_id, spec.name, self.url)

    def _frame(self, record: StepRecord) -> wire.Encoded:
        encoded = self._frames.get(id(record))
        if encoded is None:
            encoded = wire.encode_step(record, self.control_tokens, self._promised)
            self._promised = np.union1d(self._promised, encoded.new_ids)
            self._frames[id(record)] = encoded
        return encoded

    def forget(self) -> None:
        """A step left the writer unsent (dropped): frames coded after it may count on pieces
        it carried, so every waiting frame is coded again."""
        self._frames.clear()
        self._promised = self._acked

    def _batch(self, records: Sequence[StepRecord]) -> list[wire.Encoded]:
        """The frames of the oldest steps that fit one request (one at least)."""
        frames: list[wire.Encoded] = []
        size = tokens = decoded = 0
        for record in records:
            encoded = self._frame(record)
            if frames and (
                size + len(encoded.frame) > self.request_bytes
                or tokens + encoded.tokens > wire.MAX_REQUEST_TOKENS
                or decoded + encoded.decoded > DECODED_BYTES
            ):
                break
            frames.append(encoded)
            size += len(encoded.frame)
            tokens += encoded.tokens
            decoded += encoded.decoded
        return frames

    def write(self, records: Sequence[StepRecord], drops: Drops) -> Wrote:
        """As many of the steps as one request holds; a step the dashboard refuses (another
        4xx) is found by sending the first alone."""
        frames = self._batch(records)
        batch = records[: len(frames)]
        content = wire.body(f.frame for f in frames)
        response = self._post(
            f"/api/record/runs/{self.run_id}/steps",
            content=content,
            headers={"content-type": wire.CONTENT_TYPE},
            params={
                "dropped_steps": drops[0],
                "dropped_rollouts": drops[1],
                "steps": ",".join(str(r.step) for r in batch),
                **self._epoch(),
            },
        )
        if response.status_code == 200:
            self.sent_bytes += len(content)
            self._drops_seen = drops
            for f in frames:
                self._acked = np.union1d(self._acked, f.new_ids)
            for record in batch:
                self._frames.pop(id(record), None)
            return Wrote(taken=len(batch), written=len(response.json().get("written", ())))
        if 400 <= response.status_code < 500 and len(batch) > 1:
            return self.write(batch[:1], drops)  # find the step at fault; the others go on next
        if 400 <= response.status_code < 500:  # e.g. a step before the run's last
            return Wrote(taken=0, written=0, refused=DashboardRefused(_detail(response)))
        raise DashboardRefused(f"HTTP {response.status_code}: {_detail(response)}")

    def report_drops(self, drops: Drops) -> None:
        if drops == self._drops_seen or self.run_id is None:
            return
        self._post(
            f"/api/record/runs/{self.run_id}/heartbeat",
            json={"dropped_steps": drops[0], "dropped_rollouts": drops[1]},
            params=self._epoch(),
        )
        self._drops_seen = drops

    def heartbeat(self) -> None:
        self._post(f"/api/record/runs/{self.run_id}/heartbeat", json={}, params=self._epoch())

    def finish(self, status: RunStatus, error: str | None, drops: Drops, *, late: bool) -> None:
        """The run's end, within final_seconds whether close's deadline is past or not: after
        it (`late`), with the counts of the steps dropped then, so that the run ends as close
        says rather than stay `running` (if this fails too, the dashboard marks it lost once
        its heartbeats stop)."""
        self._final_call = True
        try:
            self._post(
                f"/api/record/runs/{self.run_id}/finish",
                json={
                    "status": RunStatus(status).value,
                    "error": error,
                    "dropped_steps": drops[0],
                    "dropped_rollouts": drops[1],
                },
                params=self._epoch(),
            )
        except RunEnded as exc:  # cancelled from the dashboard since the last request: it stays
            log.warning("Rollout Lens: %s", exc)
        except (SinkAway, DashboardRefused) as exc:
            log.warning("Rollout Lens: could not mark run %s finished: %s", self.run_id, exc)

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def _ended(response: httpx.Response, run_id: int | None) -> RunEnded | None:
    """A 409 that says the run has ended (its JSON has the run's `status`), as RunEnded."""
    if response.status_code != 409 or run_id is None:
        return None
    try:
        answer = response.json()
    except ValueError:
        return None
    status = answer.get("status") if isinstance(answer, dict) else None
    if not isinstance(status, str):
        return None
    by = answer.get("ended_by")
    return RunEnded(
        str(answer.get("detail") or f"run {run_id} is {status}"),
        run_id=run_id,
        status=status,
        ended_by=by if isinstance(by, str) else None,
    )


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


def _detail(response: httpx.Response) -> str:
    try:
        detail = response.json().get("detail")
    except ValueError:
        detail = None
    return str(detail or response.text[:300] or response.reason_phrase)
