"""The admission order of the waiting and swapped queues: FCFS (a deque) or priority (a heap).

``fcfs`` serves requests in arrival order; a preempted request goes back to the head, before
newcomers (`prepend`). ``priority`` serves the lowest ``priority`` value first, then the earliest
arrival (vLLM's order); a preempted request goes before the requests of equal key. Both queues
take `remove` from the middle (an abort, a finished sibling); it is O(n) and rare.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from pagedkv.scheduler.request import Request


class FCFSQueue:
    """Requests in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, req: Request) -> None:
        self._queue.append(req)

    def prepend(self, req: Request) -> None:
        """Put a preempted request at the head."""
        self._queue.appendleft(req)

    def peek(self) -> Request:
        """The next request to serve. Raises IndexError when empty."""
        return self._queue[0]

    def remove(self, req: Request) -> None:
        """Take ``req`` out. Raises ValueError when it is not queued."""
        self._queue.remove(req)

    def __contains__(self, req: Request) -> bool:
        return req in self._queue

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue:
    """Requests by (priority, arrival time); a heap of (priority, arrival, tie, request)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._after = itertools.count()  # ties among equal keys: later adds go after
        self._before = itertools.count(-1, -1)  # and prepends before

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._after), req))

    def prepend(self, req: Request) -> None:
        """Put a preempted request before the requests of equal priority and arrival."""
        heapq.heappush(self._heap, (req.priority, req.arrival_time, next(self._before), req))

    def peek(self) -> Request:
        """The next request to serve. Raises IndexError when empty."""
        return self._heap[0][3]

    def remove(self, req: Request) -> None:
        """Take ``req`` out. Raises ValueError when it is not queued."""
        at = next((i for i, e in enumerate(self._heap) if e[3] is req), None)
        if at is None:
            raise ValueError(f"{req.request_id} is not queued")
        self._heap[at] = self._heap[-1]
        self._heap.pop()
        heapq.heapify(self._heap)

    def __contains__(self, req: Request) -> bool:
        return any(e[3] is req for e in self._heap)

    def __iter__(self) -> Iterator[Request]:
        """In service order."""
        return (e[3] for e in sorted(self._heap, key=lambda e: e[:3]))

    def __len__(self) -> int:
        return len(self._heap)


def make_queue(scheduling_policy: str) -> FCFSQueue | PriorityQueue:
    """An empty queue for ``fcfs`` or ``priority``. Raises ValueError for another policy."""
    if scheduling_policy == "fcfs":
        return FCFSQueue()
    if scheduling_policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {scheduling_policy!r}")
