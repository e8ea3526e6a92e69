"""The brain's HTTP API, event stream, Prometheus metrics and dashboard (aiohttp)."""

from brain.http.auth import Caller, TokenFileError, TokenTable, ensure_tokens_file
from brain.http.server import HttpServer, InvalidAddress, parse_address

__all__ = [
    "Caller",
    "HttpServer",
    "InvalidAddress",
    "TokenFileError",
    "TokenTable",
    "ensure_tokens_file",
    "parse_address",
]
