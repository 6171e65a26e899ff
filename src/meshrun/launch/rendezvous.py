"""What ``meshrun launch`` decides before it hands over to torch's elastic agent, and the block that shows it.

The decisions, in order: where the rendezvous is (flags, the cluster environment's placement of this node, e.g.
SLURM, or a standalone store on loopback), which
backend serves it, which local address and interface reach it, whether this node hosts the c10d store, and which
socket variables the workers need. :func:`make_plan` makes them; :func:`apply_plan` writes them into torchrun's
namespace; :func:`format_plan` prints them.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import shlex
import socket
import uuid
from dataclasses import dataclass, field
from typing import Mapping

from meshrun.launch.args import LaunchArgs, LaunchUsageError, Target, apply_target, parse_nnodes
from meshrun.launch.net import Route, interface_of, is_loopback, parse_endpoint, port_accepts, resolve, route_to
from meshrun.placement import NodePlacement, detect_node_placement

C10D_DEFAULT_PORT = 29400
STATIC_DEFAULT_PORT = 29500
SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Set to the interface that reaches the endpoint, for multi-host jobs only, and never over a caller's value."""


@dataclass
class LaunchPlan:
    """Everything decided before the elastic agent starts."""

    target: Target
    min_nodes: int
    max_nodes: int
    nproc: str
    """--nproc-per-node as given (a number, or torch's auto/gpu/cpu)."""
    backend: str
    """Rendezvous backend: c10d, static, or a backend torch knows by another name."""
    endpoint_host: str
    endpoint_port: int
    rdzv_id: str
    rdzv_conf: dict[str, str]
    node_rank: int
    """Only meaningful for the static backend; c10d assigns node ranks when nodes join."""
    origin: str
    """Where the layout came from: 'standalone', 'flags', or the name of the placing environment ('slurm')."""
    store_here: bool | None
    """This node hosts the rendezvous store; None when the backend decides."""
    store_reason: str
    local_addr: str | None
    """Address this node gives the agent (torchrun's --local-addr); peers and workers connect to it."""
    local_reason: str
    iface: str | None
    """Interface that owns local_addr."""
    single_host: bool
    """All nodes are on this host (one node, or a loopback endpoint)."""
    timeout_s: int
    max_restarts: int
    env_set: dict[str, str] = field(default_factory=dict)
    env_kept: dict[str, str] = field(default_factory=dict)
    env_why: dict[str, str] = field(default_factory=dict)
    """Why a variable of env_set has its value, where the block should say so."""
    placement: NodePlacement | None = None
    """Nodes, this node's index and the endpoint, from the cluster environment (SLURM); None under flags."""
    notes: list[str] = field(default_factory=list)
    listens: str = ""
    """Which addresses this node's stores accept connections on, and what torch leaves open."""

    @property
    def endpoint(self) -> str:
        return format_endpoint(self.endpoint_host, self.endpoint_port)

    @property
    def label(self) -> str:
        """Prefix of this node's lines under a placement (srun interleaves every node's output): '[node 1 gpu08] '."""
        return f"[node {self.placement.node_rank} {socket.gethostname()}] " if self.placement is not None else ""

    @property
    def probe_first(self) -> bool:
        """Another host serves the store: check that it is reachable before joining."""
        return self.store_here is False


@dataclass(frozen=True)
class _Rendezvous:
    backend: str
    host: str
    port: int
    rdzv_id: str
    node_rank: int
    origin: str


