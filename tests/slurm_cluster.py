"""A real two-node Slurm (Debian's slurmctld, slurmd, munge) on this machine, for integration tests.

Layout: a bridge in the root namespace carries slurmctld's address (10.79.X.254); two network namespaces n1 and n2
(10.79.X.1, .2) each run one slurmd, started with ``nsenter --net`` plus ``unshare --mount --uts`` (``ip netns exec``
remounts /sys, and slurmd then fails on /sys/fs/cgroup), with their own hostname and a private /etc/hosts bind-mounted
over the real one. munged listens on a socket in the cluster folder. Everything (slurm.conf, key, state, logs) lives
in one temporary folder, which the client commands find through SLURM_CONF, so no system file is written. The
cluster stops exactly the daemons it started, SIGKILLs what is left in its namespaces, and deletes its links.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.launch.net import free_port

DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "nsenter", "unshare", "ip")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot start on this machine; the message says why."""


@dataclass
class SlurmCluster:
    folder: Path
    tag: str
    subnet: str
    """First three octets, e.g. '10.79.17'."""
    procs: list[subprocess.Popen] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    def env(self) -> dict[str, str]:
        """This process's environment plus SLURM_CONF: what sbatch/squeue/scontrol need to find this cluster."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def job_state(self, job_id: str) -> str:
        out = self.run("scontrol", "show", "job", job_id).stdout
        for word in out.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float) -> str:
        """Poll until the job leaves PENDING/RUNNING/COMPLETING (or the timeout); returns its state."""
        deadline = time.monotonic() + timeout
        state = self.job_state(job_id)
        while state in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "UNKNOWN") and time.monotonic() < deadline:
            time.sleep(1)
            state = self.job_state(job_id)
        return state

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.folder.glob("*.log")))

    def stop(self) -> None:
        """Cancel jobs, stop the daemons this cluster started, kill what is left in its namespaces, delete links."""
        if self.conf.exists():
            subprocess.run(["scancel", "--full", "-u", "root"], env=self.env(), capture_output=True, timeout=20)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), 9)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for link in self.links:
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        self.conf.unlink(missing_ok=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SlurmUnavailable(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")


def missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


def start_cluster(folder: Path) -> SlurmCluster:
    """Build the network, write the config, start munged, slurmctld and two slurmd; wait until both nodes are idle.

    Raises SlurmUnavailable (after cleaning up) when any part cannot start.
    """
    if os.geteuid() != 0:
        raise SlurmUnavailable("starting slurmctld/slurmd and network namespaces needs root")
    if missing := missing_tools():
        raise SlurmUnavailable(f"not installed: {', '.join(missing)} (apt install slurmctld slurmd slurm-client munge)")
    pid = os.getpid()
    cluster = SlurmCluster(folder=folder, tag=f"mrs{pid % 100000}", subnet=f"10.79.{pid % 250}")
    try:
        _build_network(cluster)
        _write_files(cluster)
        _start_daemons(cluster)
        _wait_idle(cluster, timeout=60)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _build_network(cluster: SlurmCluster) -> None:
    bridge = f"{cluster.tag}br"
    _ip("link", "add", bridge, "type", "bridge")
    cluster.links.append(bridge)
    _ip("addr", "add", f"{cluster.subnet}.254/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    for index in (1, 2):
        ns, outer, inner = f"{cluster.tag}n{index}", f"{cluster.tag}o{index}", f"{cluster.tag}i{index}"
        _ip("netns", "add", ns)
        cluster.namespaces.append(ns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        cluster.links.append(outer)
        _ip("link", "set", outer, "master", bridge)
        _ip("link", "set", outer, "up")
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{cluster.subnet}.{index}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")


def _write_files(cluster: SlurmCluster) -> None:
    folder, net = cluster.folder, cluster.subnet
    for sub in ("state", "spool/n1", "spool/n2", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(folder / "munge", 0o711)  # clients need to reach the socket; the key stays root's
    key = folder / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o400)
    ctl = socket.gethostname()  # slurmctld only starts on the host that SlurmctldHost names
    (folder / "hosts").write_text(f"127.0.0.1 localhost\n{net}.254 {ctl}\n{net}.1 n1\n{net}.2 n2\n")
    ctl_port, slurmd_port = free_port("0.0.0.0"), free_port("0.0.0.0")
    cluster.conf.write_text(f"""\
ClusterName=meshrun{cluster.tag}
SlurmctldHost={ctl}({net}.254)
MailProg=/bin/true
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={folder}/state
SlurmdSpoolDir={folder}/spool/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=30
OverTimeLimit=0
MinJobAge=600
InactiveLimit=0
MpiDefault=none
SlurmdParameters=config_overrides
NodeName=n1 NodeAddr={net}.1 CPUs=8 RealMemory=1000 State=UNKNOWN
NodeName=n2 NodeAddr={net}.2 CPUs=8 RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
""")


def _start_daemons(cluster: SlurmCluster) -> None:
    folder = cluster.folder
    munge = folder / "munge"
    cluster.procs.append(subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={munge}/munge.sock", f"--key-file={munge}/munge.key",
         f"--pid-file={munge}/munged.pid", f"--log-file={folder}/munged.log", f"--seed-file={munge}/seed"],
        stdout=subprocess.DEVNULL, stderr=open(folder / "munged.err.log", "w")))
    _wait_for(lambda: (munge / "munge.sock").exists(), 10, "munged did not create its socket", cluster)
    cluster.procs.append(subprocess.Popen(["slurmctld", "-D", "-c", "-i", "-f", str(cluster.conf)],
                                          stdout=subprocess.DEVNULL, stderr=open(folder / "slurmctld.err.log", "w")))
    for index in (1, 2):
        ns, node = f"{cluster.tag}n{index}", f"n{index}"
        inner = (f"mount --bind {folder}/hosts /etc/hosts && hostname {node} && "
                 f"exec slurmd -D -N {node} -f {cluster.conf}")
        cluster.procs.append(subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--uts", "sh", "-c", inner],
            stdout=subprocess.DEVNULL, stderr=open(folder / f"slurmd-{node}.err.log", "w")))


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    def idle() -> bool:
        for proc in cluster.procs:
            if proc.poll() is not None:
                raise SlurmUnavailable(f"{proc.args[0]} exited with code {proc.returncode}:\n{cluster.logs()}")
        out = cluster.run("sinfo", "-h", "-N", "-o", "%N %t").stdout.split()
        return out.count("idle") == 2

    _wait_for(idle, timeout, "the two slurmd did not become idle", cluster)


def _wait_for(check, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SlurmUnavailable(f"{what} within {timeout:.0f}s:\n{cluster.logs()}")
        time.sleep(0.5)
