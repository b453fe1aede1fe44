"""A small thread-safe least-recently-used map (parsed statements, prepared plans), bounded in
entries and, optionally, in bytes: a parse tree costs ~1 kB per node (measured with tracemalloc),
so 1,024 entries of 256 kB statements would hold tens of gigabytes; weighed entries keep a cache
of large statements within ``max_bytes`` (an entry heavier than that alone is not kept at all)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    def __init__(self, size: int, max_bytes: int | None = None) -> None:
        self._size = size
        self._max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[K, V] = OrderedDict()
        self._weights: dict[K, int] = {}
        #: The weights of the entries held now.
        self.nbytes = 0

    def get(self, key: K) -> V | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: K, value: V, weight: int = 0) -> V:
        """Keep ``value`` (``weight``: the bytes it holds); the least recently used go beyond the bounds."""
        with self._lock:
            if self._max_bytes is not None and weight > self._max_bytes:
                self._drop(key)
                return value
            self._drop(key)
            self._items[key] = value
            if weight:
                self._weights[key] = weight
                self.nbytes += weight
            while len(self._items) > self._size or (self._max_bytes is not None and self.nbytes > self._max_bytes):
                self._drop(next(iter(self._items)))
        return value

    def _drop(self, key: K) -> None:
        if self._items.pop(key, None) is not None:
            self.nbytes -= self._weights.pop(key, 0)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weights.clear()
            self.nbytes = 0
