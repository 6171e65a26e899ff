"""``meshrun launch``: parse, then run one node's agent or a simulated multi-node rehearsal.

Exit codes: 0 success; 2 a wrong command line; 1 the rendezvous could not be reached or completed; otherwise the
first failed worker's exit code (128+N for a worker killed by signal N, or for the launcher stopped by signal N).
"""

from __future__ import annotations

import os
import sys

from meshrun.launch.args import LaunchUsageError, parse_launch_args
from meshrun.launch.launcher import LaunchError, launch
from meshrun.launch.net import EndpointError
from meshrun.launch.simulate import simulate
from meshrun.placement import PlacementError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        largs = parse_launch_args(argv)
        return simulate(largs) if largs.ns.simulate_nodes else launch(largs)
    except SystemExit as exc:  # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else 2
    except PlacementError as exc:
        if exc.speaker:  # every task of the step gets the same refusal; one says it
            print(f"meshrun launch: {exc}", file=sys.stderr)
        return 2
    except (LaunchUsageError, EndpointError) as exc:
        print(f"meshrun launch: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"meshrun launch: {exc}", file=sys.stderr, flush=True)
        if exc.hard_exit:  # a store client thread is still blocked in torch; finalizing around it would abort
            sys.stdout.flush()
            os._exit(1)
        return 1


if __name__ == "__main__":
    sys.exit(main())
