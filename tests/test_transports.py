"""The local, ssh and pct transports against real processes, a real sshd on 127.0.0.1
and the strict fake pct (tests/support)."""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_cli.errors import DflashError, UnreachableError
from dflash_cli.inventory import load_inventory
from dflash_cli.transports import CommandFailed, open_transport
from dflash_cli.transports.ssh import SshTransport
from support import keygen, kill_ssh_sessions, wait_until
from support.wait import FIRST_INTERVAL_S
from support.pve import BARE_CONTAINER, CONTAINERS, GPU_CONTAINER

pytestmark = pytest.mark.timeout(60)

PY = sys.executable  # the same interpreter on the node and in the fake containers
ALL = ["local", "node", "ct200"]
REMOTE = ["node", "ct200"]
#: the same hosts through the in-process client (Fabric on paramiko: the fallback
#: without an OpenSSH client); every test of the hosts' behaviour runs on both clients
PARAMIKO = ["node:paramiko", "ct200:paramiko"]

AWKWARD_ARGS = [
    "two words", "it's", 'say "hi"', "$HOME", "${PATH}", "`id`", "$(id)", "a\nb\n", "tab\there",
    "ünïcødé ✓", "", " ", "*", "~", "~/x", ";", "&&", "|", "\\", "-n", "--", "'", '"', "#not a comment",
]


@pytest.fixture
def hosts(make_inventory, tmp_path):
    return load_inventory(make_inventory(tmp_path))


@pytest.fixture
def connect(hosts):
    """connect(name, **kwargs) -> an open transport, closed after the test."""
    opened = []

    def connect(name, inventory=None, **kwargs):
        name, _, client = name.partition(":")
        host = (inventory or hosts).get(name)
        transport = open_transport(dataclasses.replace(host, ssh_client=client) if client else host, **kwargs)
        opened.append(transport)
        return transport

    yield connect
    for transport in opened:
        transport.close()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


# -- argv, stdin, stdout -----------------------------------------------------------------


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_awkward_argv_arrives_unchanged(connect, name):
    transport = connect(name)
    echo_argv = "import json, sys; sys.stdout.write(json.dumps(sys.argv[1:]))"
    done = transport.run([PY, "-c", echo_argv, *AWKWARD_ARGS])
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout) == AWKWARD_ARGS
    assert done.argv == (PY, "-c", echo_argv, *AWKWARD_ARGS)


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_megabytes_of_binary_stdin_and_stdout_arrive_intact(connect, name):
    transport = connect(name)
    payload = os.urandom(6 * 1024 * 1024 + 123)
    digest = hashlib.sha256(payload).hexdigest()
    hashed = transport.run([PY, "-c", "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())"],
                           stdin=payload)
    assert hashed.stdout.decode().strip() == digest
    # stdin from a file object while the same bytes stream back: both directions move at
    # once, or the channel window fills and this hangs
    echoed = transport.run(["cat"], stdin=io.BytesIO(payload))
    assert echoed.exit_code == 0
    assert hashlib.sha256(echoed.stdout).hexdigest() == digest
    assert transport.bytes_sent == 2 * len(payload)
    assert transport.bytes_received >= len(payload) + 64
    assert transport.round_trips == 2


class _BreaksAfter(io.RawIOBase):
    """A readable input that fails after `good` bytes, as a disk or a tar builder might."""

    def __init__(self, good: int):
        self.left = good

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.left <= 0:
            raise OSError(5, "Input/output error")
        count = min(len(buffer), self.left)
        buffer[:count] = b"x" * count
        self.left -= count
        return count


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_input_that_breaks_off_fails_the_call_instead_of_hanging(connect, name):
    transport = connect(name)
    with pytest.raises(DflashError, match="reading its input failed: .*Input/output error"):
        transport.run(["cat"], stdin=io.BufferedReader(_BreaksAfter(300_000)))
    assert transport.run(["echo", "fine"]).stdout == b"fine\n"


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_exit_code_and_stderr_are_the_commands_own(connect, name):
    done = connect(name).run(["sh", "-c", "echo out; echo 'went wrong' >&2; exit 7"])
    assert (done.exit_code, done.stdout, done.stderr) == (7, b"out\n", b"went wrong\n")


@pytest.mark.parametrize("name,expected", [("local", 127), ("node", 127), ("ct200", 255),
                                           ("node:paramiko", 127), ("ct200:paramiko", 255)])
