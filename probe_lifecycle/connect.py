"""The one place the lifecycle commands open gRPC channels and find router replicas."""

from __future__ import annotations

import socket

import grpc

from common.grpc_server import channel_options


def channel(address: str) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options())
