"""A BatchDecoder (engine.batch) on a thread of its own, which the daemon hands requests to:
jobs queue (FIFO) until a slot is free, then ride every step until they end, and hear back
through their callbacks on the runner's thread."""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine.batch import BatchDecoder, report
from engine.tokens import GenerationResult, SamplingParams

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """A request handed to a BatchRunner, and how it reports back (called on the runner's thread)."""
    prompt: list[int]
    params: SamplingParams
    on_text: Callable[[str], None] | None = None
    should_stop: Callable[[], bool] | None = None    # true: the caller is gone (queued: dropped unread)
    on_start: Callable[[], None] | None = None        # it got a slot
    on_done: Callable[[GenerationResult], None] | None = None
    on_error: Callable[[BaseException], None] | None = None   # the step failed, or admission refused it


class BatchRunner:
    """A BatchDecoder on a thread of its own: jobs queue (FIFO) until a slot is free, then
    ride every step until they end. admit(job) may raise to refuse a job when its turn
    comes (e.g. the fleet is down); lock, when given, is held during each step."""

    def __init__(self, batch: BatchDecoder, lock=None, admit: Callable[[Job], None] | None = None,
                 name: str = "duck-batch"):
        self.batch, self.lock, self.admit = batch, lock, admit
        self.waiting: deque[Job] = deque()
        self._jobs: dict[int, Job] = {}             # id(sequence) -> its job
        self._wake = threading.Condition()
        self._stop = False
        self.failures = 0
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._wake:
            self.waiting.append(job)
            self._wake.notify()

    @property
    def running(self) -> int:
        return len(self.batch.active)

    @property
    def free_slots(self) -> int:
        """Slots the next step gives to waiting jobs (read from another thread: an estimate)."""
        return len(self.batch.free)

    def close(self, timeout: float = 10.0) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout)

    def _take(self) -> list[Job]:
        """Waits for work; returns the jobs that get a slot now (and drops abandoned ones)."""
        with self._wake:
            while not self._stop and not self.waiting and not self.batch.active:
                self._wake.wait()
            taken = []
            while self.waiting and len(taken) < len(self.batch.free):
                taken.append(self.waiting.popleft())
            return taken

    def _main(self) -> None:
        while True:
            taken = self._take()
            if self._stop:
                break
            for job in taken:
                self._start(job)
            if self.batch.active:
                self._step()
        for job in list(self.waiting) + list(self._jobs.values()):
            report(job.on_error, RuntimeError("the batch runner stopped"))

    def _start(self, job: Job) -> None:
        if job.should_stop is not None and job.should_stop():
            return                                   # the caller left while it waited: no prefill
        try:
            if self.admit is not None:
                self.admit(job)
            seq = self.batch.add(job.prompt, job.params, job.on_text, job.should_stop)
        except BaseException as e:  # noqa: BLE001 - the job's caller gets it
            report(job.on_error, e)
            return
        self._jobs[id(seq)] = job
        report(job.on_start)

    def _step(self) -> None:
        try:
            if self.lock is not None:
                with self.lock:
                    finished = self.batch.step()
            else:
                finished = self.batch.step()
        except BaseException as e:  # noqa: BLE001 - every sequence of the step fails with it
            self.failures += 1
            log.warning("a batch step failed (%s): %d sequences end with the error", e, len(self.batch.active))
            for seq in self.batch.fail_all():
                job = self._jobs.pop(id(seq), None)
                if job is not None:
                    report(job.on_error, e)
            return
        for seq in finished:
            job = self._jobs.pop(id(seq), None)
            if job is not None:
                report(job.on_done, seq.result)
