"""Capture's driver side, in the engine service process next to vLLM's
AsyncLLM: the controller (registration, drains, topology checks), the sink the
workers push to, and the merge of every worker's rows into ordered blocks."""
