"""`KVStoreTier`: a vLLM secondary tier that reads through the node's NVMe cache and the shared object store.

vLLM's `TieringOffloadingSpec` builds it from a `secondary_tiers` entry::

    {"type": "KVStoreTier", "module_path": "kvstore.connector.tier",
     "store_url": "s3://kv-cache/prod", "cache_dir": "/mnt/nvme/kv", "cache_bytes": 2000000000000}

It is a thin adapter: every byte moves through `kvstore.engine.TieredStore`. Contract with vLLM (see
`SecondaryTierManager`): every method returns at once. Calls never overlap, but they need not come from one
thread: vLLM 0.32 makes them all from the scheduler thread; 0.33 makes them under its tiering manager's lock,
from the scheduler thread and, through another tier's `ParentManager` fan-out, from its tier-poll thread. So
the tier keeps no per-thread state: what the calls share (the probe batch, the loads in flight, the key memo,
the GIL switch state) changes only inside calls, which that serialisation orders; what the tier's own threads
share with the calls is a deque, a queue or the engine, all safe from any thread. It does not ask to be polled
off-thread (`tolerates_off_thread_polling`): it serves no counterpart between steps.

Loads and stores run on the tier's job threads; each job is reported exactly once through
`get_finished_jobs()`, with its bytes and seconds. Nothing raises into vLLM: a failing store or disk becomes a
miss, a failed job and a metric; so does a chunk id outside the primary region. A chunk that fails to load is
marked missing by the engine, so the scheduler does not ask for it again and again. The engine admits the
object hits it fetched and verified to NVMe itself (never a second GET); uploads, eviction, access records
and pin sync are the node agent's (`kvstore.agent`), in a process of its own at idle priority, which the tier
starts when the node has none (option `agent`).

KV events report one residency per chunk, "this instance's tier holds it" (its NVMe copy or the bucket's),
with the tier's `locality` and no ownership, which is what routers index (see `tier_events`). After the
engine (re)started, nothing the engine stores announces a chunk it serves from this tier, so the tier
announces the chunks it served once their request has finished.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from prometheus_client import CollectorRegistry
from typing_extensions import override
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvstore.connector.engine_keys import engine_scheme, publish_namespace
from kvstore.connector.idle_step import step_scheduled_nothing
from kvstore.connector.jobs import JobThreads
from kvstore.connector.probe_order import UnknownChunk, prefix_chains
from kvstore.connector.tier_events import announce_served, to_vllm_events
from kvstore.connector.tier_metrics import BackgroundStats, TierStats, metric_definitions
from kvstore.connector.tier_options import parse_tier_options
from kvstore.connector.unheld_tail import UnheldTail
from kvstore.engine import Presence, TieredStore
from kvstore.engine import timeline as milestones
from kvstore.engine.timeline import Timeline
from kvstore.errors import ConfigError
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace
from kvstore.metrics import EngineMetrics
from kvstore.runtime import Node, open_node

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec

log = logging.getLogger(__name__)

_CHUNK_KEY_MEMO = 262_144
# The lookup's answers, read from module globals rather than through their enums on every call.
_PENDING, _MISS = Presence.PENDING, Presence.MISS
_HIT, _RETRY, _LOOKUP_MISS = LookupResult.HIT, LookupResult.RETRY, LookupResult.MISS


class KVStoreTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE
    # vLLM 0.33: the tier serves no counterpart between engine steps, so the manager's tier-poll thread has
    # nothing to do for it (calls from that thread through another tier's fan-out are still safe, see above).
    tolerates_off_thread_polling: ClassVar[bool] = False

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        opts = parse_tier_options(options, cpu_spec=_is_cpu_spec(offloading_spec))
        settings = opts.settings
        # The most tokens a chunk holds in any KV-cache group (0 where vLLM's spec does not say).
        per_block = getattr(offloading_spec, "tokens_per_block", None) or (0,)
        self._chunk_tokens = max(per_block) * offloading_spec.blocks_per_chunk
        if opts.probe_tail_tokens and not self._chunk_tokens:
            raise ConfigError("KVStoreTier: probe_tail_tokens needs the tokens_per_block of vLLM's spec")
        self.locality = opts.locality
        self._localities = {"nvme": opts.locality, "object": opts.object_locality}
        self._fast_switch = opts.gil_switch_interval_s  # while a request waits on us (see `TierOptions`)
        self._loads_in_flight: set[int] = set()  # job ids; changed only inside vLLM's (serialised) calls
        # With KV events: the chunks each request got from this tier (job id -> request, keys while a load
        # runs; request -> keys until it finishes), then announced again (see the module docstring).
        self._loading: dict[int, tuple[str, Collection[OffloadKey]]] = {}
        self._served: dict[str, list[OffloadKey]] = {}
        self._announce: list[OffloadKey] = []
        self._switched = False
        self._normal_switch = sys.getswitchinterval()

        mapper = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        )
        self.namespace = Namespace.from_fields(mapper.get_run_config(), rank=mapper.rank)

        # A registry of our own: the engine process may not export the global one, and tests run several.
        # The node agent (uploads, admission, eviction, access records, pin sync) runs in a process of its
        # own at idle priority: this one keeps only what a waiting request needs.
        self._node: Node = open_node(
            settings,
            metrics=EngineMetrics(CollectorRegistry()),
            check_store=False,
            element_width=self.namespace.element_width,
            agent=opts.agent,
        )
        self._engine = self._node.engine
        self._engine.expect_chunks(self.block_size_bytes)  # a new node's first loads land in mapped memory
        # vLLM asks about every chunk of a waiting request on every step: bound once, not per call.
        self._lookup_cached = self._engine.lookup_cached
        self._needs_probe = self._engine.needs_probe
        self._timeline = Timeline(opts.timeline_path) if opts.timeline_path else None
        self._engine.trace(self._timeline)
        self._slots = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view
        # Job threads: `job_workers` per kind (default 1), each running what waits in its queue as one batch.
        # More job threads only made them compete for the GIL with each other and with the scheduler thread
        # (four shared: 1.1-1.3 ms per paced step; one per kind: 0.43-0.48 ms); the engine's disk and io
        # threads give the I/O its parallelism.
        # An idle step's wait ends when a job finishes or the probe answers keys: vLLM has news to act on.
        self._news = threading.Event()
        self._jobs = JobThreads(
            self._run_loads,
            self._run_stores,
            workers_per_kind=opts.job_workers,
            batch_chunks=opts.job_batch_chunks,
            on_finished=self._news.set,
        )
        self._engine.wake_on_answers(self._news.set)
        self._idle_wait_s = opts.idle_step_wait_s
        self._unprobed: list[UnknownChunk] = []
        self._tail_tokens = opts.probe_tail_tokens
        self._unheld_tail = UnheldTail(opts.no_wait_tail_tokens, self._chunk_tokens)
        self._tail_not_waited = self._engine.metrics.tail_lookups_not_waited
        self._chunk_keys: dict[bytes, str] = {}  # offload key -> chunk key (inside vLLM's calls only)
        self._stats = BackgroundStats(TierStats(self._engine.metrics), interval_s=opts.stats_interval_s)
        events_on = opts.enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events
        self._events_enabled = events_on
        if events_on and not offloading_spec.kv_events_config.self_describing_kv_events:
            log.warning(
                "KVStoreTier: enable_kv_events without kv_connector_extra_config"
                "['self_describing_kv_events']: vLLM sends the tier's BlockStored without tokens (block_size"
                " 0), which routers such as Dynamo's KV indexer reject; set it to true"
            )
        self._scheme: KeyScheme | None = None  # the engine's, once vLLM has set NONE_HASH
        self._stopping = threading.Event()
        self._store_url = self._node.store.url
        self._codec = settings.codec.name.lower()
        self._cache_bytes = settings.cache_bytes
        self._shut_down = False
        self._publisher = threading.Thread(
            target=self._publish_namespace, name="kvstore-tier-namespace", daemon=True
        )
        self._publisher.start()
        log.info(
            "KVStoreTier ready: namespace %s, store %s, cache %s, GIL switch interval %s",
            self.namespace.id,
            self._node.store.url,
            settings.cache_dir,
            f"{self._fast_switch:g} s while requests wait" if self._fast_switch else "unchanged",
        )

    @property
    def key_scheme(self) -> KeyScheme:
        """How this engine names chunks (vLLM's defaults for this environment until NONE_HASH is set)."""
        if self._scheme is None:
            scheme, from_engine = engine_scheme()
            if not from_engine:
                return scheme
            self._scheme = scheme
        return self._scheme

    @property
    def engine(self) -> TieredStore:
        """The engine this tier drives (benchmarks and tools wait on its upload journal)."""
        return self._engine

    # ------------------------------------------------------------- scheduler

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._timeline is not None:
            self._timeline.begin(req_context.req_id)
        chunk = self._chunk_keys.get(key)
        if chunk is None:  # a waiting request's keys are looked up on every step: name each once
            if len(self._chunk_keys) >= _CHUNK_KEY_MEMO:
                self._chunk_keys.clear()
            chunk = self._chunk_keys[key] = self.namespace.chunk_key(key)
        found = self._lookup_cached(chunk)
        if found is _PENDING:
            probed = not self._needs_probe(chunk)
            if probed and self._unheld_tail.waiting_in_step(req_context.req_id):
                return _RETRY  # the hot case: a request waiting on its probe, looked up again every step
            position = req_context.get_offload_key_position(key)
            # Probed as one batch at the end of the step, per request and group in lookup order.
            if not probed:
                self._unprobed.append(UnknownChunk(req_context.req_id, key[-4:], position, chunk))
            if self._unheld_tail.answer_at_once(req_context, position, probed=probed):
                self._tail_not_waited.inc()
                return _LOOKUP_MISS
            return _RETRY
        if found is _MISS:
            return _LOOKUP_MISS
        if self._timeline is not None:
            self._timeline.mark(milestones.LOOKUP_HIT)
        return _HIT

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._timeline is not None:
            self._timeline.mark(milestones.STEP)
            if self._unprobed:
                self._timeline.mark(milestones.PROBE_SENT)
        self._unheld_tail.end_of_step()
        if self._unprobed:
            batch, self._unprobed = self._unprobed, []
            plan = prefix_chains(batch, chunk_tokens=self._chunk_tokens, tail_tokens=self._tail_tokens)
            self._engine.probe_prefixes(plan.chains, node_only=plan.node_only)
            self._update_switch_interval()
        else:
            self._engine.end_of_step()
        if (
            self._idle_wait_s
            and (self._engine.probes_in_flight or self._jobs.in_flight)
            and step_scheduled_nothing()
        ):
            # vLLM idles until we answer: wait here rather than be asked about every chunk again a moment
            # later. A finished job or new answers end the wait: vLLM goes on with them at once.
            if self._timeline is not None:
                self._timeline.mark(milestones.IDLE_WAIT)
            self._news.wait(self._idle_wait_s)
        self._news.clear()

    @override
    def has_pending_work(self) -> bool:
        return bool(self._unprobed) or self._engine.probes_in_flight > 0 or self._jobs.in_flight > 0

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        # By now vLLM's events tracker has the payloads of what the request loaded (it recorded them when the
        # request's lookups hit the CPU tier), so a BlockStored for them carries their tokens.
        self._unheld_tail.forget(req_context.req_id)
        served = self._served.pop(req_context.req_id, None)
        if served:
            self._announce.extend(served)
        if self._timeline is not None:
            self._timeline.end(req_context.req_id)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._engine.touch([self.namespace.chunk_key(k) for k in keys])

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._jobs.submit("store", job_metadata)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._loads_in_flight.add(job_metadata.job_id)
        if self._timeline is not None:
            self._timeline.mark(milestones.LOAD_SUBMITTED)
        if self._events_enabled:
            self._loading[job_metadata.job_id] = (job_metadata.req_context.req_id, job_metadata.keys)
        self._update_switch_interval()
        self._jobs.submit("load", job_metadata)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        done: list[JobResult] = self._jobs.take_finished()
        if self._loads_in_flight and done:
            if self._timeline is not None and any(r.job_id in self._loads_in_flight for r in done):
                self._timeline.mark(milestones.LOAD_REPORTED)
            self._loads_in_flight.difference_update(result.job_id for result in done)
        if self._loading and done:
            for result in done:
                loading = self._loading.pop(result.job_id, None)
                if loading is None:
                    continue
                req_id, keys = loading
                served = keys if result.success else (result.successful_keys or ())
                if served:
                    self._served.setdefault(req_id, []).extend(served)
        self._update_switch_interval()
        return done

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self._engine.take_events()
        if not self._events_enabled:
            return ()
        prefix = f"{self.namespace.id}_r{self.namespace.rank}/"
        translated: list[OffloadingEvent] = to_vllm_events(events, prefix=prefix, localities=self._localities)
        again = announce_served(self._announce, locality=self._localities["nvme"])
        self._announce = []
        if again is not None:
            translated.append(again)
        return translated

    @override
    def drain_jobs(self) -> None:
        self._jobs.drain()

    @override
    def shutdown(self) -> None:
        """Stop the tier (a second call does nothing). Every store job reported done is on NVMe; what
        waits for upload stays in the node's journal, which the node agent drains."""
        if self._shut_down:
            return
        self._shut_down = True
        self._stopping.set()
        self._jobs.close()
        if self._switched:
            sys.setswitchinterval(self._normal_switch)
        self._stats.close()
        if self._timeline is not None:
            self._timeline.close()
        report = self._engine.close()
        if report.not_uploaded:
            log.info("KVStoreTier: %d chunks wait in the node's upload journal", report.not_uploaded)
        self._node.close()
        # vLLM unmaps the primary region next: no view of ours may outlive this call, including slices
        # kept alive only by reference cycles (exception tracebacks, closures of finished jobs).
        gc.collect()
        self._slots.release()

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        definitions: dict[str, OffloadingMetricMetadata] = metric_definitions()
        return definitions

    # vLLM 0.33's info metric (`vllm:kv_offload_config_info`): fixed facts, one label each. No `@override`:
    # vLLM 0.32 has no such members, and there they are never called. Names carry our prefix because the
    # spec merges every tier's label names into one series schema.
    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _CONFIG_INFO_KEYS

    def config_info(self) -> dict[str, str | int | float | bool]:
        scheme = self.key_scheme
        return {
            "kvstore_namespace": self.namespace.id,
            "kvstore_store": self._store_url,
            "kvstore_cache_bytes": self._cache_bytes,
            "kvstore_codec": self._codec,
            "kvstore_hash_algo": scheme.hash_algo or "unknown",
            "kvstore_seed_fingerprint": scheme.seed_fingerprint,
            "kvstore_keys_shareable": scheme.shareable,
            "kvstore_gil_switch_interval_s": self._fast_switch,
        }

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        # Busy: what the stats thread collected. Going idle: everything up to now, as vLLM stops asking.
        stats: OffloadingConnectorStats | None = self._stats.take(now=not self.has_pending_work())
        return stats

    # ----------------------------------------------------------- job threads

    def _update_switch_interval(self) -> None:
        """Short GIL switch interval exactly while a request waits on a load or a probe (scheduler thread)."""
        urgent = bool(self._loads_in_flight) or self._engine.probes_in_flight > 0
        if self._fast_switch and urgent != self._switched:
            sys.setswitchinterval(self._fast_switch if urgent else self._normal_switch)
            self._switched = urgent

    def _slot(self, chunk_id: int) -> memoryview:
        """Row `chunk_id` of the primary region; ValueError outside it (a slice would silently be short)."""
        size = self.block_size_bytes
        if not 0 <= chunk_id < len(self._slots) // size:
            raise ValueError(
                f"chunk id {chunk_id} is outside the primary region ({len(self._slots) // size})"
            )
        return self._slots[chunk_id * size : (chunk_id + 1) * size]

    def _run_loads(self, jobs: Sequence[TransferJob]) -> list[JobResult]:
        """One engine load for a batch of jobs; a job whose chunk ids are out of range fails on its own."""
        start = time.perf_counter()
        if self._timeline is not None:
            self._timeline.mark(milestones.LOAD_STARTED)
        runnable, results = self._with_slots(jobs)
        items = [item for _, job_items in runnable for item in job_items]
        ok = iter(self._engine.load_into(items)) if items else iter(())
        elapsed = time.perf_counter() - start
        if self._timeline is not None:
            self._timeline.mark(milestones.LOAD_DONE)
        for job, job_items in runnable:
            good = [next(ok) for _ in job_items]
            loaded = [k for k, fine in zip(job.keys, good, strict=True) if fine]
            nbytes = len(loaded) * self.block_size_bytes
            complete = len(loaded) == len(job_items)
            results.append(
                JobResult(
                    job_id=job.job_id,
                    success=complete,
                    successful_keys=None if complete else (loaded or None),
                    transfer_bytes=nbytes,
                    transfer_time=elapsed,
                )
            )
        return results

    def _run_stores(self, jobs: Sequence[TransferJob]) -> list[JobResult]:
        """One engine store for a batch of jobs: parallel writes, one index commit."""
        start = time.perf_counter()
        runnable, results = self._with_slots(jobs)
        items = [item for _, job_items in runnable for item in job_items]
        kept = iter(self._engine.store_many(items).kept_each) if items else iter(())
        elapsed = time.perf_counter() - start
        for job, job_items in runnable:
            stored = all([next(kept) for _ in job_items])
            results.append(
                JobResult(
                    job_id=job.job_id,
                    success=stored,
                    transfer_bytes=len(job_items) * self.block_size_bytes,
                    transfer_time=elapsed,
                )
            )
        return results

    def _publish_namespace(self) -> None:
        scheme = publish_namespace(self._node.store, self.namespace, self._stopping)
        if scheme is not None:
            self._scheme = scheme

    def _with_slots(
        self, jobs: Sequence[TransferJob]
    ) -> tuple[list[tuple[TransferJob, list[tuple[str, memoryview]]]], list[JobResult]]:
        """(job, its chunk keys and primary rows) for the jobs that can run; failed results for the rest."""
        runnable: list[tuple[TransferJob, list[tuple[str, memoryview]]]] = []
        failed: list[JobResult] = []
        for job in jobs:
            try:
                items = [
                    (self.namespace.chunk_key(k), self._slot(int(cid)))
                    for k, cid in zip(job.keys, job.chunk_ids, strict=True)
                ]
            except ValueError as exc:
                # The message only: a log record holding the exception keeps its frames, and with them views
                # of the primary region, alive past shutdown (vLLM unmaps the region then).
                log.error("KVStoreTier job %s refused: %s", job.job_id, str(exc))
                failed.append(JobResult(job_id=job.job_id, success=False))
                continue
            runnable.append((job, items))
        return runnable, failed


_CONFIG_INFO_KEYS = (
    "kvstore_namespace",
    "kvstore_store",
    "kvstore_cache_bytes",
    "kvstore_codec",
    "kvstore_hash_algo",
    "kvstore_seed_fingerprint",
    "kvstore_keys_shareable",
    "kvstore_gil_switch_interval_s",
)


def _is_cpu_spec(spec: object) -> bool:
    """Whether vLLM built us under `CPUTieringSpec`. Its module imports torch; the spec can only be one if
    vLLM already imported that module, so look it up rather than import it."""
    cpu = sys.modules.get("kvstore.connector.cpu")
    return cpu is not None and isinstance(spec, cpu.CPUTieringSpec)
