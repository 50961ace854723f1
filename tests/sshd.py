"""An OpenSSH server inside each test "host" (a network namespace from ``tests/netns.py``).

``servers(net, hosts, tmp)`` starts ``/usr/sbin/sshd -D`` inside each listed namespace,
listening only on that namespace's address, with a temporary host key and an authorized key
for a temporary client key: root may log in by key only (no password, no PAM). It yields an
``SshSetup`` whose ``ssh_opts`` are the client options (``-o KEY=VALUE`` pairs, as
``meshrun launch --ssh-opt`` takes them) that reach those servers. Every sshd is stopped on
exit, also when the test fails (and ``netns.hosts`` kills whatever is left in a namespace).

    with netns.hosts(3) as net, sshd.servers(net, [1, 2], tmp_path) as ssh:
        subprocess.run(net.argv(0, ["ssh", *ssh.client_args(), net.address(1), "true"]))
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from netns import Hosts

SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege-separation dir
START_TIMEOUT_S = 15.0


def available() -> str | None:
    """None if sshd and ssh-keygen exist here, else why not (for pytest.skip)."""
    for tool in (SSHD, "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: openssh-server, openssh-client)"
    return None


def require() -> None:
    reason = available()
    if reason:
        pytest.skip(reason)


@dataclass
class SshSetup:
    key: Path  # the client's private key
    known_hosts: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def ssh_opts(self) -> list[str]:
        """Client options as ``KEY=VALUE`` (each becomes ``ssh -o KEY=VALUE``)."""
        return [
            f"IdentityFile={self.key}",
            "IdentitiesOnly=yes",
            f"UserKnownHostsFile={self.known_hosts}",
            "StrictHostKeyChecking=no",  # the host keys are new on every run
            "LogLevel=ERROR",  # no "Permanently added ... to the list of known hosts"
        ]

    def client_args(self) -> list[str]:
        return [arg for opt in self.ssh_opts for arg in ("-o", opt)]


def _keygen(path: Path) -> None:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )


def _sshd_config(tmp: Path, address: str, index: int) -> Path:
    config = tmp / f"sshd_config.{index}"
    config.write_text(
        "\n".join(
            [
                f"ListenAddress {address}",
                "Port 22",
                f"HostKey {tmp / 'host_key'}",
                f"AuthorizedKeysFile {tmp / 'authorized_keys'}",
                f"PidFile {tmp / f'sshd.{index}.pid'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "UseDNS no",
                "StrictModes no",  # pytest's tmp dirs are not owned the way sshd wants
                "PermitUserEnvironment no",
                "LogLevel ERROR",
                "",
            ]
        )
    )
    return config


def _wait_listening(net: Hosts, host: int, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until sshd accepts on port 22 (probed from inside its namespace)."""
    probe = net.argv(host, ["bash", "-c", f"exec 3<>/dev/tcp/{net.address(host)}/22"])
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd in host {host} exited {proc.returncode}: {log.read_text()}")
        if subprocess.run(probe, capture_output=True, timeout=10).returncode == 0:
            return
        time.sleep(0.2)
    raise RuntimeError(f"sshd in host {host} not listening after {START_TIMEOUT_S} s")


@contextmanager
def servers(net: Hosts, hosts: Sequence[int], tmp: Path) -> Iterator[SshSetup]:
    """sshd in each of ``hosts`` (indices into ``net``); stopped on exit."""
    require()
    tmp.mkdir(parents=True, exist_ok=True)
    _keygen(tmp / "host_key")
    _keygen(tmp / "client_key")
    shutil.copy(tmp / "client_key.pub", tmp / "authorized_keys")
    made_privsep = not PRIVSEP_DIR.exists()
    PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
    setup = SshSetup(key=tmp / "client_key", known_hosts=tmp / "known_hosts")
    try:
        for i in hosts:
            config = _sshd_config(tmp, net.address(i), i)
            log = tmp / f"sshd.{i}.log"
            # In the host's own UTS namespace: the sessions sshd starts see hostname node<i>.
            argv = net.argv(i, [SSHD, "-D", "-f", str(config), "-E", str(log)])
            setup.procs.append(subprocess.Popen(argv, stdin=subprocess.DEVNULL))
            _wait_listening(net, i, setup.procs[-1], log)
        yield setup
    finally:
        for proc in setup.procs:
            proc.terminate()
        for proc in setup.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if made_privsep:
            shutil.rmtree(PRIVSEP_DIR, ignore_errors=True)
