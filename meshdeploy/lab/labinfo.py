"""What a lab that is up hands its users: lab.json and the ssh_config that reaches its hosts.

`LabInfo` (with a `LabHost` per host) is what lab.json says, read back by `LabInfo.load` and
able to run a command on a host over SSH; `render_ssh_config` is the text of the ssh_config that
`Lab.up` writes beside it (`ssh -F <state>/ssh_config node1`): one block per host, with its login
user and port. `Lab` (lab/core.py) brings the lab up and writes both.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import subprocess
from pathlib import Path

from meshdeploy.lab import arches as host_arches
from meshdeploy.lab import base, hosts
from meshdeploy.lab import kinds as host_kinds
from meshdeploy.lab.errors import LabError


@dataclasses.dataclass
class LabHost:
    name: str
    address: str
    netns: str
    kind: str = host_kinds.ROOT  # lab/kinds.py; a lab.json from before kinds means root
    user: str = "deploy"  # who the lab's key logs in as (the ssh_config's User)
    port: int = 22  # where the host's sshd listens (the ssh_config's Port)
    suite: str = base.SUITE  # its Debian release (lab/base.py SUITES)
    arch: str = host_arches.NATIVE  # its Debian architecture (lab/arches.py ARCHES)


@dataclasses.dataclass
class LabInfo:
    """What lab.json says; `run` executes a command in a host over SSH (for tests)."""

    name: str
    state_dir: str
    bridge_address: str
    hosts: list[LabHost]
    ssh: dict
    mirrors: dict
    ccache_dir: str = hosts.CCACHE_IN_HOST
    # Hosts started with `rogue=`: on the bridge like any other, in no cluster file.
    rogue: list[str] = dataclasses.field(default_factory=list)
    base: str = ""  # the base the hosts boot from (base.recipe_hash; toolchain=True has its own)

    def host(self, name: str) -> LabHost:
        for h in self.hosts:
            if h.name == name:
                return h
        raise LabError(f"lab {self.name} has no host {name!r}; hosts: "
                       + ", ".join(h.name for h in self.hosts))

    def run(self, host: str, cmd: str | list[str], timeout: float = 600,
            check: bool = False, root: bool = False) -> subprocess.CompletedProcess:
        """+ root: as root, not as the host's user (offering the admin key too: root takes it
          on hosts of the md kinds, the lab key on root hosts)"""
        self.host(host)
        command = cmd if isinstance(cmd, str) else shlex.join(cmd)
        admin = self.ssh.get("admin_key") if root else None
        argv = hosts.ssh_argv(Path(self.ssh["config"]), f"root@{host}" if root else host,
                              command, identity=Path(admin) if admin else None)
        proc = hosts.run_ssh(argv, timeout)
        if check:
            proc.check_returncode()
        return proc

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LabInfo":
        data = dict(data)
        data["hosts"] = [LabHost(**h) for h in data["hosts"]]
        return cls(**data)

    @classmethod
    def load(cls, state_dir: Path) -> "LabInfo":
        path = Path(state_dir) / "lab.json"
        try:
            return cls.from_dict(json.loads(path.read_text()))
        except FileNotFoundError:
            raise LabError(f"no lab is up in {state_dir} (no lab.json); run `meshdeploy lab up`")
        except (ValueError, TypeError, KeyError) as exc:
            raise LabError(f"{path} is not a lab description ({exc}); run `meshdeploy lab down`")


def render_ssh_config(lab: str, host_names: list[str], key: Path,
                      kinds: dict[str, str] | None = None) -> str:
    """+ kinds: host -> kind (lab/kinds.py); a host it does not name is a root host"""
    blocks = []
    for h in host_names:
        kind = host_kinds.KINDS[(kinds or {}).get(h, host_kinds.ROOT)]
        # A host on another port gets `Port` and `%p`: OpenSSH then reaches whatever port it
        # is asked for (`-p 22` is refused by a termux host, as by a phone); paramiko expands
        # %p from the Port line.
        port = [] if kind.port == 22 else [f"    Port {kind.port}"]
        target = "22" if kind.port == 22 else "%p"
        blocks.append("\n".join([
            f"Host {h}",
            f"    HostName {h}",
            f"    User {kind.user}",
            *port,
            f"    IdentityFile {key}",
            "    IdentitiesOnly yes",
            "    StrictHostKeyChecking no",
            "    UserKnownHostsFile /dev/null",
            "    LogLevel ERROR",
            f"    ProxyCommand ip netns exec {lab}-%h nc 127.0.0.1 {target}",
        ]))
    return "\n\n".join(blocks) + "\n"
