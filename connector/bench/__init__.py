"""Every `kvstore bench ...` benchmark, each against a baseline measured in the same run.

- `tiers`: our tier against vLLM's `fs` tier through vLLM's tier API (store, cold load), the object path of a
  new node against raw GETs, the raw disk; `codecs`: the chunk codecs' speed and ratio.
- `offered`: stores offered at fixed rates, as a GPU engine sends them: what each tier persists.
- `engines`: TTFT in real vLLM engines (recompute, vLLM's `fs` tier, ours) and the scheduler's cost per step.
- `multiturn`: multi-turn chat throughput through a real vLLM server, per offloading method.
- `gc`: GC over a generated bucket.

`report` renders their results for the CLI (`admin/cli_bench.py` holds only the commands' options).
"""
