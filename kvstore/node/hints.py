"""The hint protocol: what engines tell the node agent, over a Unix datagram socket in the cache directory.

Engines and the agent share the LMDB index and the upload journal; the bytes of a chunk never cross this
socket. What does is small and lossy by design: keys whose object-store hits the agent should admit to NVMe,
keys that were used (LRU order, access records for GC), keys just stored, and the engine's increments of the
node's counters.

Wire format: one msgpack `Hints` per datagram, at most `MAX_DATAGRAM` bytes, split by *bytes* (a key of
non-ASCII characters takes several). The socket lives at ``<cache_dir>/agent.sock``; a cache directory
whose path is too long for a socket address is reached through ``/proc/self/fd`` instead (`SocketAddress`).

Anything on the node that can reach the socket can write to it, so the agent takes nothing on trust
(`screen`): keys it cannot hold are dropped, counters are the names engines publish (`COUNTERS`, a fixed
set: a name per datagram would grow the index without bound), each increment at most `MAX_INCREMENT`.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import msgspec

from kvstore.cache.records import MAX_KEY_BYTES
from kvstore.metrics import TIERS

__all__ = [
    "COUNTERS",
    "FIELDS",
    "MAX_DATAGRAM",
    "MAX_INCREMENT",
    "SOCKET_NAME",
    "Hints",
    "Screened",
    "SocketAddress",
    "counter_name",
    "datagrams",
    "decode",
    "encode",
    "screen",
]

SOCKET_NAME = "agent.sock"
# The kernel queues few datagrams per socket (net.unix.max_dgram_qlen, often 10), so hints go in big ones:
# a busy node's fraction of a second of touches fits in one. Within the default send buffer (208 KiB).
MAX_DATAGRAM = 200_000
# An increment no engine reaches between two publications (a petabyte of reads in two seconds); keeps any
# sum of them far below the index's 64-bit counters.
MAX_INCREMENT = 1 << 50
_SUN_PATH_MAX = 107
# msgpack framing: a str or array header takes at most 5 bytes; the map, its field names and the pid ~40.
_PER_KEY = 5
_ENVELOPE = 64

# The node's counters, as engines name them (`kvstore.engine.node_counters` publishes exactly these).
FIELDS = ("queries", "hits", "read_bytes", "write_bytes", "checksum_failures")
_OTHER_COUNTERS = ("stores_dropped", "nvme_evictions")


def counter_name(tier: str, field: str) -> str:
    return f"{tier}.{field}"


COUNTERS = frozenset([counter_name(t, f) for t in TIERS for f in FIELDS] + list(_OTHER_COUNTERS))


class Hints(msgspec.Struct, omit_defaults=True, frozen=True):
    """One datagram from an engine. ``touched``: chunks loaded or used (LRU order, access records);
    ``stored``: chunks just stored (access records, and the uploads have work); ``counters``: increments of
    the node's counters. (Releases before 0.2 also sent ``fetched``, object hits for the agent to fetch again
    and admit; engines now admit them from the bytes they loaded, and the field is ignored.)"""

    pid: int
    touched: list[str] = []
    stored: list[str] = []
    counters: dict[str, int] = {}


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Hints)


def decode(datagram: bytes) -> Hints | None:
    """A datagram's hints, or None if it is not one (anything may write to a socket: msgpack nested
    deeper than the decoder recurses is a RecursionError, not a DecodeError)."""
    try:
        return _decoder.decode(datagram)
    except (msgspec.DecodeError, RecursionError):
        return None


def datagrams(
    pid: int,
    touched: Sequence[str],
    stored: Sequence[str],
    counters: Mapping[str, int],
    *,
    limit: int = MAX_DATAGRAM,
) -> tuple[list[Hints], int]:
    """The hints as few datagrams as hold them, each at most ``limit`` bytes encoded: each carries as many
    keys of one kind as fit, counted in encoded bytes (not characters). Also returns how many keys fit in
    none (too long for any key the index holds, or not encodable): the caller counts them dropped."""
    out: list[Hints] = []
    if counters:
        out.append(Hints(pid, counters=dict(counters)))
    too_long = 0
    for kind, keys in enumerate((touched, stored)):
        for batch, skipped in _batches(keys, limit - _ENVELOPE):
            too_long += skipped
            if batch:
                lists: list[list[str]] = [[], []]
                lists[kind] = batch
                out.append(Hints(pid, touched=lists[0], stored=lists[1]))
    return out, too_long


def encode(hints: Hints) -> bytes:
    return _encoder.encode(hints)


def _batches(keys: Sequence[str], room: int) -> Iterator[tuple[list[str], int]]:
    batch: list[str] = []
    size = skipped = 0
    for key in keys:
        try:
            cost = len(key.encode()) + _PER_KEY
        except UnicodeEncodeError:  # a lone surrogate: msgpack cannot carry it, no index could hold it
            cost = room + 1
        if cost > room:
            skipped += 1
            continue
        if size + cost > room:
            yield batch, skipped
            batch, size, skipped = [], 0, 0
        batch.append(key)
        size += cost
    yield batch, skipped


@dataclass(frozen=True)
class Screened:
    """What the agent takes from a datagram, and whether anything in it was refused."""

    hints: Hints
    refused: bool


def screen(hints: Hints) -> Screened:
    """Keys the index can hold and known counters with bounded increments; the rest is refused."""
    touched, stored = (_usable(keys) for keys in (hints.touched, hints.stored))
    counters = {
        name: delta
        for name, delta in hints.counters.items()
        if name in COUNTERS and 0 < delta <= MAX_INCREMENT
    }
    kept = len(touched) + len(stored) + len(counters)
    sent = len(hints.touched) + len(hints.stored) + len(hints.counters)
    if kept == sent:
        return Screened(hints, False)
    return Screened(Hints(hints.pid, touched, stored, counters), True)


def _usable(keys: list[str]) -> list[str]:
    return [key for key in keys if key and _fits(key)]


def _fits(key: str) -> bool:
    try:
        return len(key.encode()) <= MAX_KEY_BYTES
    except UnicodeEncodeError:  # a lone surrogate: no file or index entry can be named by it
        return False


class SocketAddress:
    """``<cache_dir>/agent.sock`` as a socket address, short enough for the kernel whatever the path."""

    def __init__(self, cache_dir: str | os.PathLike[str]) -> None:
        self.path = os.path.join(os.fspath(cache_dir), SOCKET_NAME)
        self._dir_fd: int | None = None
        self.address = self.path
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            self._dir_fd = os.open(os.path.dirname(self.path), os.O_PATH | os.O_DIRECTORY)
            self.address = f"/proc/self/fd/{self._dir_fd}/{SOCKET_NAME}"

    def send(self, sock: socket.socket, payload: bytes) -> None:
        sock.sendto(payload, self.address)

    def bind(self, sock: socket.socket) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a dead agent's socket (the caller holds the agent lock)
        sock.bind(self.address)

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None
