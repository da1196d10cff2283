"""One request's path through the engine service: checks of what the client
sent, the probe rows it owes and their ledger, the token gate, and its client
stream. Plain logic (no vLLM, no gRPC server); runs in the engine service
process."""
