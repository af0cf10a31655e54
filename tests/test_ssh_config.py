"""SSH targets resolve and connect as the user's OpenSSH client does with the same
config (a config file made by each test, given as DFLASH_SSH_CONFIG, i.e. `ssh -F`):
each case also runs the real `ssh` client and expects the same outcome. A case that
holds for both of dflash's SSH clients runs on each (`ssh_client`)."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_cli.cli import main
from dflash_cli.errors import UnreachableError
from dflash_cli.inventory import load_inventory
from dflash_cli.transports import open_transport
from support import keygen
from support.sshd import sign_user_key, start_sshd, stop_sshd

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not shutil.which("ssh"), reason="needs an OpenSSH client")]
#: the inventory's ssh_client values of the two clients: the `ssh` binary, in-process
BOTH_CLIENTS = ["openssh", "paramiko"]


@pytest.fixture
def ssh_client() -> str:
    """The inventory's ssh_client for `client`'s host (a test parametrizes it to run on both)."""
    return "openssh"


@pytest.fixture
def client(make_inventory, tmp_path, monkeypatch, ssh_client):
    """client(config_text) -> (transport to alias `dflash-t` through `ssh_client`, config path)."""
    opened = []

    def client(text: str):
        config = tmp_path / "ssh_config"
        config.write_text(text)
        monkeypatch.setenv("DFLASH_SSH_CONFIG", str(config))
        hosts = load_inventory(make_inventory(tmp_path, node={"ssh": "dflash-t", "identity_file": None,
                                                              "known_hosts": None, "ssh_client": ssh_client}))
        transport = open_transport(hosts.get("node"))
        opened.append(transport)
        return transport, config

    yield client
    for transport in opened:
        transport.close()


def openssh_connects(config: Path, env: dict | None = None) -> bool:
    """Whether the real ssh client, never prompting, gets in with `config`."""
    done = subprocess.run(["ssh", "-F", str(config), "-o", "BatchMode=yes", "dflash-t", "true"],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
                          env={**os.environ, **(env or {})})
    return done.returncode == 0


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_alias_in_an_included_file_with_match_host_and_user_known_hosts_file(client, ssh_node, tmp_path):
    included = tmp_path / "config.d"
    included.mkdir()
    # The key is in the second UserKnownHostsFile; the first does not exist.
    (included / "node.conf").write_text(
        f"Host dflash-t\n    HostName {ssh_node.address}\n    User root\n"
        f"Match host {ssh_node.address}\n    Port {ssh_node.port}\n    IdentityFile {ssh_node.identity_file}\n"
        f"    UserKnownHostsFile {tmp_path}/absent_known_hosts {ssh_node.known_hosts}\n")
    transport, config = client(f"Include {included}/*.conf\n")
    done = transport.run(["printenv", "SSH_CONNECTION"])
    assert done.exit_code == 0 and done.stdout.split()[3] == str(ssh_node.port).encode()
    assert openssh_connects(config)
    assert not (tmp_path / "absent_known_hosts").exists()


def _node_block(ssh_node, **options: str) -> str:
    lines = {"HostName": ssh_node.address, "Port": str(ssh_node.port), "User": "root",
             "IdentityFile": str(ssh_node.identity_file), "UserKnownHostsFile": str(ssh_node.known_hosts),
             **options}
    return "Host dflash-t\n" + "".join(f"    {key} {value}\n" for key, value in lines.items())


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_a_revoked_host_key_is_refused_although_it_is_on_record(client, ssh_node, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(ssh_node.known_hosts.read_text() + f"@revoked * {ssh_node.host_key_line}\n")
    transport, config = client(_node_block(ssh_node, UserKnownHostsFile=str(known)))
    with pytest.raises(UnreachableError, match="REVOKED"):
        transport.run(["true"])
    assert not openssh_connects(config)


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_accepting_a_new_host_key_writes_the_first_user_known_hosts_file(make_inventory, ssh_node, tmp_path,
                                                                         monkeypatch, ssh_client):
    first, second = tmp_path / "first", tmp_path / "second"
    config = tmp_path / "ssh_config"
    config.write_text(_node_block(ssh_node, UserKnownHostsFile=f"{first} {second}"))
    monkeypatch.setenv("DFLASH_SSH_CONFIG", str(config))
    hosts = load_inventory(make_inventory(tmp_path, node={"ssh": "dflash-t", "identity_file": None,
                                                          "known_hosts": None, "ssh_client": ssh_client}))
    with open_transport(hosts.get("node"), accept_new_host_key=True) as transport:
        assert transport.run(["true"]).exit_code == 0
    assert first.read_text() == f"{ssh_node.known_hosts_name} {ssh_node.host_key_line}\n"
    assert not second.exists()
    assert openssh_connects(config)  # OpenSSH reads the line where it would have written it


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_a_key_held_only_by_an_agent_at_identity_agent_logs_in(client, ssh_node, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    socket_path = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(socket_path)], stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = {**os.environ, "SSH_AUTH_SOCK": str(socket_path)}
        for _ in range(200):  # the agent creates its socket right after it starts
            if subprocess.run(["ssh-add", "-l"], env=env, capture_output=True).returncode in (0, 1):
                break
        subprocess.run(["ssh-add", "-q", str(ssh_node.identity_file)], env=env, check=True,
                       stdin=subprocess.DEVNULL, capture_output=True)
        transport, config = client(_node_block(ssh_node, IdentityFile=str(tmp_path / "no_such_key"),
                                               IdentityAgent=str(socket_path)))
        assert transport.run(["true"]).exit_code == 0
        assert openssh_connects(config)
    finally:
        agent.kill()
        agent.wait()


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_a_user_certificate_signed_by_the_trusted_ca_logs_in(client, ssh_node, tmp_path):
    key = tmp_path / "cert_only"
    keygen(key, "not in authorized_keys")
    certificate = sign_user_key(ssh_node, key)
    elsewhere = tmp_path / "certificate.pub"  # CertificateFile: not where paramiko would guess it
    certificate.rename(elsewhere)
    transport, config = client(_node_block(ssh_node, IdentityFile=str(key), CertificateFile=str(elsewhere),
                                           IdentitiesOnly="yes"))
    assert transport.run(["true"]).exit_code == 0
    assert openssh_connects(config, {"SSH_AUTH_SOCK": ""})


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_a_passphrase_key_without_agent_is_named_instead_of_prompting(client, ssh_node, tmp_path, monkeypatch):
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    key = tmp_path / "locked"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "secret", "-f", str(key)], check=True,
                   stdin=subprocess.DEVNULL)
    transport, config = client(_node_block(ssh_node, IdentityFile=str(key), IdentitiesOnly="yes"))
    with pytest.raises(UnreachableError, match="passphrase") as refused:
        transport.run(["true"])
    assert str(key) in refused.value.message and f"ssh-add {key}" in refused.value.hint
    assert not openssh_connects(config)


@pytest.fixture(scope="module")
def second_node(tmp_path_factory):
    """Another sshd (its own host key, its own port) for ProxyJump through `ssh_node`;
    it also presents a certificate of its host key signed by its host CA."""
    node, proc = start_sshd(tmp_path_factory.mktemp("sshd-behind"), host_certificate=True)
    yield node
    stop_sshd(proc)


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_proxyjump_reaches_a_second_sshd_through_the_first(client, ssh_node, second_node, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text(ssh_node.known_hosts.read_text() + second_node.known_hosts.read_text())
    # the jump is written as user@host:port, resolved on its own like OpenSSH does
    transport, config = client(
        f"Host dflash-t\n    HostName {second_node.address}\n    Port {second_node.port}\n    User root\n"
        f"    IdentityFile {second_node.identity_file}\n    UserKnownHostsFile {known}\n"
        f"    ProxyJump root@{ssh_node.address}:{ssh_node.port}\n"
        f"Host {ssh_node.address}\n    IdentityFile {ssh_node.identity_file}\n    UserKnownHostsFile {known}\n")
    jumps_before, behind_before = ssh_node.accepted_logins(), second_node.accepted_logins()
    done = transport.run(["printenv", "SSH_CONNECTION"])
    assert done.stdout.split()[3] == str(second_node.port).encode()
    assert ssh_node.accepted_logins() == jumps_before + 1 and second_node.accepted_logins() == behind_before + 1
    assert openssh_connects(config)


def test_a_host_certificate_is_trusted_through_a_cert_authority_line(client, ssh_node, second_node, tmp_path):
    # known_hosts holds no host key at all, only the CA that signed second_node's certificate
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority {second_node.address} {second_node.host_ca_line}\n")
    transport, config = client(_node_block(second_node, UserKnownHostsFile=str(known)))
    done = transport.run(["printenv", "SSH_CONNECTION"])
    assert done.stdout.split()[3] == str(second_node.port).encode()
    assert openssh_connects(config)

    # ssh_node's host key is not certified, and not on record either: refused
    transport, config = client(_node_block(ssh_node, UserKnownHostsFile=str(known)))
    with pytest.raises(UnreachableError, match="host key is unknown"):
        transport.run(["true"])
    assert not openssh_connects(config)


@pytest.mark.parametrize("ssh_client", ["paramiko"])
def test_the_in_process_client_refuses_a_host_known_only_by_its_cert_authority(client, second_node, tmp_path):
    # paramiko negotiates no host certificates: such a host needs its own key on record
    known = tmp_path / "known_hosts"
    known.write_text(f"@cert-authority {second_node.address} {second_node.host_ca_line}\n")
    transport, config = client(_node_block(second_node, UserKnownHostsFile=str(known)))
    with pytest.raises(UnreachableError, match="host key is unknown") as refused:
        transport.run(["true"])
    assert "@cert-authority lines are not used by dflash" in refused.value.hint
    assert openssh_connects(config)  # where `ssh` exists, ssh_client auto picks it and gets in


#: a ProxyCommand: touches the file argv[3], then relays its stdin and stdout to the TCP
#: port argv[2] of host argv[1], as `nc HOST PORT` does
RELAY = ("import os, pathlib, socket, sys, threading\n"
         "pathlib.Path(sys.argv[3]).touch()\n"
         "sock = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
         "def up():\n"
         "    while data := os.read(0, 65536):\n"
         "        sock.sendall(data)\n"
         "    sock.shutdown(socket.SHUT_WR)\n"
         "threading.Thread(target=up, daemon=True).start()\n"
         "while data := sock.recv(65536):\n"
         "    os.write(1, data)\n")


@pytest.mark.parametrize("ssh_client", BOTH_CLIENTS)
def test_proxycommand_gets_the_host_and_port_of_the_target(client, ssh_node, tmp_path):
    relay, used = tmp_path / "relay.py", tmp_path / "relay used"
    relay.write_text(RELAY)
    # %h and %p as OpenSSH expands them: the HostName and the Port of the target (not 22)
    command = f"{shlex.quote(sys.executable)} {shlex.quote(str(relay))} %h %p {shlex.quote(str(used))}"
    transport, config = client(_node_block(ssh_node, ProxyCommand=command))
    done = transport.run(["printenv", "SSH_CONNECTION"])
    assert done.exit_code == 0, done.stderr
    assert done.stdout.split()[3] == str(ssh_node.port).encode()
    assert used.exists()
    assert openssh_connects(config)


def test_a_user_control_master_is_joined_and_left_running(client, ssh_node, tmp_path):
    control = tempfile.mkdtemp(prefix="cm")  # short: a socket path is at most ~100 bytes
    transport, config = client(_node_block(ssh_node, ControlMaster="auto", ControlPath=f"{control}/%C",
                                           ControlPersist="60"))
    ssh = ["ssh", "-F", str(config), "-o", "BatchMode=yes"]
    assert subprocess.run([*ssh, "dflash-t", "true"], stdin=subprocess.DEVNULL, timeout=30).returncode == 0
    try:
        logins = ssh_node.accepted_logins()
        assert all(transport.run(["true"]).exit_code == 0 for _ in range(3))
        assert ssh_node.accepted_logins() == logins  # no login of its own: the user's master served
        transport.close()
        still = subprocess.run([*ssh, "-O", "check", "dflash-t"], capture_output=True, timeout=30)
        assert still.returncode == 0, still.stderr  # the user's master is theirs to end
    finally:
        subprocess.run([*ssh, "-O", "exit", "dflash-t"], capture_output=True, timeout=30)
        shutil.rmtree(control)


def test_a_stale_socket_of_a_user_control_master_is_replaced_by_the_first_command(client, ssh_node, tmp_path):
    control = tempfile.mkdtemp(prefix="cm")
    transport, config = client(_node_block(ssh_node, ControlMaster="auto", ControlPath=f"{control}/%C",
                                           ControlPersist="60"))
    ssh = ["ssh", "-F", str(config), "-o", "BatchMode=yes"]
    socket_path = subprocess.run([*ssh, "-G", "dflash-t"], capture_output=True, text=True,
                                 check=True).stdout.split("controlpath ", 1)[1].splitlines()[0]
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(socket_path)  # a master's socket left behind, nobody listening on it
    stale.close()
    try:
        assert transport.run(["true"]).exit_code == 0
        transport.close()
        live = subprocess.run([*ssh, "-O", "check", "dflash-t"], capture_output=True, timeout=30)
        assert live.returncode == 0, live.stderr  # the command became the user's master
    finally:
        subprocess.run([*ssh, "-O", "exit", "dflash-t"], capture_output=True, timeout=30)
        shutil.rmtree(control)


def test_hosts_verbose_says_where_each_option_came_from(make_inventory, ssh_node, tmp_path, monkeypatch):
    config = tmp_path / "ssh_config"
    config.write_text(f"Host dflash-t\n    HostName {ssh_node.address}\n    Port {ssh_node.port}\n")
    monkeypatch.setenv("DFLASH_SSH_CONFIG", str(config))
    inventory = make_inventory(tmp_path, node={"ssh": "dflash-t", "identity_file": str(ssh_node.identity_file)})
    done = CliRunner().invoke(main, ["--hosts", str(inventory), "hosts", "-v", "--json"])
    assert done.exit_code == 0, done.output
    node = next(e for e in map(json.loads, done.stdout.splitlines()) if e["host"] == "node")
    assert node["ssh"]["resolved_by"] == "ssh -G"
    assert node["ssh"]["client"] == node["ssh_client"] == "openssh"
    found = {row["option"]: (row["value"], row["source"]) for row in node["ssh"]["options"]}
    assert found["HostName"] == (ssh_node.address, f"ssh config ({config})")
    assert found["Port"] == (str(ssh_node.port), f"ssh config ({config})")
    assert found["IdentityFile"] == (str(ssh_node.identity_file), "inventory identity_file")
    assert found["ProxyJump"] == ("none", "OpenSSH default")

    # the inventory picks the other client
    inventory = make_inventory(tmp_path, node={"ssh": "dflash-t", "ssh_client": "paramiko"})
    done = CliRunner().invoke(main, ["--hosts", str(inventory), "hosts", "-v", "--json"])
    node = next(e for e in map(json.loads, done.stdout.splitlines()) if e["host"] == "node")
    assert node["ssh"]["client"] == node["ssh_client"] == "paramiko"
