"""Admin test helpers: a router-like subscriber for the KV events GC publishes."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq


class EventSubscriber:
    """A SUB socket bound on a free loopback port, receiving on its own thread like a router does (a ZMQ
    socket completes its handshake, and so sends its subscription, only while its owner calls into ZMQ).
    Batches are decoded with vLLM's own `KVEventBatch` decoder."""

    def __init__(self) -> None:
        kv_events = pytest.importorskip("vllm.distributed.kv_events")
        import msgspec

        self._decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        self._messages: queue.Queue[list[bytes]] = queue.Queue()
        self._sock = zmq.Context.instance().socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                self._messages.put(self._sock.recv_multipart())

    def next(self) -> tuple[int, Any]:
        """The next batch: (sequence number, decoded `KVEventBatch`)."""
        _, seq, payload = self._messages.get(timeout=30)  # bounds a broken run only; never a timing check
        return int.from_bytes(seq, "big"), self._decoder.decode(payload)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close(linger=0)


@pytest.fixture
def kv_subscriber() -> Iterator[EventSubscriber]:
    subscriber = EventSubscriber()
    yield subscriber
    subscriber.close()
