"""Recording into a dashboard over HTTP: the StepWriter (BufferAndDrop) with the dashboard's
recording API (/api/record, server/webapp/routes/record.py) where the database was.

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
import random
import socket
import time
import uuid
from dataclasses import asdict
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx
import numpy as np
from rollout_lens.server.core import textsafe
from rollout_lens.server.core.errors import RunEnded
from rollout_lens.server.exchange import wire
from rollout_lens.server.store.models import RunStatus
from rollout_lens.trainer.recorder.writer import (
    BATCH_STEPS,
    RETRY_MAX_SECONDS,
    BufferAndDrop,
    Pending,
    RunSpec,
    StepWriter,
)

log = logging.getLogger("rollout_lens")

REQUEST_BYTES = 16 * 2**20  # a request's frames, at most (the dashboard's cap is 64 MiB)
# … and what they decode to, within half what a dashboard of the default cap decodes a request
DECODED_BYTES = wire.Budget.of().most // 2
# A dashboard busy with other trainers' steps may take a while to answer a batch; a timeout
# retries it, and a retry of steps it wrote meanwhile is answered at once (`steps=`).
TIMEOUT = httpx.Timeout(120.0, connect=5.0)


class DashboardAway(Exception):
    """The dashboard cannot take the steps now (retried with the writer's backoff, or after
    the Retry-After a busy dashboard asks for)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class OutOfTime(DashboardAway):
    """close's timeout has run out: nothing more is sent but the run's end (_finish_late)."""


class DashboardRefused(Exception):
    """The dashboard will not take them at all (a wrong token, a run that is gone)."""


