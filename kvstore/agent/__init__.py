"""The node agent: one process per node (per cache directory) that does what no request waits on.

==================  =======================================================================================
``node_agent``      `NodeAgent`: uploads, eviction, touches and access records, counters, pin sync, the
                    change log's trimming
``uploads``         the upload journal's drain
``eviction``        the budget and the disk's free space
``inbox``           what engines send it (hints over a datagram socket, screened; never chunk bytes)
``supervisor``      its process: priority, start (detached) and stop
``embedded_store``  the embedded object store, followed to whichever server runs now
``main``            the process: `kvstore agent`, `python -m kvstore.agent`
==================  =======================================================================================

What engines and the agent share (the hint protocol, the lock and status file, the engines' registration)
is `kvstore.node`; the engine imports nothing from here. Nothing is imported here either.
"""
