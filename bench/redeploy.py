"""Re-deploy cost over the pct transport (sshd on 127.0.0.1 + the fake pct), beside
`rsync -a` through the same two hops (ssh to the node, then `pct exec 200 --`).

Measures: an unchanged tree (seconds, round trips) and a tree with one changed file
(bytes sent against the tree's size); then both as whole processes, what a user waits
for (interpreter start, imports, SSH handshake included): `dflash deploy ct200` against
`rsync -a` of the same tree, median of --whole runs each, without and with a
ControlMaster in the user's ssh config (given to both). dflash's figures come from its own transport
counters; rsync's from `--stats` ("Total bytes sent"). Prints numbers; asserts nothing.

The "node" shares this machine's cores with the client: the remote shell, pct and the
receiver (or rsync's server) compete for them with the client's own work. `--node-cores N`
pins sshd, and so everything a session runs, to the last N cores and this process, and so
every client it starts, to the others: two machines, as a user's laptop and GPU node
are, on one of more than N cores.

    sudo .venv/bin/python bench/redeploy.py [--repeat 5] [--whole 11] [--node-cores N]     (needs rsync installed)
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from testbed import test_bed

from support import copy_release_dirs

from dflash_cli import deployment, release
from dflash_cli.session import Session

RSH = """#!{python}
import os, shlex, sys
# rsync calls: RSH HOST rsync --server ...; the host is ours to ignore (two fixed hops).
# rsync has already escaped its arguments for the remote shell: joined as they are.
remote = shlex.join([{pct!r}, "exec", "200", "--"]) + " " + " ".join(sys.argv[2:])
config = os.environ.get("DFLASH_SSH_CONFIG")  # the same client config as dflash's
os.execvp("ssh", ["ssh", *(["-F", config] if config else []), "-p", "{port}", "-i", {key!r}, "-o", "UserKnownHostsFile=" + {known!r},
                  "-o", "BatchMode=yes", "root@{address}", remote])
"""


def changed_copy(work: Path) -> Path:
    root = copy_release_dirs(work / "checkout")
    (root / "configs" / "hosts.yaml").write_text((root / "configs" / "hosts.yaml").read_text() + "# changed\n")
    return root


def rsync(rsh: Path, source: Path, dest: str) -> tuple[float, int]:
    started = time.perf_counter()
    done = subprocess.run(["rsync", "-a", "--delete", "--stats", "-e", str(rsh), f"{source}/", f"ct:{dest}/"],
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"rsync failed ({done.returncode}): {done.stderr}")
    seconds = time.perf_counter() - started
    return seconds, int(re.search(r"Total bytes sent: ([\d,]+)", done.stdout).group(1).replace(",", ""))


def _median_ms(run: Callable[[], object], repeat: int) -> float:
    seconds = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds) * 1000


def whole_process(bed, rsh: Path, staged: Path, dest: str, repeat: int) -> None:
    """Unchanged tree, whole processes: `dflash deploy` as a user runs it beside rsync,
    without and with a ControlMaster in the user's ssh config (both clients use it)."""
    def deploy_process() -> None:
        done = bed.dflash("deploy", "ct200")
        if done.returncode:
            raise SystemExit(f"dflash deploy failed ({done.returncode}): {done.stderr}")

    rsync(rsh, staged, dest)  # the copy is current before timing
    # An installed dflash runs from cached bytecode; PYTHONDONTWRITEBYTECODE (set in some
    # environments) would compile every module on every start instead.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = str(bed.work / "pycache")
    user_config = bed.work / "ssh_config"
    control = tempfile.mkdtemp(prefix="cm")  # short: a socket path is at most ~100 bytes
    user_config.write_text(f"Host {bed.node.address}\n    ControlMaster auto\n    ControlPath {control}/%C\n"
                           f"    ControlPersist 60\n")
    rows = []
    for label, config in (("no ControlMaster", None), ("user ControlMaster", user_config)):
        if config:
            os.environ["DFLASH_SSH_CONFIG"] = str(config)
        deploy_process()  # warm: the master (if any) is up, as it is for a user who just used ssh
        rows.append((label, _median_ms(deploy_process, repeat), _median_ms(lambda: rsync(rsh, staged, dest), repeat)))
    os.environ.pop("DFLASH_SSH_CONFIG", None)
    subprocess.run(["ssh", "-F", str(user_config), "-p", str(bed.node.port), "-O", "exit", bed.node.address],
                   capture_output=True)
    shutil.rmtree(control, ignore_errors=True)
    print(f"\nwhole process, unchanged tree, median of {repeat} each:")
    print(f"{'ssh config':<20} {'dflash deploy':>14} {'rsync -a':>10} {'ratio':>7}")
    for label, dflash_ms, rsync_ms in rows:
        print(f"{label:<20} {dflash_ms:>11.0f} ms {rsync_ms:>7.0f} ms {dflash_ms / rsync_ms:>6.2f}x")


