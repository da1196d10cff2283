"""Capture inside each vLLM worker process: the worker extension vLLM loads,
the capture sites in the model, the per-step row mapping and staging, and
the pusher that ships each step's rows to the driver."""
