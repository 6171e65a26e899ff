"""``meshrun lighthouse``: the torchft lighthouse that joins replica groups (docs/fault_tolerance.md).

It runs torchft's own server (``torchft._torchft.LighthouseServer``, the one ``torchft_lighthouse`` starts) in the
foreground, prints its address and the options each group's ``meshrun train`` needs, and stops on Ctrl-C or
SIGTERM. It holds no training state: a lost lighthouse stops every group at its next quorum (after
``replicas.quorum_timeout_s``); start it again at the same address and resume the job from its checkpoints.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

EPILOG = """\
Then start each replica group (any layout inside) pointing at it, e.g. two groups on this host:
  meshrun launch --nproc-per-node 2 train --replicas.groups=2 --replicas.group=0 --replicas.lighthouse=HOST:PORT ...
  meshrun launch --nproc-per-node 2 train --replicas.groups=2 --replicas.group=1 --replicas.lighthouse=HOST:PORT ...
"""


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="meshrun lighthouse", epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Start the torchft lighthouse that joins replica groups.")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: groups on this host only; give an address "
                        "of this node that every group's first node reaches, or 0.0.0.0)")
    parser.add_argument("--port", type=int, default=29510, help="port (default 29510; 0 picks a free one)")
    parser.add_argument("--min-groups", type=int, default=1, help="live groups a quorum needs (default 1)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=5.0,
                        help="a group silent this long is lost: the others go on without it (default 5)")
    parser.add_argument("--join-timeout-s", type=float, default=10.0,
                        help="how long a quorum waits for groups that are alive but have not asked yet (default 10)")
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="how often a pending quorum is checked")
    return parser.parse_args(argv)


def start_lighthouse(*, host: str = "127.0.0.1", port: int = 0, min_groups: int = 1, heartbeat_timeout_s: float = 5.0,
                     join_timeout_s: float = 10.0, quorum_tick_ms: int = 100):
    """A running torchft LighthouseServer; ``.address()`` is its http://host:port, ``.shutdown()`` stops it."""
    from torchft._torchft import LighthouseServer

    bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return LighthouseServer(bind=bind, min_replicas=min_groups, join_timeout_ms=int(join_timeout_s * 1000),
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.min_groups < 1 or args.heartbeat_timeout_s <= 0 or args.join_timeout_s < 0:
        print("meshrun lighthouse: error: --min-groups must be >= 1, --heartbeat-timeout-s > 0 and --join-timeout-s "
              ">= 0", file=sys.stderr)
        return 2
    try:
        import torchft  # noqa: F401 - only to name the missing extra
    except ImportError:
        print("meshrun lighthouse: error: torchft is not installed; pip install 'meshrun[ft]'", file=sys.stderr)
        return 2
    try:
        server = start_lighthouse(host=args.host, port=args.port, min_groups=args.min_groups,
                                  heartbeat_timeout_s=args.heartbeat_timeout_s, join_timeout_s=args.join_timeout_s,
                                  quorum_tick_ms=args.quorum_tick_ms)
    except Exception as exc:  # noqa: BLE001 - the server's bind error, in one line
        print(f"meshrun lighthouse: error: cannot listen on {args.host}:{args.port}: {exc}; choose another --port "
              "or --host", file=sys.stderr)
        return 1
    port = server.address().rpartition(":")[2]  # the server names this host; the bound address is what we gave
    address = f"[{args.host}]:{port}" if ":" in args.host else f"{args.host}:{port}"
    give = address
    if args.host in ("0.0.0.0", "::"):  # every interface: the groups need one of this host's addresses
        give = f"ADDRESS:{port}, ADDRESS an address of this host that every group reaches"
    print(f"meshrun lighthouse: listening on {address} (min groups {args.min_groups}, heartbeat timeout "
          f"{args.heartbeat_timeout_s:g} s); give each group --replicas.lighthouse={give}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    print("meshrun lighthouse: stopped", flush=True)
    return 0