def separate_cores(sshd_pid: int, node_cores: int) -> None:
    """sshd on the last `node_cores` cores of this process's, this process on the rest (children inherit both)."""
    cores = sorted(os.sched_getaffinity(0))
    if not 0 < node_cores < len(cores):
        raise SystemExit(f"--node-cores {node_cores}: this process may use {len(cores)} core(s); "
                         "the node and the client need at least one each")
    node, client = cores[-node_cores:], cores[:-node_cores]
    os.sched_setaffinity(sshd_pid, node)
    os.sched_setaffinity(0, client)
    print(f"node (sshd {sshd_pid}) on core(s) {', '.join(map(str, node))}, client on {', '.join(map(str, client))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--whole", type=int, default=11, help="whole-process runs of each, for the medians")
    parser.add_argument("--node-cores", type=int, default=0,
                        help="the node (sshd and all it runs) on the last N cores, the client on the others")
    args = parser.parse_args()
    if not shutil.which("rsync"):
        raise SystemExit("rsync is not installed (apt-get install -y rsync)")
    with test_bed() as bed:
        if args.node_cores:
            separate_cores(bed.sshd_pid, args.node_cores)
        session = Session(str(bed.hosts), bed.logs)
        host = session.host("ct200")
        tree = release.scan()
        print(f"tree: {len(tree.files)} files, {tree.total_bytes} bytes")
        deployment.deploy_host(session, host, tree)
        unchanged = [deployment.deploy_host(session, host, tree) for _ in range(args.repeat)]
        print(f"dflash unchanged:  {statistics.median(r.seconds for r in unchanged) * 1000:.0f} ms median, "
              f"{unchanged[0].round_trips} round trip(s), {unchanged[0].bytes_sent} bytes sent")
        one = deployment.deploy_host(session, host, release.scan(changed_copy(bed.work)))
        print(f"dflash one change: {one.seconds * 1000:.0f} ms, {one.round_trips} round trips, "
              f"{one.files_sent} file / {one.bytes_sent} bytes sent "
              f"({100 * one.bytes_sent / tree.total_bytes:.1f}% of the tree)")
        session.close()

        rsh = bed.work / "rsh"
        rsh.write_text(RSH.format(python=sys.executable, pct=str(bed.pve.pct), port=bed.node.port,
                                  key=str(bed.node.identity_file), known=str(bed.node.known_hosts),
                                  address=bed.node.address))
        rsh.chmod(0o755)
        staged = copy_release_dirs(bed.work / "staged")
        dest = str(bed.workspace) + "/rsync-copy"
        bed.dflash("deploy", "ct200")  # makes the workspace inside the container
        rsync(rsh, staged, dest)
        runs = [rsync(rsh, staged, dest) for _ in range(args.repeat)]
        print(f"rsync unchanged:   {statistics.median(s for s, _ in runs) * 1000:.0f} ms median, "
              f"{runs[0][1]} bytes sent (one ssh connection + one pct exec per call)")
        (staged / "configs" / "hosts.yaml").write_text((staged / "configs" / "hosts.yaml").read_text() + "# changed\n")
        seconds, sent = rsync(rsh, staged, dest)
        print(f"rsync one change:  {seconds * 1000:.0f} ms, {sent} bytes sent "
              f"({100 * sent / tree.total_bytes:.1f}% of the tree)")
        whole_process(bed, rsh, staged, dest, args.whole)
        print("note: dflash verifies every file's sha256 on the host and switches `current` atomically; "
              "rsync -a updates files in place (no verification, no atomic switch)")


if __name__ == "__main__":
    main()
