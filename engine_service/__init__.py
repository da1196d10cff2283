"""The engine service: vLLM with activation capture, linked to probe routers.

Which process runs what:
- `__main__` (the command line) and `service/` (gRPC server, runtime, metrics)
  run in the engine service process, with vLLM's AsyncLLM front end;
  `request/` (one request's path: checks, ledger, gate, client stream) and
  `link/` (the Sessions to the router replicas) run there too, and so does
  `openai_api/` (the OpenAI-compatible HTTP API, on the same event loop).
- `capture/driver/` runs in the engine service process, `capture/worker/` in
  each vLLM worker process; `capture/channel.py`, `graphs.py` and
  `request_ids.py` are what both sides share.
- `engine_core/` is loaded into vLLM's engine core process (its scheduler
  and its wait), with the wire the service uses to talk to it.
- `cpu_host/` tunes where and how the processes run on a CPU host.
- `worker_node` is the entry point of the other nodes of a multi-node engine
  (vLLM workers only); `nodes` checks the flags both entry points share.
"""
