"""The node agent: one process per node (per cache directory) that does what no request waits on.

==============  ===========================================================================================
``node_agent``  `NodeAgent`: uploads, admission of object hits, eviction, touches and access records,
                counters, pin sync, the change log's trimming
``uploads``     the upload journal's drain
``admission``   object-store chunks into NVMe (engines' hits; warming)
``eviction``    the budget and the disk's free space
``link``        what engines send it (hints over a datagram socket; never chunk bytes)
``supervisor``  one agent per cache directory: its lock, status, priority, start and stop
``main``        the process: `kvstore agent`, `python -m kvstore.agent`
==============  ===========================================================================================

Nothing is imported here: the engine imports `link` and `supervisor` alone, without the agent's machinery.
"""
