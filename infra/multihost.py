"""A multi-host Alnair cluster on this machine, in network namespaces, to try by hand.

    sudo .venv/bin/python infra/multihost.py [--agents 3] [--brains 2] [--dir DIR]

Makes hosts nats-1..3 (one JetStream cluster), brain-1..2 and node-1..N on a bridge,
each with its own address, hostname and ALNAIR_HOME (DIR/<host>), and starts Alnair on
them (tests/multihost.py does the work). Then it reads commands on stdin:

    partition HOST   its link down: cut off from every other host
    heal HOST        its link up again
    hosts            each host's address and processes
    env              how to point the alnair CLI at the cluster from this shell
    quit             stop everything and remove the hosts (also on Ctrl-C or EOF)

The CLI runs in the root namespace, which has an address on the bridge:
`ALNAIR_NATS=<urls> alnair status`, or inside a host:
`ip netns exec aln<tag>-node-1 .venv/bin/alnair jobs --nats <urls>`.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.multihost import MultiHost, Timings, unavailable


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=3, help="agent hosts (default 3)")
    parser.add_argument("--brains", type=int, default=2, help="brain hosts (default 2)")
    parser.add_argument("--gpus", default="sim:2xA100", help="each agent's GPUs")
    parser.add_argument("--dir", help="where the hosts' ALNAIR_HOMEs go (default: a temp dir)")
    parser.add_argument("--node-timeout", type=float, default=5.0)
    parser.add_argument("--fence-margin", type=float, default=5.0)
    parser.add_argument("--fence-after", type=float, default=5.0)
    parser.add_argument("--fence-grace", type=float, default=3.0)
    parser.add_argument("--lease-ttl", type=float, default=5.0)
    args = parser.parse_args()
    why = unavailable()
    if why:
        print(f"multihost: {why}", file=sys.stderr)
        return 2
    workdir = Path(args.dir or tempfile.mkdtemp(prefix="alnair-multihost-"))
    timings = Timings(
        heartbeat_s=1.0,
        node_timeout_s=args.node_timeout,
        fence_margin_s=args.fence_margin,
        fence_after_s=args.fence_after,
        fence_grace_s=args.fence_grace,
        lease_ttl_s=args.lease_ttl,
        keep_disconnected_s=300.0,
    )
    cluster = MultiHost(
        workdir, agents=args.agents, brains=args.brains, gpus=args.gpus, timings=timings
    )
    try:
        cluster.start()
        print(f"cluster up in {workdir}; NATS {','.join(cluster.urls)}")
        print("commands: partition HOST | heal HOST | hosts | env | quit")
        for line in sys.stdin:
            words = line.split()
            if not words:
                continue
            verb, rest = words[0], words[1:]
            if verb == "quit":
                break
            if verb in ("partition", "heal") and rest and rest[0] in cluster.hosts:
                getattr(cluster, verb)(rest[0])
                print(f"{verb}: {rest[0]}")
            elif verb == "hosts":
                for host in cluster.hosts.values():
                    roles = ", ".join(
                        f"{role} pid {p.pid}{'' if p.poll() is None else ' (exited)'}"
                        for role, p in host.processes.items()
                    )
                    print(f"{host.name:<8} {host.address:<14} {host.netns}  {roles}")
            elif verb == "env":
                print(f"export ALNAIR_NATS={','.join(cluster.urls)}")
            else:
                print(f"unknown command {line.strip()!r}; hosts: {', '.join(cluster.hosts)}")
    except KeyboardInterrupt:
        pass
    finally:
        cluster.close()
        print("hosts removed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