class RemoteStepWriter(StepWriter):
    """A user's script recording into the dashboard at `url` (see the module docstring)."""

    AWAY = "the dashboard"
    FINAL_SECONDS = 5.0  # the run's end, sent once more when close's timeout ran out

    def __init__(
        self,
        *,
        url: str,
        token: str | None,
        spec: RunSpec,
        prepare: Any,
        max_bytes: int = 256 * 2**20,
        heartbeat_seconds: float = 5.0,
        request_bytes: int = REQUEST_BYTES,
        key: str | None = None,
        resume_step: int | None = None,
    ) -> None:
        # set before the base class starts the writer thread
        self.url = url.rstrip("/")
        self.token = token or None
        self.key = key or uuid.uuid4().hex
        self.resume_step = resume_step  # the checkpoint's step: the key's run continues
        self.epoch: int | None = None  # the run's record epoch, as the create answered
        self.request_bytes = request_bytes
        self._http: httpx.Client | None = None
        self._acked = np.zeros(0, dtype=np.int64)  # token ids whose pieces the dashboard has
        self._promised = self._acked  # … or will have from a frame already coded
        self._frames: dict[int, wire.Encoded] = {}  # id(pending) → its coded frame
        self._drops_seen = (0, 0)
        self._refusals = 0
        self.sent_bytes = 0  # request bodies of steps the dashboard took
        self.busy_answers = 0  # 503s with Retry-After: the dashboard asked to wait
        self._final_call = False  # the run's end after close's timeout: FINAL_SECONDS
        super().__init__(
            policy=BufferAndDrop(max_bytes=max_bytes),
            database_url=self.url,
            spec=spec,
            prepare=prepare,
            heartbeat_seconds=heartbeat_seconds,
        )

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
        the run's end after it FINAL_SECONDS; otherwise TIMEOUT (None: the client's)."""
        if self._final_call:
            return httpx.Timeout(self.FINAL_SECONDS)
        if not self._closing or self._deadline is None:
            return None
        left = self._deadline - time.monotonic()
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
            raise DashboardAway(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code in (408, 429) or response.status_code >= 500:
            raise DashboardAway(
                f"HTTP {response.status_code}: {_detail(response)}", _retry_after(response)
            )
        ended = _ended(response, self.run_id)
        if ended is not None:  # cancelled, finished, or superseded by a resumed trainer
            raise ended
        if response.status_code in (401, 403, 404):
            raise DashboardRefused(f"HTTP {response.status_code}: {_detail(response)}")
        return response

    # -- the writer's steps, over HTTP -----------------------------------------------------------

    def _flush(self) -> bool:
        try:
            if self.run_id is None:
                self._create_remote_run()
            while self._buffer:
                self._send_batch()
            self._report_remote_drops()
        except OutOfTime:
            return False  # the writer's loop drops what waits and ends the run (_out_of_time)
        except DashboardAway as exc:
            if exc.retry_after is not None and self._down_since is None:
                # busy, not away: send again when it says (±50%, so trainers spread out)
                wait = min(exc.retry_after, RETRY_MAX_SECONDS) * random.uniform(0.5, 1.5)
                self._retry_at = time.monotonic() + wait
                self.busy_answers += 1
                return False
            self._went_down(exc)
            return False
        except RunEnded as exc:
            self._run_ended(exc)
            return False
        except DashboardRefused as exc:
            self._fail(exc)
            return False
        except Exception as exc:  # noqa: BLE001 - recording stops, training goes on
            self._fail(exc)
            return False
        self._came_back()
        return True

    def _create_remote_run(self) -> None:
        spec = self.spec
        assert spec is not None
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

    def _frame(self, pending: Pending) -> wire.Encoded:
        encoded = self._frames.get(id(pending))
        if encoded is None:
            encoded = wire.encode_step(pending.record, self.control_tokens, self._promised)
            self._promised = np.union1d(self._promised, encoded.new_ids)
            self._frames[id(pending)] = encoded
        return encoded

    def _forget_frames(self) -> None:
        """A step left the buffer unsent (dropped): frames coded after it may count on pieces
        it carried, so every waiting frame is coded again."""
        self._frames.clear()
        self._promised = self._acked

    def _send_batch(self, most: int = BATCH_STEPS) -> None:
        with self._wake:
            waiting = list(self._buffer)[:most]
        batch: list[Pending] = []
        frames: list[wire.Encoded] = []
        size = tokens = decoded = 0
        for pending in waiting:
            encoded = self._frame(pending)
            if batch and (
                size + len(encoded.frame) > self.request_bytes
                or tokens + encoded.tokens > wire.MAX_REQUEST_TOKENS
                or decoded + encoded.decoded > DECODED_BYTES
            ):
                break
            batch.append(pending)
            frames.append(encoded)
            size += len(encoded.frame)
            tokens += encoded.tokens
            decoded += encoded.decoded
        drops = self._drop_counts()
        content = wire.body(f.frame for f in frames)
        response = self._post(
            f"/api/record/runs/{self.run_id}/steps",
            content=content,
            headers={"content-type": wire.CONTENT_TYPE},
            params={
                "dropped_steps": drops[0],
                "dropped_rollouts": drops[1],
                "steps": ",".join(str(p.record.step) for p in batch),
                **self._epoch(),
            },
        )
        if response.status_code == 200:
            answer = response.json()
            self.sent_bytes += len(content)
            self._drops_seen = drops
            for f in frames:
                self._acked = np.union1d(self._acked, f.new_ids)
            for pending in batch:
                self._frames.pop(id(pending), None)
            self._written(batch, counted=False)
            self.written_steps += len(answer.get("written", ()))
            return
        if 400 <= response.status_code < 500 and len(batch) > 1:
            self._send_batch(most=1)  # find the step at fault; the others go on next call
            return
        if 400 <= response.status_code < 500:
            self._refuse(batch[0], _detail(response))  # e.g. a step before the run's last
            return
        raise DashboardRefused(f"HTTP {response.status_code}: {_detail(response)}")

    def _epoch(self) -> dict[str, int]:
        return {} if self.epoch is None else {"epoch": self.epoch}

    def _refuse(self, pending: Pending, why: str) -> None:
        self.dropped_steps += 1
        self._refusals += 1
        if self._refusals == 1:
            log.warning(
                "Rollout Lens: the dashboard refused step %d (dropped; later refusals are only "
                "counted on the run): %s",
                pending.record.step,
                why,
            )
        self._leave([pending])
        self._forget_frames()

    def _enforce_budget(self) -> None:
        before = (self.dropped_steps, self.dropped_rollouts)
        super()._enforce_budget()
        if (self.dropped_steps, self.dropped_rollouts) != before:
            self._forget_frames()

    def _drop_counts(self) -> tuple[int, int]:
        return self.dropped_steps, self.dropped_rollouts

    def _report_remote_drops(self) -> None:
        drops = self._drop_counts()
        if drops == self._drops_seen or self.run_id is None:
            return
        self._post(
            f"/api/record/runs/{self.run_id}/heartbeat",
            json={"dropped_steps": drops[0], "dropped_rollouts": drops[1]},
            params=self._epoch(),
        )
        self._drops_seen = drops

    def _heartbeat(self) -> None:
        if self.run_id is None:
            return
        try:
            self._post(f"/api/record/runs/{self.run_id}/heartbeat", json={}, params=self._epoch())
        except RunEnded as exc:  # heard between slow steps too
            self._run_ended(exc)
        except OutOfTime:
            pass
        except (DashboardAway, DashboardRefused) as exc:
            self._went_down(exc)

    def _finish(self) -> None:
        if self._final is None or self.run_id is None:
            return
        status, error = self._final
        drops = self._drop_counts()
        self._final_call = True  # within FINAL_SECONDS, close's deadline past or not
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
        except (DashboardAway, DashboardRefused) as exc:
            log.warning("Rollout Lens: could not mark run %s finished: %s", self.run_id, exc)

    def _finish_late(self) -> None:
        """close's timeout ran out with steps waiting (dropped and counted): the run's end,
        with those counts, is sent once more, within FINAL_SECONDS, so that the run ends as
        close says rather than stay `running` (if this fails too, the dashboard marks it lost
        once its heartbeats stop)."""
        self._finish()

    def _dispose(self) -> None:
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
