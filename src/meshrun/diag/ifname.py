"""``NCCL_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` for ``meshrun doctor``: the interfaces a user named exist on each
node, the routes to the other nodes leave through them, and gloo was not given NCCL's syntax.

The two variables read differently:

* NCCL: a comma-separated list of name *prefixes*; ``=`` before the list asks for exact names, ``^`` excludes
  (``^lo,docker`` means every interface not starting with lo or docker).
* gloo (torch's ProcessGroupGloo): a comma-separated list of exact interface names. ``^lo`` is taken as the name
  of an interface called "^lo", and creating the group fails.

Pure logic apart from reading interfaces and routes (meshrun.launch.net).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from meshrun.diag.rows import FAIL, PASS, WARN, CheckRow, node_label
from meshrun.launch import net

NCCL_VAR, GLOO_VAR = "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"


def nccl_matches(spec: str, interfaces: list[str]) -> list[str]:
    """Interfaces NCCL would consider for ``spec`` (prefix list; ``^`` excludes; ``=`` exact)."""
    exclude = spec.startswith("^")
    body = spec[1:] if exclude else spec
    exact = body.startswith("=")
    names = [n for n in (body[1:] if exact else body).split(",") if n]
    hit = lambda iface: any(iface == n if exact else iface.startswith(n) for n in names)  # noqa: E731
    return [iface for iface in interfaces if hit(iface) != exclude]


def gloo_error(spec: str, interfaces: list[str]) -> str | None:
    """Why gloo would refuse ``spec``, or None."""
    if spec.startswith(("^", "=")):
        return (f"{GLOO_VAR}={spec} uses NCCL's {spec[0]!r} syntax, which gloo does not understand (it looks for "
                f"an interface literally called {spec.split(',')[0]!r})")
    missing = [n for n in spec.split(",") if n and n not in interfaces]
    return f"{GLOO_VAR}={spec}: no interface {', '.join(missing)} on this node" if missing else None


@dataclass(frozen=True)
class IfnameFacts:
    node: int
    host: str
    interfaces: tuple[str, ...]
    nccl: str | None
    gloo: str | None
    routes: tuple[tuple[int, str, str | None], ...] = ()
    """(other node, its address, the interface this node's route to it leaves through)."""


def local_facts(environ: Mapping[str, str], *, node: int, host: str,
                peers: Mapping[int, str] | None = None) -> IfnameFacts:
    """This node's interfaces and set variables, and the route to each peer address (``{node: address}``)."""
    routes = []
    for other, addr in sorted((peers or {}).items()):
        if other == node:
            continue
        try:
            routes.append((other, addr, net.route_to(addr).iface))
        except net.EndpointError:
            routes.append((other, addr, None))
    return IfnameFacts(node=node, host=host, interfaces=tuple(net.interface_addresses()),
                       nccl=environ.get(NCCL_VAR) or None, gloo=environ.get(GLOO_VAR) or None, routes=tuple(routes))


def repair_gloo(environ: MutableMapping[str, str], *, master_addr: str) -> str | None:
    """Replace a GLOO_SOCKET_IFNAME that gloo would refuse with the interface of the route to the master (or
    remove it), so that doctor's own gloo group can still start and report it; returns the refused value (None
    when it was fine or unset)."""
    spec = environ.get(GLOO_VAR)
    if not spec or not gloo_error(spec, list(net.interface_addresses())):
        return None
    try:
        iface = net.route_to(master_addr).iface
    except net.EndpointError:
        iface = None
    if iface:
        environ[GLOO_VAR] = iface
    else:
        environ.pop(GLOO_VAR)
    return spec


def judge_ifnames(nodes: list[IfnameFacts]) -> CheckRow:
    """One row for both variables on every node."""
    problems: list[tuple[IfnameFacts, str]] = []
    warnings: list[tuple[IfnameFacts, str]] = []
    for n in nodes:
        if n.gloo and (err := gloo_error(n.gloo, list(n.interfaces))):
            problems.append((n, err))
        if n.nccl:
            matched = nccl_matches(n.nccl, list(n.interfaces))
            if not matched:
                problems.append((n, f"{NCCL_VAR}={n.nccl} matches no interface (it has {', '.join(n.interfaces)})"))
            for other, addr, iface in n.routes:
                if iface is not None and iface not in matched and iface != "lo":
                    warnings.append((n, f"its route to node {other} ({addr}) leaves through {iface}, which "
                                        f"{NCCL_VAR}={n.nccl} excludes"))
                elif iface is None:
                    problems.append((n, f"no route to node {other} ({addr})"))
    if not problems and not warnings:
        set_vars = sorted({f"{v}={s}" for n in nodes for v, s in ((NCCL_VAR, n.nccl), (GLOO_VAR, n.gloo)) if s})
        return CheckRow("socket interface", PASS, ", ".join(set_vars) + " valid on every node" if set_vars
                        else "NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME not set: the route to the master decides")
    bad = problems + warnings
    hosts = tuple(dict.fromkeys(n.host for n, _ in bad))
    routed = {n.host: iface for n, _ in bad for _, _, iface in n.routes if iface and iface != "lo"}
    names = (f" ({', '.join(f'{host}: {iface}' for host, iface in routed.items())}, the interfaces of their routes "
             "to the other nodes)") if routed else " (e.g. eth0)"
    return CheckRow("socket interface", FAIL if problems else WARN,
                    "; ".join(f"{node_label(n.node, n.host)}: {why}" for n, why in bad),
                    fix=f"set {GLOO_VAR} to one exact interface name{names} and {NCCL_VAR} to a prefix or "
                        "^exclusion that matches the NIC the nodes reach each other through",
                    next_command="ip -br addr and `ip route get <other node's address>` on " + ", ".join(hosts),
                    hosts=hosts)