def test_a_missing_program_is_an_exit_code_not_an_exception(connect, name, expected):
    # a shell says 127; lxc-attach (behind pct exec) fails the exec with 255
    done = connect(name).run(["dflash-no-such-program", "x"])
    assert done.exit_code == expected
    assert b"dflash-no-such-program" in done.stderr


@pytest.mark.parametrize("name,expected", [("local", 128 + 9), ("node", 255), ("ct200", 255),
                                           ("node:paramiko", 255), ("ct200:paramiko", 255)])
def test_command_killed_by_a_signal_is_not_a_lost_connection(connect, name, expected):
    # sshd reports a signal instead of an exit status; the connection is still fine
    transport = connect(name)
    assert transport.run(["sh", "-c", "kill -9 $$"]).exit_code == expected
    assert transport.run(["true"]).exit_code == 0


@pytest.mark.parametrize("name", ["local", "node", "node:paramiko"])
def test_run_timeout_gives_up_and_the_transport_stays_usable(connect, name):
    transport = connect(name)
    # Had the timeout been ignored, the call would return sleep's exit status 0 instead.
    with pytest.raises(UnreachableError, match="did not finish within 0.5 s"):
        transport.run(["sleep", "3"], timeout=0.5)
    assert transport.run(["echo", "still here"]).stdout == b"still here\n"


# -- streaming ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_stream_yields_each_line_as_it_is_printed(connect, name, tmp_path):
    # The command prints its last line only once the test has received the first: a stream
    # that held lines back would get "given up" (after the command's own minute) instead.
    # tmp_path is outside the containers' mount point: they see it as the node does.
    go = tmp_path / "first line received"
    program = ("import os, sys, time\nprint('first', flush=True)\ndeadline = time.monotonic() + 60\n"
               "while not os.path.exists(sys.argv[1]):\n"
               "    if time.monotonic() > deadline: print('given up', end=''); sys.exit()\n"
               "    time.sleep(0.02)\nprint('done', end='')")
    lines = connect(name).stream([PY, "-c", program, str(go)])
    assert next(lines) == b"first\n"
    go.touch()
    assert list(lines) == [b"done"]  # a last line without a newline still arrives


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_stream_of_a_failing_command_raises_with_its_stderr(connect, name):
    lines = connect(name).stream(["sh", "-c", "echo partial; echo 'no such run' >&2; exit 2"])
    assert next(lines) == b"partial\n"
    with pytest.raises(CommandFailed, match="no such run") as failed:
        next(lines)
    assert failed.value.status == 2


@pytest.mark.parametrize("name", ALL + PARAMIKO)
def test_closing_a_stream_ends_the_remote_command(connect, name):
    program = "import os, time\nprint(os.getpid(), flush=True)\nfor i in range(600):\n    time.sleep(0.05); print(i, flush=True)"
    lines = connect(name).stream([PY, "-c", program])
    pid = int(next(lines))
    assert not _gone(pid)
    lines.close()
    wait_until(lambda: _gone(pid), what="the remote command to end with its closed stream")


@pytest.mark.parametrize("name", REMOTE + PARAMIKO[:1])
def test_connection_dying_mid_stream_raises_then_the_next_call_reconnects(connect, ssh_node, name):
    transport = connect(name)
    assert transport.run(["true"]).exit_code == 0
    logins = ssh_node.accepted_logins()
    channels = []
    if isinstance(transport, SshTransport):  # paramiko: keep the channel, to see what waits in it
        real_exec = transport._exec

        def exec_keeping_the_channel(argv):  # the real call; the test only keeps its channel
            channels.append(real_exec(argv))
            return channels[-1]

        transport._exec = exec_keeping_the_channel
    # a whole line and half of one in one write; it writes again (and dies of EPIPE) after 30 s
    program = "import sys, time\nsys.stdout.write('0\\nhalf'); sys.stdout.flush()\ntime.sleep(30); print()"
    received_before = transport.bytes_received
    lines = transport.stream([PY, "-c", program])
    assert next(lines) == b"0\n"
    # "half" is on this side: read with the first line (the OpenSSH client passes the one
    # write on as one), or waiting in paramiko's channel
    wait_until(lambda: transport.bytes_received - received_before >= len(b"0\nhalf")
               or (channels and channels[0].recv_ready()), what="the half line to reach the client",
               interval=FIRST_INTERVAL_S)
    assert kill_ssh_sessions(ssh_node) > 0
    after_the_drop = []
    with pytest.raises(UnreachableError, match="connection lost"):
        for line in lines:
            after_the_drop.append(line)
    assert after_the_drop == []  # the cut-off half line is not passed on as if it were whole
    assert transport.run(["echo", "back"]).stdout == b"back\n"
    assert ssh_node.accepted_logins() == logins + 1


