"""The router link's settings, checked when built."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.grpc_server import MAX_MESSAGE_BYTES
from common.security.tls import ChannelFactory
from engine_service.link.send_queue import DEFAULT_SEND_QUEUE_BYTES, OverflowPolicy
from common.router_targets import parse_targets


@dataclass
class RouterLinkConfig:
    # "host:port[,host:port...]" or "dns:NAME:PORT" (every resolved address is a replica).
    targets: str
    engine_id: str = "engine"
    heartbeat_interval_s: float = 2.0
    # A replica that sent nothing (not even a heartbeat) for this long is down.
    heartbeat_timeout_s: float = 6.0
    reconnect_base_s: float = 0.1
    reconnect_max_s: float = 5.0
    dns_refresh_s: float = 5.0
    # Rows not acknowledged this long after they were queued go unscored, and a
    # request without a reachable replica this long gets an Unavailable event.
    router_timeout_s: float = 5.0
    queue_max_batches: int = 64
    queue_max_bytes: int = DEFAULT_SEND_QUEUE_BYTES
    overflow_policy: OverflowPolicy = OverflowPolicy.DROP_OLDEST
    max_message_bytes: int = MAX_MESSAGE_BYTES
    # close(): how long to wait for queues to flush and routers to end their streams.
    close_timeout_s: float = 2.0
    # Opens each Session's channel: plaintext by default, mutual TLS when the
    # engine has certificates (a new channel per attempt reads them afresh).
    open_channel: ChannelFactory = field(default_factory=ChannelFactory)

    def __post_init__(self) -> None:
        self.overflow_policy = OverflowPolicy(self.overflow_policy)
        parse_targets(self.targets)  # fail at configuration time
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ValueError("heartbeat_timeout_s must exceed heartbeat_interval_s")
        if self.router_timeout_s <= 0:
            raise ValueError("router_timeout_s must be positive")
