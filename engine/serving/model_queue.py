"""The one owner of a loaded model: every call that touches it runs as a job on one thread, in the order
asked, one job at a time.

Two rules keep it free of deadlocks: a job never waits for another job (it never submits and waits, and
it takes no lock another thread holds while waiting on this queue), and nothing outside takes a lock
around a submit. Callers wait on the job's future, never inside the queue. Each thread that runs torch
on the CPU keeps its own OpenMP thread team, and on a few cores two teams take turns with each other, so
a single thread is also what makes a step cost what the bench measures.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


class ModelQueue:
    """Jobs on the model's one thread, first come first served."""

    def __init__(self, name: str = "model"):
        self.thread_name = name
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._waiting: list[Future] = []  # submitted, not yet started
        self._guard = threading.Lock()  # guards ``_waiting`` only; never held while a job runs

    def submit(self, job: Callable[..., T], *args, **kwargs) -> Future[T]:
        """Queue ``job(*args, **kwargs)``; its future's ``running()`` turns true when it starts."""
        future: Future[T] | None = None

        def started() -> T:
            with self._guard:
                self._waiting.remove(future)
            return job(*args, **kwargs)

        with self._guard:  # ``started`` waits for the guard, so the job is listed before it can unlist itself
            future = self._executor.submit(started)
            self._waiting.append(future)
        return future

    def ahead_of(self, future: Future) -> int:
        """How many queued jobs start before this one (0 once it runs or ends); a job running now is not counted."""
        with self._guard:  # a job the thread has taken may not have unlisted itself yet
            waiting = [job for job in self._waiting if not job.running() and not job.done()]
        return waiting.index(future) if future in waiting else 0

    def cancel(self, future: Future) -> bool:
        """Drop a job that has not started; False if it already runs or ran."""
        with self._guard:
            if future not in self._waiting or not future.cancel():
                return False
            self._waiting.remove(future)
            return True

    def run(self, job: Callable[..., T], *args, **kwargs) -> T:
        """Submit and wait: for callers on other threads (never from inside a job, which would wait on itself)."""
        if threading.current_thread().name.startswith(self.thread_name):
            raise RuntimeError("a model job may not wait for another model job: it would wait on itself")
        return self.submit(job, *args, **kwargs).result()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
