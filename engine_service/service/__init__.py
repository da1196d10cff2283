"""The engine service process: its gRPC server and servicer, the runtime that
joins vLLM, capture and the router link, and its metrics."""
