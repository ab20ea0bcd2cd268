"""What the processes on a node share about one cache directory, besides the cache itself: the contract
between the vLLM engines and the node agent. Engines and the agent both import it; it imports neither.

===============  ========================================================================================
``hints``        the hint protocol: what a datagram holds, how hints are split into datagrams (by bytes),
                 what the agent accepts (keys it can hold, known counter names, bounded increments)
``link``         the engine's side of it: hints buffered without blocking, sent from housekeeping
``agent_files``  the agent's lock and status file: who runs, whether it is hung, signals sent only to the
                 process the kernel says holds the lock
``engines``      engines registered on the cache, and the store they all agree on
``watch``        an engine's view of its agent: up, hung, replaced
``private``      the cache directory is its owner's alone (0700 directories, 0600 files)
===============  ========================================================================================

Nothing is imported here: each user imports the module it needs.
"""
