"""NATS for Alnair: connection, the embedded server, typed pub/sub, streams, dead letters."""

from bus.client import Bus, ConnectOptions, connect_options
from bus.server import EmbeddedNats, free_port

__all__ = ["Bus", "ConnectOptions", "EmbeddedNats", "connect_options", "free_port"]
