"""Stored responses for GET /v1/responses/{id} and previous_response_id: a bounded LRU in memory
(--max-stored-responses), so a long-running server's memory stays flat; the oldest unused goes first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class StoredResponse:
    response: dict  # the Response object as it was returned
    messages: list[dict]  # the conversation up to and including this response, as chat messages


class ResponseStore:
    def __init__(self, max_size: int) -> None:
        if not isinstance(max_size, int) or max_size < 0:
            raise ValueError(f"max_stored_responses must be an integer >= 0, got {max_size!r}.")
        self.max_size = max_size
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, stored: StoredResponse) -> None:
        if self.max_size == 0:
            return
        with self._lock:
            self._items[response_id] = stored
            self._items.move_to_end(response_id)
            while len(self._items) > self.max_size:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            stored = self._items.get(response_id)
            if stored is not None:
                self._items.move_to_end(response_id)
            return stored

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._items)
