"""Which unknown chunks a request need not wait for: the short tail of a request that continues a held prefix.

A conversation's next turn arrives with its history held (by vLLM's GPU or CPU tier, or known to this tier)
and a short new tail no node has computed. Waiting for the probe to ask the bucket about that tail holds the
whole request for at least one engine step, where vLLM's fs tier answers "no file" at once: on one node with
S3 (`kvstore bench multiturn --conversations 16`), holding each new turn for the bucket's 404 cost a fifth of
the throughput. So the last ``tail_tokens`` of such a request are answered as misses at once: the worst case
is recomputing them, when another node served the previous turn and the bucket has it. The probe still asks
about them in the background, so a request held anyway (its history is being promoted) finds them when vLLM
looks again.

A chunk is answered at once only when every chunk before it is held and nobody has asked about it yet: it is
not the request's first chunk (vLLM asks the tier from the first chunk it does not hold), no earlier chunk of
the request was answered RETRY in this step, and the probe is not already asking about it. A new node with
the whole history in the bucket therefore waits for the probe as before, also in the steps where its answers
have come back for the beginning but not yet for the tail.
"""

from __future__ import annotations

from typing import Any

# A request's full-chunk length is read from the positions vLLM records for its keys (vLLM 0.33's
# `ReqContext._offload_key_positions`); where that is missing, nothing is answered at once.
_POSITIONS_ATTR = "_offload_key_positions"
_MAX_REQUESTS = 100_000  # request lengths remembered; vLLM reports every finished request, this is a backstop


class UnheldTail:
    """Per scheduler step: which of a request's unknown chunks are a short tail after a held beginning."""

    def __init__(self, tail_tokens: int, chunk_tokens: int) -> None:
        self._tail_tokens = tail_tokens if chunk_tokens else 0
        self._chunk_tokens = chunk_tokens
        self._retried: dict[str, int] = {}  # request -> first position answered RETRY in this step
        self._lengths: dict[str, tuple[int, int]] = {}  # request -> (keys recorded, end of its last chunk)

    def answer_at_once(self, request: Any, position: int | None, *, probed: bool) -> bool:
        """Whether the unknown chunk ending at ``position`` of ``request`` (vLLM's ReqContext) is a miss now;
        False means the caller answers RETRY, which this records for the rest of the step. A chunk the probe
        is already asking about (``probed``) is waited for: the request waits for its beginning's answers as
        they come in (a new node fetching the whole request), and must not stop at the first one not back."""
        if not self._tail_tokens:
            return False
        req_id: str = request.req_id
        retried = self._retried.get(req_id)
        held_before = retried is None or (position is not None and retried > position)
        if not probed and held_before and position is not None and position > self._chunk_tokens:
            end = self._request_end(request)
            if end is not None and position > end - self._tail_tokens:
                return True
        at = -1 if position is None else position
        self._retried[req_id] = at if retried is None else min(retried, at)
        return False

    def waiting_in_step(self, req_id: str) -> bool:
        """Whether a chunk of the request was answered RETRY in this step already. Then another chunk the
        probe is asking about is RETRY too, and recording it changes nothing that `answer_at_once` decides
        later in the step: vLLM looks a group's chunks up in one direction (forward, or backward for sliding
        windows), so the chunks after it in that order are all beyond, or all before, what is recorded."""
        return req_id in self._retried

    def end_of_step(self) -> None:
        """vLLM looks a deferred request up again from its beginning in the next step."""
        self._retried.clear()

    def forget(self, req_id: str) -> None:
        self._lengths.pop(req_id, None)

    def _request_end(self, request: Any) -> int | None:
        positions = getattr(request, _POSITIONS_ATTR, None)
        if not isinstance(positions, dict) or not positions:
            return None
        known = self._lengths.get(request.req_id)
        if known is not None and known[0] == len(positions):
            return known[1]
        if len(self._lengths) >= _MAX_REQUESTS:
            self._lengths.clear()
        end = int(max(positions.values()))
        self._lengths[request.req_id] = (len(positions), end)
        return end
