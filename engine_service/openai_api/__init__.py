"""The OpenAI-compatible HTTP API of the engine service.

Runs in the engine service process, on the event loop that serves the gRPC
API, on a port of its own (--openai-port). It is a front only: every request
becomes a GenerateRequest and runs through `EngineRuntime.generate`, the same
owner of a request's behaviour as the gRPC API (the caller's operator-set
bindings, gating, verdicts, quotas). vLLM's own OpenAI protocol models and its
chat-template renderer give the request and response shapes; `requests` and
`results` translate between them and the contract (plain logic), `server`
serves them over HTTP with FastAPI.
"""
