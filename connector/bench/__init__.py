"""Every `kvstore bench ...` benchmark, each against a baseline measured in the same run.

- `tiers`: our tier against vLLM's `fs` tier through vLLM's tier API (store and cold load:
  `tiers_store_load`), the object path of a new node against raw GETs (`tiers_object_path`), the raw disk
  (`disk`); `codecs`: the chunk codecs' speed and ratio. `tier_driver` drives a tier as vLLM's scheduler
  does (for `offered` too).
- `offered`: stores offered at fixed rates, as a GPU engine sends them: what each tier persists.
- `engines` (`bench vllm`): TTFT in real vLLM engines (recompute, vLLM's `fs` tier, ours) and the scheduler's
  cost per step.
- `multiturn`: multi-turn chat throughput through a real vLLM server, per offloading method.
- `fleet`: two servers standing for two nodes, round-robin or cache-aware routing (`fleet_nodes` sets the
  nodes up, `fleet_report` works out the figures).
- `gc`: GC over a generated bucket.

Each benchmark's command (its options, its tables) is the `_cli` module beside it, declared the way
`command` describes; `cli` assembles them into `kvstore bench`. `target` is where a run writes, `outputs`
writes its JSON and PNG.
"""