# -- one connection ----------------------------------------------------------------------


@pytest.mark.parametrize("name", REMOTE + PARAMIKO)
def test_many_commands_share_one_connection(connect, ssh_node, name):
    logins = ssh_node.accepted_logins()
    transport = connect(name)
    seen = {transport.run(["printenv", "SSH_CLIENT"]).stdout for _ in range(6)}
    assert ssh_node.accepted_logins() == logins + 1
    assert transport.round_trips == 6
    if name.startswith("node"):
        (client,) = seen  # one source port: one TCP connection
        assert client.split()[2] == str(ssh_node.port).encode()
    else:
        assert seen == {b""}  # pct exec clears the environment, as lxc-attach --clear-env does


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and text.encode() in Path(entry.path, "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass  # exited meanwhile
    return found


def test_closing_the_transport_ends_its_master_connection(connect, ssh_node):
    transport = connect("node")
    assert transport.run(["true"]).exit_code == 0
    folder = transport._folder  # the master's ControlPath is in it: its command line names it
    masters = _processes_mentioning(folder)
    assert masters and all(not _gone(pid) for pid in masters)
    transport.close()
    wait_until(lambda: all(_gone(pid) for pid in masters), what="the master to end with close()")
    assert not os.path.exists(folder)


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_threads_can_run_commands_on_one_transport_at_once(connect, ssh_node, name):
    logins = ssh_node.accepted_logins()
    transport = connect(name)
    results: dict[int, bytes] = {}

    def work(index: int) -> None:
        results[index] = transport.run(["echo", str(index)]).stdout

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {i: f"{i}\n".encode() for i in range(8)}
    assert ssh_node.accepted_logins() == logins + 1


# -- host keys and addressing --------------------------------------------------------------


def _fingerprint_by_ssh_keygen(known_hosts: Path) -> str:
    out = subprocess.run(["ssh-keygen", "-l", "-f", str(known_hosts)], capture_output=True, text=True, check=True)
    return out.stdout.split()[1]


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_unknown_host_key_is_refused_unless_accepted(make_inventory, connect, ssh_node, tmp_path, name):
    known = tmp_path / "fresh ssh" / "known_hosts"
    hosts = load_inventory(make_inventory(tmp_path, node={"known_hosts": str(known)}))
    with pytest.raises(UnreachableError) as refused:
        connect(name, hosts).run(["true"])
    message = refused.value.message
    assert "host node" in message and "unknown" in message and str(known) in message
    assert _fingerprint_by_ssh_keygen(ssh_node.known_hosts) in message
    assert "--accept-new-host-key" in refused.value.hint and "host_key: accept-new" in refused.value.hint
    assert not known.exists()

    assert connect(name, hosts, accept_new_host_key=True).run(["true"]).exit_code == 0
    assert known.read_text() == f"{ssh_node.known_hosts_name} {ssh_node.host_key_line}\n"
    assert connect("node", hosts).run(["true"]).exit_code == 0  # now known: strict mode connects


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_inventory_host_key_accept_new_records_the_key(make_inventory, connect, ssh_node, tmp_path, name):
    known = tmp_path / "known_hosts"
    known.write_text("# kept\n[example.invalid]:22 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIP0HCBpvAu2K4hTmnBNXjs0ZgEd6WW6eZVuNXAhNAM8v")
    hosts = load_inventory(make_inventory(tmp_path, node={"known_hosts": str(known), "host_key": "accept-new"}))
    assert connect(name, hosts).run(["true"]).exit_code == 0
    lines = known.read_text().splitlines()
    assert lines[:2] == ["# kept", "[example.invalid]:22 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIP0HCBpvAu2K4hTmnBNXjs0ZgEd6WW6eZVuNXAhNAM8v"]
    assert lines[2:] == [f"{ssh_node.known_hosts_name} {ssh_node.host_key_line}"]


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_changed_host_key_is_refused_even_when_accepting_new_keys(make_inventory, connect, ssh_node, tmp_path, name):
    impostor = keygen(tmp_path / "impostor", "impostor").split()
    known = tmp_path / "known_hosts"
    known.write_text(f"{ssh_node.known_hosts_name} {impostor[0]} {impostor[1]}\n")
    before = known.read_text()
    hosts = load_inventory(make_inventory(tmp_path, node={"known_hosts": str(known)}))
    with pytest.raises(UnreachableError, match="CHANGED") as refused:
        connect(name, hosts, accept_new_host_key=True).run(["true"])
    assert _fingerprint_by_ssh_keygen(ssh_node.known_hosts) in refused.value.message
    assert known.read_text() == before


def _ssh_config(home: Path, text: str) -> Path:
    """A client config made by the test (never the machine's ~/.ssh), given to dflash
    the way a user gives another one: DFLASH_SSH_CONFIG (ssh -F)."""
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".ssh" / "config").write_text(text)
    return home / ".ssh" / "config"


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_ssh_config_alias_supplies_address_user_port_and_key(make_inventory, connect, ssh_node, tmp_path, monkeypatch,
                                                             name):
    home = tmp_path / "home"
    _ssh_config(home, f"Host dflash-test-node\n    HostName {ssh_node.address}\n    Port {ssh_node.port}\n"
                      f"    User {ssh_node.user}\n    IdentityFile {ssh_node.identity_file}\n")
    monkeypatch.setenv("DFLASH_SSH_CONFIG", str(home / ".ssh" / "config"))
    hosts = load_inventory(make_inventory(tmp_path, node={"ssh": "dflash-test-node", "identity_file": None}))
    done = connect(name, hosts).run(["printenv", "SSH_CONNECTION"])
    assert done.stdout.split()[3] == str(ssh_node.port).encode()


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_every_proxyjump_hop_has_its_host_key_checked(make_inventory, connect, ssh_node, tmp_path, monkeypatch, name):
    # each hop reads the known_hosts file its own block of the config names
    home = tmp_path / "home"
    behind_only, both = tmp_path / "behind_only", tmp_path / "both"
    behind_only.write_text(f"[{ssh_node.address}]:{ssh_node.alt_port} {ssh_node.host_key_line}\n")
    both.write_text(behind_only.read_text() + f"{ssh_node.known_hosts_name} {ssh_node.host_key_line}\n")
    for jump_known, reached in ((behind_only, False), (both, True)):
        hop = f"    HostName {ssh_node.address}\n    User root\n    IdentityFile {ssh_node.identity_file}\n"
        _ssh_config(home, f"Host dflash-jump\n{hop}    Port {ssh_node.port}\n    UserKnownHostsFile {jump_known}\n"
                          f"Host dflash-behind\n{hop}    Port {ssh_node.alt_port}\n    ProxyJump dflash-jump\n"
                          f"    UserKnownHostsFile {behind_only}\n")
        monkeypatch.setenv("DFLASH_SSH_CONFIG", str(home / ".ssh" / "config"))
        hosts = load_inventory(make_inventory(tmp_path, node={"ssh": "dflash-behind", "identity_file": None,
                                                              "known_hosts": None}))
        if not reached:
            with pytest.raises(UnreachableError, match="unknown") as refused:
                connect(name, hosts).run(["true"])
            assert "dflash-jump" in refused.value.message  # the hop whose key is not on record
            continue
        done = connect(name, hosts).run(["printenv", "SSH_CONNECTION"])
        assert done.stdout.split()[3] == str(ssh_node.alt_port).encode()  # reached through the jump


