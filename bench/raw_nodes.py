"""Synthetic nodes at 1 Hz, written as raw NATS protocol: the load of thousands of
agents from one process, cheap enough to leave the cores to the brain under test.

    .venv/bin/python bench/raw_nodes.py nats://127.0.0.1:PORT NODES SECONDS

Each second, spread over 20 slices, every node publishes a heartbeat and an 8-GPU
telemetry batch exactly as an agent encodes them (`bench.brain_scale.heartbeat_bytes`,
`telemetry_bytes`), with its clock and sequence advanced as an agent's are. nats-py
costs a few microseconds of Python per publish, which is what capped the in-process
synthetic nodes near 8,000 nodes on this 2-core machine; here a slice is one
`sendall` of pre-built `PUB` frames, so the cost is formatting two numbers per
message. Answers the server's PINGs. Prints `<messages sent> <CPU seconds>` at the
end; exits 1 if the server closed the connection.
"""

from __future__ import annotations

import os
import re
import select
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.brain_scale import heartbeat_bytes, telemetry_bytes  # noqa: E402
from schemas import subjects  # noqa: E402

SLICES = 20
_CLOCK = re.compile(rb'"ts":[0-9.e+-]+,"seq":[0-9]+')
_TS = re.compile(rb'"ts":[0-9.e+-]+')


class Frames:
    """One node's two messages as `PUB` frames around their clock fields."""

    def __init__(self, node: str) -> None:
        beat = heartbeat_bytes(node)
        found = _CLOCK.search(beat)
        if found is None:
            raise ValueError(f"no ts/seq in {node}'s heartbeat")
        self.beat_head, self.beat_tail = beat[: found.start()], beat[found.end() :]
        self.beat_subject = subjects.node(node, "heartbeat").encode()
        samples = telemetry_bytes(node)
        found = _TS.search(samples)
        if found is None:
            raise ValueError(f"no ts in {node}'s telemetry")
        self.samples_head, self.samples_tail = samples[: found.start()], samples[found.end() :]
        self.samples_subject = subjects.node(node, "telemetry").encode()

    def frames(self, now: float, seq: int) -> bytes:
        beat = b"".join((self.beat_head, b'"ts":%.6f,"seq":%d' % (now, seq), self.beat_tail))
        samples = b"".join((self.samples_head, b'"ts":%.6f' % now, self.samples_tail))
        return b"".join(
            (
                b"PUB %s %d\r\n%s\r\n" % (self.beat_subject, len(beat), beat),
                b"PUB %s %d\r\n%s\r\n" % (self.samples_subject, len(samples), samples),
            )
        )


def _answer_pings(sock: socket.socket) -> None:
    while select.select([sock], [], [], 0)[0]:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        for _ in range(data.count(b"PING\r\n")):
            sock.sendall(b"PONG\r\n")
        if b"-ERR" in data:
            raise ConnectionError(data.decode(errors="replace").strip())


def run(url: str, count: int, seconds: float) -> int:
    address = urlparse(url)
    sock = socket.create_connection((address.hostname or "127.0.0.1", address.port or 4222))
    sock.recv(65536)  # INFO
    sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"name":"raw-nodes"}\r\nPING\r\n')
    nodes = [Frames(f"f{i:05d}") for i in range(count)]
    sent = 0
    seq = 0
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        second = time.monotonic()
        seq += 1
        for part in range(SLICES):
            now = time.time()
            sock.sendall(b"".join(node.frames(now, seq) for node in nodes[part::SLICES]))
            sent += 2 * len(nodes[part::SLICES])
            _answer_pings(sock)
            time.sleep(max(0.0, second + (part + 1) / SLICES - time.monotonic()))
    sock.sendall(b"PING\r\n")
    sock.close()
    return sent


def main(argv: list[str]) -> int:
    url, count, seconds = argv[0], int(argv[1]), float(argv[2])
    try:
        sent = run(url, count, seconds)
    except ConnectionError as error:
        print(f"raw_nodes: {error}", file=sys.stderr)
        return 1
    times = os.times()
    print(sent, times.user + times.system, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
