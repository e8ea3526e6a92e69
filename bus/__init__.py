"""NATS for Alnair: connection, the embedded server, typed pub/sub, streams, dead letters."""

from bus.client import Bus, ConnectOptions
from bus.server import EmbeddedNats, free_port

__all__ = ["Bus", "ConnectOptions", "EmbeddedNats", "free_port"]
