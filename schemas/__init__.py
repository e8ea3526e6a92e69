"""Every message and record Alnair puts on the wire, and its subject names.

Pure: no I/O, no clock. Tested without a server.
"""

from schemas.base import MAX_MESSAGE_BYTES, SCHEMA_VERSION, Message, decode, encode

__all__ = ["MAX_MESSAGE_BYTES", "SCHEMA_VERSION", "Message", "decode", "encode"]