def format_endpoint(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def make_plan(largs: LaunchArgs, *, environ: Mapping[str, str]) -> LaunchPlan:
    """Decide the rendezvous, addresses and environment. Looks at routes and local ports; starts nothing."""
    ns, given = largs.ns, largs.given
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    placement = None
    if not given & {"nnodes", "node_rank", "rdzv_endpoint", "master_addr", "standalone"}:
        placement = detect_node_placement(environ, command=shlex.join(["meshrun", "launch", *largs.option_tokens,
                                                                       largs.target.name, *largs.target.args]))
        if placement is not None:
            min_nodes = max_nodes = placement.num_nodes
    rdzv = _rendezvous(ns, given, max_nodes=max_nodes, placement=placement)
    if rdzv.origin == "standalone":
        route = Route(dest="127.0.0.1", source="127.0.0.1", iface=None, dest_is_local=True)
    else:
        route = route_to(rdzv.host)
    plan = LaunchPlan(target=largs.target, min_nodes=min_nodes, max_nodes=max_nodes, nproc=str(ns.nproc_per_node),
                      backend=rdzv.backend, endpoint_host=rdzv.host, endpoint_port=rdzv.port, rdzv_id=rdzv.rdzv_id,
                      rdzv_conf=parse_rdzv_conf(ns.rdzv_conf), node_rank=rdzv.node_rank, origin=rdzv.origin,
                      store_here=None, store_reason="", local_addr=None, local_reason="", iface=None,
                      single_host=max_nodes == 1 or is_loopback(route.dest), timeout_s=ns.rdzv_timeout,
                      max_restarts=ns.max_restarts, placement=placement)
    if plan.backend == "c10d" and "node_rank" in given:
        plan.notes.append(f"--node-rank {ns.node_rank} is ignored: c10d numbers nodes as they join "
                          "(add --rdzv-backend static to fix node ranks, without elastic membership).")
    _choose_local_addr(plan, route, ns, given)
    _choose_store_host(plan, route)
    _choose_socket_env(plan, environ)
    _choose_thread_env(plan, environ)
    _choose_store_sharing(plan, environ)
    _describe_listeners(plan)
    return plan


def _rendezvous(ns: argparse.Namespace, given: frozenset[str], *, max_nodes: int,
                placement: NodePlacement | None) -> _Rendezvous:
    """Backend, endpoint, id and node rank, from flags, else the placement, else a standalone store on loopback."""
    endpoint_given = bool(given & {"rdzv_endpoint", "master_addr", "master_port"})
    static_asked = "rdzv_backend" in given and ns.rdzv_backend == "static"
    if ns.standalone and max_nodes > 1:
        raise LaunchUsageError(f"--standalone runs a single-node job, but --nnodes is {ns.nnodes}; drop "
                               "--standalone and give --rdzv-endpoint HOST:PORT of one node.")
    if ns.standalone or (not endpoint_given and placement is None and not static_asked):
        if max_nodes > 1:
            raise LaunchUsageError(f"--nnodes {ns.nnodes} needs a rendezvous endpoint: add --rdzv-endpoint HOST:PORT "
                                   "(an address of one node that all nodes reach), or --master-addr/--master-port.")
        return _Rendezvous(backend="c10d", host="127.0.0.1", port=0, rdzv_id=f"meshrun-{uuid.uuid4().hex[:12]}",
                           node_rank=0, origin="standalone")
    if "rdzv_backend" in given:
        backend = ns.rdzv_backend
    elif "node_rank" in given and "rdzv_endpoint" not in given:
        backend = "static"  # a pasted torchrun line (--node-rank with --master-addr) keeps torchrun's meaning
    else:
        backend = "c10d"
    default_port = C10D_DEFAULT_PORT if backend == "c10d" else STATIC_DEFAULT_PORT
    if "rdzv_endpoint" in given:
        host, port = parse_endpoint(ns.rdzv_endpoint, default_port=default_port)
    elif placement is not None:  # (the placement is only consulted when --master-addr was not given)
        host = placement.endpoint_host
        port = ns.master_port if "master_port" in given else placement.endpoint_port
    else:
        host, port = ns.master_addr.strip("[]"), ns.master_port or STATIC_DEFAULT_PORT
    rdzv_id = ns.rdzv_id
    if "rdzv_id" not in given and placement is not None and placement.rdzv_id:
        rdzv_id = placement.rdzv_id
    node_rank = placement.node_rank if placement is not None and "node_rank" not in given else ns.node_rank
    return _Rendezvous(backend=backend, host=host, port=port, rdzv_id=rdzv_id, node_rank=node_rank,
                       origin=placement.source if placement is not None else "flags")


def _choose_local_addr(plan: LaunchPlan, route: Route, ns: argparse.Namespace, given: frozenset[str]) -> None:
    if "local_addr" in given:
        plan.local_addr, plan.local_reason = ns.local_addr, "from --local-addr"
        plan.iface = interface_of(resolve(ns.local_addr))
    else:
        plan.local_addr = route.source
        plan.local_reason = ("loopback: every node is on this host" if is_loopback(route.source)
                             else f"source address of the route to {route.dest}")
        plan.iface = interface_of(route.source)
    if plan.max_nodes > 1 and is_loopback(route.dest) and not _is_ip(plan.endpoint_host):
        plan.notes.append(f"endpoint host {plan.endpoint_host!r} resolves to {route.dest} here, so other hosts "
                          "cannot be told where this node is; for several hosts give an address they reach.")


def _choose_store_host(plan: LaunchPlan, route: Route) -> None:
    """c10d: host the store when the endpoint is one of this host's addresses (is_host=1), else join (is_host=0)."""
    conf, timeout = plan.rdzv_conf, str(plan.timeout_s)
    if plan.backend == "c10d":
        conf.setdefault("join_timeout", timeout)
        if "is_host" in conf:
            plan.store_here = conf["is_host"].strip().lower() in ("1", "true", "yes", "y")
            plan.store_reason = "from --rdzv-conf is_host"
        elif not route.dest_is_local:
            plan.store_here, plan.store_reason = False, f"{route.dest} is another host"
        elif plan.placement is not None:
            _choose_placed_store_host(plan, plan.placement, route)
        elif plan.endpoint_port and port_accepts(route.dest, plan.endpoint_port):
            if plan.max_nodes == 1:
                raise LaunchUsageError(f"rendezvous port {plan.endpoint} is already in use on this host; choose "
                                       "another --master-port/--rdzv-endpoint port, or drop it for a free one.")
            plan.store_here = False
            plan.store_reason = f"another launcher on this host already serves {plan.endpoint}"
        else:
            plan.store_here = True
            plan.store_reason = ("standalone store on a free loopback port" if plan.origin == "standalone"
                                 else f"{route.dest} is this host's address")
        conf["is_host"] = "1" if plan.store_here else "0"
    elif plan.backend == "static":
        conf.setdefault("timeout", timeout)
        plan.store_here = plan.node_rank == 0
        plan.store_reason = f"static rendezvous: node rank 0 hosts it (this is node rank {plan.node_rank})"
        if plan.store_here and not route.dest_is_local:
            plan.notes.append(f"--node-rank 0 hosts the store, but {plan.endpoint_host} ({route.dest}) is not an "
                              "address of this host; other nodes will look for it there.")
    else:
        plan.store_reason = f"decided by the {plan.backend} backend"


def _choose_placed_store_host(plan: LaunchPlan, placement: NodePlacement, route: Route) -> None:
    """Placed by the cluster environment, endpoint on this host: node 0 hosts (whichever launcher starts first),
    and a busy port there is another job's store on a shared node, never one to join."""
    plan.store_here = placement.node_rank == 0
    title = placement.title
    if not plan.store_here:
        plan.store_reason = (f"{title} node 0 hosts it (this is node {placement.node_rank}; {route.dest} is on "
                             "this host)")
        return
    if plan.endpoint_port and port_accepts(route.dest, plan.endpoint_port):
        raise LaunchUsageError(
            f"{title} job {placement.job_id or '?'}: rendezvous port {plan.endpoint_port} on {socket.gethostname()} "
            f"is already in use, probably by another job on this node: {placement.busy_port_fix}")
    plan.store_reason = f"{title} node 0 hosts it ({route.dest} is this host's address)"


def _choose_socket_env(plan: LaunchPlan, environ: Mapping[str, str]) -> None:
    """Pin gloo and NCCL sockets to the interface that reaches the endpoint, for multi-host jobs only.

    On one host the libraries' own choice is right (loopback for gloo; NVLink/P2P for NCCL, whose socket
    interface then carries only bootstrap), and pinning could only pick a worse NIC.
    """
    for var in SOCKET_IFNAME_VARS:
        if var in environ:
            plan.env_kept[var] = environ[var]
        elif not plan.single_host and plan.iface:
            plan.env_set[var] = plan.iface
    _check_socket_env(plan, environ)
    if not plan.single_host and not plan.iface:
        plan.notes.append(f"no interface owns {plan.local_addr}; set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME "
                          "to the NIC that reaches the other nodes.")


def _check_socket_env(plan: LaunchPlan, environ: Mapping[str, str]) -> None:
    """Your GLOO_SOCKET_IFNAME must name interfaces of this host: gloo would fail each worker a few seconds in, and
    its peers would wait out their whole timeout for it (LaunchUsageError here, naming the interface to use). A
    NCCL_SOCKET_IFNAME that matches none is a note: it matters only where NCCL runs."""
    from meshrun.diag.ifname import gloo_error, nccl_matches
    from meshrun.launch.net import interface_addresses

    gloo, nccl = environ.get("GLOO_SOCKET_IFNAME"), environ.get("NCCL_SOCKET_IFNAME")
    if not gloo and not nccl:
        return
    interfaces = list(interface_addresses())
    use = (f"set it to {plan.iface}, the interface of this host's route to {plan.endpoint_host}, or unset it (meshrun "
           "then sets it so)" if plan.iface and not plan.single_host
           else "unset it (on one host gloo picks loopback itself)")
    if gloo and (why := gloo_error(gloo, interfaces)):
        raise LaunchUsageError(f"{why.replace('this node', socket.gethostname())} (it has {', '.join(interfaces)}); "
                               f"{use}")
    if nccl and not nccl_matches(nccl, interfaces):
        plan.notes.append(f"NCCL_SOCKET_IFNAME={nccl} matches no interface of {socket.gethostname()} (it has "
                          f"{', '.join(interfaces)}): NCCL would find no socket interface; {use}")


def _choose_thread_env(plan: LaunchPlan, environ: Mapping[str, str]) -> None:
    """OMP_NUM_THREADS=1 when several workers share this host, as torchrun does for several workers per node (said
    here instead of in its banner). Nodes on a loopback endpoint (--simulate-nodes) all run on this host: one worker
    per node there is still several workers on its cores, each of which would start a thread per core."""
    workers = sharing_host(plan)
    if "OMP_NUM_THREADS" in environ:
        plan.env_kept["OMP_NUM_THREADS"] = environ["OMP_NUM_THREADS"]
    elif workers > 1:
        plan.env_set["OMP_NUM_THREADS"] = "1"
        plan.env_why["OMP_NUM_THREADS"] = (f"{workers} workers share this host's {os.cpu_count() or '?'} cores; "
                                           "set OMP_NUM_THREADS to choose")


def sharing_host(plan: LaunchPlan) -> int:
    """Workers on this host: this node's, times the node count when every node is on this host (loopback); 0 when
    --nproc-per-node is not a number (torch's auto, gpu, cpu)."""
    if not plan.nproc.isdigit():
        return 0
    return int(plan.nproc) * (plan.max_nodes if plan.single_host else 1)


def _choose_store_sharing(plan: LaunchPlan, environ: Mapping[str, str]) -> None:
    """Give every worker attempt a fresh store when the worker group can be restarted.

    Since torch 2.5 the c10d agent shares its TCPStore with the workers and keeps it across restarts, so restarted
    workers can read the previous attempt's keys (gloo/NCCL addresses) and fail to connect (pytorch#135712; seen
    here with gloo on torch 2.13). Opting out makes rank 0 of each attempt host a new store, as before torch 2.5.
    """
    var = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    restarts_possible = plan.max_restarts > 0 or plan.min_nodes < plan.max_nodes
    if var in environ:
        plan.env_kept[var] = environ[var]
    elif plan.backend == "c10d" and restarts_possible:
        plan.env_set[var] = "1"


def _describe_listeners(plan: LaunchPlan) -> None:
    """Say truthfully who can connect to the stores (unauthenticated): meshrun binds the ones torch lets it bind."""
    where = "loopback (127.0.0.1) only: no other host can connect" if plan.single_host else \
        f"{plan.local_addr} only"
    if plan.backend == "c10d":
        own = "rendezvous and workers' stores" if plan.store_here else "workers' store, if this node gets rank 0,"
        plan.listens = f"{own} on {where}"
        if plan.target.kind != "meshrun" and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in plan.env_set:
            plan.listens = (f"rendezvous store on {where}; but rank 0 of your script hosts its own store with "
                            "torch's env://, which listens on every interface (torch has no bind option there)")
    elif plan.backend == "static":
        plan.listens = (f"every interface: torch's static rendezvous store has no bind option; block port "
                        f"{plan.endpoint_port} from other hosts (firewall), or use the c10d backend")
    else:
        plan.listens = f"decided by the {plan.backend} backend"
    if not plan.single_host:
        plan.listens += f"; gloo/NCCL sockets on {plan.iface or 'their own choice of interface'}"


def parse_rdzv_conf(text: str) -> dict[str, str]:
    """'a=1,b=2' -> {'a': '1', 'b': '2'} (torchrun's --rdzv-conf syntax)."""
    conf: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise LaunchUsageError(f"--rdzv-conf {text!r}: write key=value pairs separated by commas, e.g. "
                                   "join_timeout=300,is_host=1.")
        conf[key.strip()] = value.strip()
    return conf


def apply_plan(ns: argparse.Namespace, plan: LaunchPlan) -> None:
    """Write the decisions into torchrun's namespace (the form torch.distributed.run.config_from_args reads)."""
    ns.standalone = False
    ns.nnodes = f"{plan.min_nodes}:{plan.max_nodes}"
    ns.rdzv_backend = plan.backend
    ns.rdzv_endpoint = plan.endpoint
    ns.rdzv_id = plan.rdzv_id
    ns.rdzv_conf = ",".join(f"{key}={value}" for key, value in plan.rdzv_conf.items())
    ns.node_rank = plan.node_rank if plan.backend == "static" else 0  # c10d assigns it (and torch warns otherwise)
    ns.local_addr = plan.local_addr
    ns.master_port = ns.master_port or STATIC_DEFAULT_PORT  # torch >= 2.9 defaults it to None
    apply_target(ns, plan.target)


def format_plan(plan: LaunchPlan) -> str:
    """The short block printed at start: every decision and the reason for it."""
    nodes = str(plan.max_nodes) if plan.min_nodes == plan.max_nodes else f"{plan.min_nodes}..{plan.max_nodes}"
    if plan.max_nodes == 1:
        size = f"{nodes} node(s) x {plan.nproc} proc(s)" + (f" = {plan.nproc} workers" if plan.nproc.isdigit() else "")
    else:  # each node's agent brings its own --nproc-per-node; c10d adds them up (8 + 4 + 4 = 16)
        same = (f", {plan.max_nodes * int(plan.nproc)} if every node runs {plan.nproc}" if plan.nproc.isdigit()
                and plan.min_nodes == plan.max_nodes else "")
        size = f"{nodes} node(s), {plan.nproc} proc(s) on this node (world size: the sum over nodes{same})"
    store = {True: "hosted here", False: "joined", None: "backend's choice"}[plan.store_here]
    node = ("node rank assigned at rendezvous" if plan.backend == "c10d" else f"node rank {plan.node_rank}")
    lines = [f"meshrun launch: {size}; {node}",
             f"  target      {plan.target.describe()}",
             f"  rendezvous  {plan.backend} at {plan.endpoint} (id {plan.rdzv_id}), timeout {plan.timeout_s}s",
             f"  store       {store}: {plan.store_reason}",
             f"  listens     {plan.listens}",
             f"  this node   {plan.local_addr} on {plan.iface or '?'} ({plan.local_reason})",
             f"  restarts    up to {plan.max_restarts}"]
    if plan.placement is not None:
        lines.append(f"  {'from ' + plan.placement.title:<11} {plan.placement.describe()}")
    env_set = " ".join(f"{k}={v}" + (f" ({plan.env_why[k]})" if k in plan.env_why else "")
                       for k, v in plan.env_set.items()) or "nothing"
    why = "; socket interfaces left to gloo/NCCL (single host)" if plan.single_host else ""
    lines.append(f"  env set     {env_set}{why}")
    if plan.env_kept:
        lines.append(f"  env kept    {' '.join(f'{k}={v}' for k, v in plan.env_kept.items())} (yours)")
    lines += [f"  note        {note}" for note in plan.notes]
    return "\n".join(plan.label + line for line in lines)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
