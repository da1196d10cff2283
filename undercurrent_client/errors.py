"""The one error a client call raises: the gRPC status and the server's message."""

from __future__ import annotations

import grpc


class RpcError(Exception):
    """A call failed. `code` is the grpc.StatusCode, `details` the server's message
    (for bad input it names the field), `method` the RPC."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str):
        self.method = method
        self.code = code
        self.details = details
        super().__init__(f"{method} failed with {code.name}: {details}")

    @classmethod
    def from_grpc(cls, method: str, err: grpc.RpcError) -> "RpcError":
        return cls(method, err.code(), err.details() or "")
