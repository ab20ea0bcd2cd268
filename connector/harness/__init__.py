"""What the demo, the benchmarks and the tests drive the tier with; nothing here runs inside a serving engine.

- `tiny_model`: builds a small local model (no model hub here);
- `vllm_server`: a vLLM OpenAI server as a subprocess, stopped with everything it leaves in /dev/shm and /tmp;
- `engine_runner`: a vLLM engine in a subprocess (`engine_child`), whose KV blocks can be read back and
  compared;
- `standalone`: the tier outside an engine, on a primary region of our own, through vLLM's tier API;
- `multiturn`: the multi-turn chat replay the demo and `kvstore bench multiturn` send;
- `metrics`: the flat metric snapshots both runners return, and the sums the callers read from them.
"""
