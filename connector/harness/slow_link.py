"""A bucket across a network, for benchmarks: a TCP proxy on loopback that delays every byte by half a round
trip each way and lets each connection carry at most a given rate.

A local S3 server answers in well under a millisecond and streams at memory speed, so what a node pays for
each round trip to a real bucket (milliseconds within a region, tens across regions) and for a body that
arrives at one connection's rate (S3 serves a GET at about 100 MB/s) never shows here. Put this between a
client and the server and those costs are back, for every method of a benchmark alike; the server's own
request counters still count what crossed it.

The proxy is a process of its own (`SlowLink` starts it), so its CPU is not counted as the benchmark's: it
stands for the network. On a machine of few cores it still takes cores the engines would have, a cost only
the methods that cross it carry (a real network's is the NIC's).

One asyncio loop; each connection gets an upstream connection of its own and a pump per direction that reads
what comes, stamps it with the time it may be delivered (now plus half the round trip, and no sooner than the
connection's rate allows after the bytes before it), and writes it out then.
"""

from __future__ import annotations

import asyncio
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

__all__ = ["LinkShape", "SlowLink"]

_READ = 64 << 10
_IN_FLIGHT = 256  # pieces read ahead per direction before reading waits (16 MiB at most)
_START_S = 30.0


@dataclass(frozen=True)
class LinkShape:
    """A link's round trip and each connection's rate (``inf``: no limit)."""

    rtt_s: float
    bytes_per_s: float = float("inf")

    def __post_init__(self) -> None:
        if not 0 <= self.rtt_s < 10 or not self.bytes_per_s > 0:
            raise ValueError(f"a link needs a round trip in [0, 10) s and a rate > 0, not {self!r}")

    def __str__(self) -> str:
        rate = "" if self.bytes_per_s == float("inf") else f", {self.bytes_per_s / 1e6:g} MB/s per connection"
        return f"{self.rtt_s * 1000:g} ms round trip{rate}"


class SlowLink:
    """A proxy process to ``upstream`` (``http://host:port``) on 127.0.0.1 shaped as ``shape``, at
    ``endpoint`` once started; stopped by `close` (or the end of a ``with`` block)."""

    def __init__(self, upstream: str, shape: LinkShape) -> None:
        _address(upstream)
        self.shape = shape
        self._process = subprocess.Popen(
            [sys.executable, "-m", __name__, upstream, repr(shape.rtt_s), repr(shape.bytes_per_s)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            self.endpoint = f"http://127.0.0.1:{self._port()}"
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        """The proxy's process (its CPU is the link's, not the benchmark's)."""
        return self._process.pid

    def _port(self) -> int:
        """The port the proxy says it listens on (its first line), waited for at most `_START_S`."""
        assert self._process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self._process.stdout, selectors.EVENT_READ)
            if not selector.select(_START_S):
                raise RuntimeError(f"the slow link did not start in {_START_S:.0f} s")
        line = self._process.stdout.readline()
        if not line.strip().isdigit():
            raise RuntimeError(f"the slow link did not start (exit code {self._process.poll()})")
        return int(line)

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> SlowLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _address(upstream: str) -> tuple[str, int]:
    where = urlsplit(upstream)
    if where.scheme != "http" or where.hostname is None or where.port is None:
        raise ValueError(f"a link goes to http://host:port, not {upstream!r}")
    return where.hostname, where.port


class _Proxy:
    def __init__(self, upstream: tuple[str, int], shape: LinkShape) -> None:
        self._upstream = upstream
        self._delay = shape.rtt_s / 2
        self._rate = shape.bytes_per_s

    async def serve(self) -> None:
        server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        async with server:
            await server.serve_forever()

    async def _connection(self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter) -> None:
        try:
            server_in, server_out = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_out.close()
            return
        pumps = [
            asyncio.ensure_future(self._pump(client_in, server_out)),
            asyncio.ensure_future(self._pump(server_in, client_out)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (client_out, server_out):
                writer.close()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        """Bytes from ``source`` to ``sink``, each piece delivered at its time; returns at end of stream."""
        pieces: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_IN_FLIGHT)
        deliver = asyncio.ensure_future(self._deliver(pieces, sink))
        free_at = 0.0  # when the bytes read so far have all gone through at the link's rate
        try:
            while data := await source.read(_READ):
                free_at = max(time.monotonic() + self._delay, free_at) + len(data) / self._rate
                await pieces.put((free_at, data))
            await pieces.put((0.0, b""))
            await deliver
        except (ConnectionError, OSError):  # the source failed: the connection ends
            return
        finally:
            deliver.cancel()

    @staticmethod
    async def _deliver(pieces: asyncio.Queue[tuple[float, bytes]], sink: asyncio.StreamWriter) -> None:
        """Write each piece at its time until the end; once the sink fails, the rest is read and dropped (the
        other direction's end closes the connection)."""
        broken = False
        while True:
            due, data = await pieces.get()
            if not data:
                return
            if broken:
                continue
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            try:
                sink.write(data)
                await sink.drain()
            except (ConnectionError, OSError):
                broken = True


def main(argv: list[str]) -> None:
    proxy = _Proxy(_address(argv[0]), LinkShape(float(argv[1]), float(argv[2])))
    asyncio.run(proxy.serve())  # until SIGTERM


if __name__ == "__main__":
    main(sys.argv[1:])