# -- unreachable hosts ---------------------------------------------------------------------


@pytest.mark.parametrize("name", ["down", "down:paramiko"])
def test_closed_port_is_unreachable_at_once(connect, name):
    with pytest.raises(UnreachableError, match="host down .* connection refused") as refused:
        connect(name).run(["true"])
    assert refused.value.exit_code == 3


@pytest.mark.parametrize("name", ["down", "down:paramiko"])
def test_silent_server_times_out_after_connect_timeout(make_inventory, connect, tmp_path, name):
    with socket.socket() as silent:  # accepts TCP connections, never says a word
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        hosts = load_inventory(make_inventory(tmp_path, down={"ssh": f"root@127.0.0.1:{port}", "connect_timeout": 0.5}))
        # Had connect_timeout been ignored, the call would wait for the silent server forever
        # (until pytest's timeout) instead of raising this.
        with pytest.raises(UnreachableError, match=r"host down .* no SSH answer within 0.5 s"):
            connect(name, hosts).run(["true"])


@pytest.mark.parametrize("name", ["node", "node:paramiko"])
def test_key_the_server_does_not_know_fails_authentication(make_inventory, connect, tmp_path, name):
    keygen(tmp_path / "stranger", "stranger")
    hosts = load_inventory(make_inventory(tmp_path, node={"identity_file": str(tmp_path / "stranger")}))
    with pytest.raises(UnreachableError, match="authentication failed"):
        connect(name, hosts).run(["true"])


@pytest.mark.parametrize("name,problem", [("ct201", "container 201 on .* is not running"),
                                          ("ct999", "container 999 on .* does not exist"),
                                          ("ct201:paramiko", "container 201 on .* is not running"),
                                          ("ct999:paramiko", "container 999 on .* does not exist")])
def test_stopped_or_unknown_container_is_unreachable(connect, name, problem):
    transport = connect(name)
    with pytest.raises(UnreachableError, match=problem):
        transport.run(["true"])
    with pytest.raises(UnreachableError, match=problem):
        list(transport.stream(["true"]))


@pytest.mark.parametrize("name", ["ct200", "ct200:paramiko"])
def test_a_command_exiting_255_in_a_container_is_its_own(connect, name):
    done = connect(name).run(["sh", "-c", "echo 'CT 201 not running' >&2; exit 255"])
    assert done.exit_code == 255  # another container's name in the message: not ours


@pytest.mark.parametrize("name", ["ct200", "ct200:paramiko"])
def test_missing_pct_on_the_node_is_named(make_inventory, connect, tmp_path, name):
    hosts = load_inventory(make_inventory(tmp_path, ct200={"pct": "/nonexistent/pct"}))
    with pytest.raises(UnreachableError, match="/nonexistent/pct` was not found"):
        connect(name, hosts).run(["true"])


# -- the container's own filesystem view -----------------------------------------------------


def test_the_container_sees_its_own_filesystem(connect, fake_pve):
    inside = fake_pve.mount_point / "probe dir" / "written inside.txt"
    container, node = connect("ct200"), connect("node")
    write = "import pathlib, sys; p = pathlib.Path(sys.argv[1]); p.parent.mkdir(); p.write_text('hello')"
    assert container.run([PY, "-c", write, str(inside)]).exit_code == 0
    assert container.read_file(str(inside)) == b"hello"
    assert fake_pve.on_node(200, inside).read_text() == "hello"  # in the container's root folder
    assert fake_pve.node_leaks() == []  # and not on the node
    with pytest.raises(DflashError, match="cannot read"):
        node.read_file(str(inside))
    # the same path written on the node lands where the fixture looks for leaks
    mistaken = fake_pve.mount_point / "written on the node"
    assert node.run(["touch", str(mistaken)]).exit_code == 0
    assert fake_pve.node_leaks() == ["written on the node"]
    mistaken.unlink()
    environment = container.run(["env"]).stdout.decode().splitlines()
    assert sorted(line.split("=")[0] for line in environment) == ["HOME", "LANG", "PATH"]
    assert container.run(["pwd"]).stdout == b"/\n"


def test_fake_pct_accepts_only_proxmox_forms(fake_pve):
    def pct(*args):
        return subprocess.run([str(fake_pve.pct), *args], capture_output=True, text=True)

    assert pct("status", "200").stdout == "status: running\n"
    assert pct("status", "201").stdout == "status: stopped\n"
    listed = pct("list").stdout.splitlines()
    assert listed[0].split() == ["VMID", "Status", "Lock", "Name"]
    expected = dict(CONTAINERS)
    for added in (BARE_CONTAINER, GPU_CONTAINER):  # added by a test that used it
        if (fake_pve.root / "lxc" / f"{added}.conf").exists():
            expected[added] = "running"
    assert [line.split() for line in listed[1:]] == [[str(vmid), status, f"ct{vmid}"]
                                                     for vmid, status in sorted(expected.items())]
    unknown = pct("status", "999")
    assert (unknown.returncode, unknown.stderr) == (
        255, f"Configuration file 'nodes/{fake_pve.node_name}/lxc/999.conf' does not exist\n")
    assert (pct("exec", "201", "--", "true").returncode, pct("exec", "201", "--", "true").stderr) == (
        255, "CT 201 not running\n")
    for wrong in [("exec", "200", "true"), ("exec", "200", "--"), ("exec", "abc", "--", "true"), ("exec",),
                  ("enter", "200"), ()]:
        result = pct(*wrong)
        assert result.returncode == 255, wrong
        assert result.stdout == "" and result.stderr, wrong
    assert pct("exec", "200", "--", "true").returncode == 0
