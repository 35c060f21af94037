"""The typed cluster model: what a validated cluster file means, with every default resolved.

Everything here is frozen and already checked by meshdeploy.core.loading.load_cluster, so the
engine never re-validates and never sees "" for "unset": unset optional values are None.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from meshdeploy.config.addresses import WILDCARD, is_loopback, local_address
from meshdeploy.config.sources import Model

BACKENDS = ("cpu", "cuda", "metal", "vulkan", "rocm")

# What a host's llama.cpp calls its accelerators when the file lists none.
DEFAULT_DEVICES = {
    "cpu": (),
    "cuda": ("CUDA0",),
    "metal": ("MTL0",),
    "vulkan": ("Vulkan0",),
    "rocm": ("ROCm0",),
}

# rpc-server and llama-server accept -d CPU on every backend.
CPU_DEVICE = "CPU"

# common/arg.cpp refuses -ts with llama_max_devices() (16) values or more.
MAX_TENSOR_SPLIT = 15

@dataclass(frozen=True)
class Network:
    """How the cluster's hosts reach each other's services and what they let in, as every layer
    outside the network role reads it: by default the hosts' own network, each host's
    meshdeploy ports filtered (firewall), no rpc-server beyond the private ranges. The network
    role puts the file's network on the Cluster (its section: transport, tunnel, forwards;
    roles/network/settings.py), a subclass that answers these members."""

    firewall: bool = True  # the allow-list table on every host
    allow_public: bool = False  # rpc-servers may bind beyond loopback and the private ranges

    @property
    def tunnel(self) -> bool:
        """Hosts exchange RPC through a tunnel of their own (its addresses: source_address)."""
        return False

    @property
    def forwarded(self) -> bool:
        """Orchestrators reach remote rpc-servers through forwards to the workers' loopback
        (forwards()); model bytes travel back through the forwards' reverse ends."""
        return False

    @property
    def tunnel_unit(self) -> str | None:
        """The unit that brings the tunnel up, which a service on a tunnel address starts after."""
        return None

    @property
    def tunnel_interface(self) -> str | None:
        """The tunnel's network interface on each of its hosts."""
        return None

    def source_address(self, host: Host) -> str:
        """The address `host` reaches other hosts' services from (and they reach it at)."""
        return host.address

    def forwards(self, cluster: Cluster, host: Host) -> list[SshForward]:
        """The forwards `host` runs to the workers of its llama-servers."""
        return []

    def share_port(self, index: int) -> int | None:
        """The loopback port on a worker where the `index`-th sharing host's forward carries
        its model share back (forwarded only)."""
        return None


@dataclass(frozen=True)
class SshForward:
    """One orchestrator's OpenSSH forward to one worker: every rpc-server of the worker its
    llama-servers use, each from a loopback port of the orchestrator."""

    worker: Host
    ports: tuple[tuple[int, int], ...]  # (loopback port on the orchestrator, rpc-server port)

    @property
    def unit_name(self) -> str:
        return f"meshdeploy-ssh-{self.worker.name}"


@dataclass(frozen=True)
class SSH:
    user: str | None  # None = the ssh default (current user / ssh_config)
    port: int
    key: str | None  # absolute control-machine path
    config: str | None  # absolute control-machine path of an ssh_config
    sudo: bool
    # "yes", "accept-new" or "no"; None = the ssh_config's StrictHostKeyChecking, else "yes"
    # (meshdeploy.remote.ssh_settings resolves it).
    host_key: str | None = None


@dataclass(frozen=True)
class RpcServer:
    port: int
    # The resolved IPv4 literal for -H, never "". None only in a cluster that config.checks
    # refuses (a DNS-named host and no bind).
    bind: str
    device: str | None  # None = every device of the host
    threads: int  # 0 = rpc-server's default
    cache: bool
    # With cache: fetch only its tensors of a one-file Hub model from the cluster's copy
    # (config.distribution.tensor_fetches); False: keep a whole GGUF on the host (copies),
    # seed from it.
    fetch: bool = True
    # The file's own bind ("" = none given: the network's rules decide, Network subclasses'
    # binds); None where the RpcServer was not read from a file.
    file_bind: str | None = None

    @property
    def unit_name(self) -> str:
        return rpc_unit_name(self.port)


def rpc_unit_name(port: int) -> str:
    """The rpc-server's unit name, also its cache's name (core.paths.rpc_server_cache)."""
    return f"meshdeploy-rpc-{port}"


SYSTEMD, SYSTEMD_USER, RUNIT, LAUNCHD = "systemd", "systemd-user", "runit", "launchd"


@dataclass(frozen=True)
class Layout:
    """Where meshdeploy keeps its things on one host, and who supervises its services.

    A host with root: the cluster's prefix, /var/cache, /run/meshdeploy, the system's service
    manager (systemd; launchd on macOS, told by the Platform fact). A rootless host: folders the
    login user owns (core.account reads them from the host), its own service manager."""

    prefix: str  # builds and models (Cluster.prefix on a host with root)
    cache: str  # the parent of each rpc-server's cache folder
    run: str  # locks, in-flight markers, the scripts of transient steps
    services: str  # where service definitions go: unit files, or runit's service folders
    manager: str = ""  # SYSTEMD_USER or RUNIT on a rootless host; "" = the system's
    home: str = ""  # the login user's home on a rootless host
    config: str = "/etc/meshdeploy"  # meshdeploy's own settings and keys on the host
    user: str = ""  # the login user on a rootless host

    @property
    def rootless(self) -> bool:
        return self.manager in (SYSTEMD_USER, RUNIT)


def system_layout(prefix: str) -> Layout:
    """The layout of a host meshdeploy reaches with root."""
    return Layout(prefix=prefix, cache="/var/cache", run="/run/meshdeploy",
                  services="/etc/systemd/system")


@dataclass(frozen=True)
class Host:
    name: str
    address: str  # IPv4 literal or DNS name: the SSH target and the default RPC address
    ssh: SSH
    backend: str
    devices: tuple[str, ...]  # resolved: the backend's default when the file lists none
    rpc_servers: tuple[RpcServer, ...]
    # "local": the machine meshdeploy runs on, reached without SSH (pyinfra's @local connector,
    # invoke's local runner for logs and exec); its `ssh` holds the defaults and is not used.
    connection: Literal["ssh", "local"] = "ssh"
    # No root on the host: everything under the login user's folders, services under the user's
    # service manager, never sudo (roles read `layout` for the paths).
    rootless: bool = False
    # A rootless host under network.firewall whose rpc-servers are open to its network, by the
    # file's explicit acknowledgement (warned in every plan).
    unprotected: bool = False
    # Bytes of each of its devices that placement: auto leaves free (hosts.NAME.keep_free_gb).
    keep_free: int = 0
    # hosts.NAME.vulkan_visible_devices: vulkaninfo's GPU indices that become Vulkan0, Vulkan1,
    # ... (GGML_VK_VISIBLE_DEVICES); () = ggml-vulkan's own choice of devices.
    vulkan_visible: tuple[int, ...] = ()
    # Where meshdeploy keeps its things on the host; a rootless host's is known once its
    # account is read (core.account.layout), until then None.
    layout: Layout | None = None

    @property
    def local(self) -> bool:
        return self.connection == "local"

    @property
    def sudo(self) -> bool:
        """Whether changes on the host go through `sudo -n`: ssh.sudo over SSH; on the local
        host, whenever meshdeploy itself does not run as root (read when asked: the same file
        is applied by root and by a user)."""
        if self.rootless:
            return False
        return os.geteuid() != 0 if self.local else self.ssh.sudo

    def rpc_server(self, port: int) -> RpcServer | None:
        for rpc in self.rpc_servers:
            if rpc.port == port:
                return rpc
        return None

    def rpc_devices(self, rpc: RpcServer) -> tuple[str, ...]:
        """Devices `rpc` exposes, in the order llama-server counts them: its -d device, else
        every device of the host (the CPU when it has none)."""
        if rpc.device is not None:
            return (rpc.device,)
        return self.devices or (CPU_DEVICE,)


def rpc_ref(host_name: str, port: int) -> str:
    """The `host:port` name of an rpc-server, as servers.<name>.rpc lists it."""
    return f"{host_name}:{port}"


def parse_rpc_ref(ref: str) -> tuple[str, int]:
    host_name, _, port = ref.rpartition(":")
    return host_name, int(port)


@dataclass(frozen=True)
class RpcEndpoint:
    host: Host
    rpc: RpcServer
    address: str  # what the orchestrator dials
    # network.transport: ssh: the orchestrator's loopback port of the forward, and the worker's
    # own address the forward reaches (None: dialled directly, address:rpc.port).
    local_port: int | None = None
    via: str | None = None

    @property
    def ref(self) -> str:
        """The rpc-server's `host:port` name (rpc_ref)."""
        return rpc_ref(self.host.name, self.rpc.port)

    @property
    def port(self) -> int:
        """The port the orchestrator dials: the forward's on loopback, else the rpc-server's."""
        return self.local_port if self.local_port is not None else self.rpc.port

    @property
    def target(self) -> str:
        """The `address:port` form that goes into llama-server's --rpc list."""
        return f"{self.address}:{self.port}"

    @property
    def ssh_target(self) -> str:
        """`address:ssh port` of the worker: what the orchestrator's RTT probe connects to."""
        return f"{self.via or self.address}:{self.host.ssh.port}"

    @property
    def devices(self) -> tuple[str, ...]:
        """Devices this rpc-server exposes, in the order llama-server counts them."""
        return self.host.rpc_devices(self.rpc)


class ServerDevice(NamedTuple):
    """One device of a llama-server, in -ts order."""

    label: str  # "host:port/DEV" behind an rpc-server, "host/DEV" on the orchestrator
    host: Host
    device: str
    endpoint: RpcEndpoint | None  # None for the orchestrator's own devices


@dataclass(frozen=True)
class Health:
    retries: int
    interval: float  # seconds

    @property
    def budget(self) -> float:
        return self.retries * self.interval


@dataclass(frozen=True)
class Failover:
    """servers.NAME.failover: how many worker hosts may be away at once, and whether their
    caches hold every placement's tensors (roles/services/README.md, "Failover")."""

    tolerate: int = 1
    seed: bool = True


@dataclass(frozen=True)
class Server:
    name: str
    host: str  # host name (the orchestrator)
    model: str  # model name
    port: int
    bind: str
    ctx_size: int  # 0 = the model's training context
    n_gpu_layers: int
    tensor_split: Literal["auto"] | tuple[float, ...]
    # With tensor_split auto: "memory" (llama.cpp's own split) or "auto" (the split predicted
    # fastest from measured device speeds: placement.speed). Unset in the file: "auto"
    # with tensor_split auto, else "memory"; placement_set says whether the file set it (the
    # plan explains an auto that splits by memory only when it did).
    placement: Literal["memory", "auto"]
    placement_set: bool
    # Resolved "host:port" names in --rpc order; () when the cluster has no rpc-server to use,
    # None when the file says `rpc: none`. The file's `[]` (every rpc-server) is expanded.
    rpc: tuple[str, ...] | None
    load_mode: str | None
    api_key_file: str | None  # path on the host
    allow: tuple[str, ...]  # who besides loopback may connect (addresses, networks), as written
    extra_args: tuple[str, ...]
    health: Health
    # A non-loopback bind without api_key_file is refused unless this is set (config.checks).
    allow_unauthenticated: bool = False
    failover: Failover = Failover()

    @property
    def unit_name(self) -> str:
        return f"meshdeploy-server-{self.name}"

    @property
    def local_url(self) -> str:
        """`http://address:port` where the server's own host reaches it (status, /health)."""
        return f"http://{local_address(self.bind)}:{self.port}"


@dataclass(frozen=True)
class Cluster:
    name: str
    path: Path
    # Where hosts with root keep meshdeploy's things: the field a role's schema.json marks
    # "x-meshdeploy-layout": "prefix" (config.schema.layout_field).
    prefix: str
    hosts: tuple[Host, ...]
    models: dict[str, Model] = field(hash=False)
    servers: tuple[Server, ...] = ()
    source_hash: str = ""  # sha256 of the cluster file's bytes
    # The hosts' network: the network role's settings once core.loading completed the cluster.
    network: Network = Network()
    # The roles' own sections (role -> plain data, defaults filled), each declared by a role's
    # schema.json; the role reads its part as its typed settings (HostContext.section).
    sections: dict[str, Any] = field(default_factory=dict, hash=False)
    # What is derived from the file alone, computed once per Cluster (derived()): a plan asks
    # who copies from whom for every host and slot, and a fleet of 30 hosts made that seconds.
    # Not an argument: dataclasses.replace() gives the new Cluster an empty one.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False,
                           hash=False)

    def derived(self, key, compute):
        """compute(), once per Cluster and key (the Cluster is frozen: so is what it derives)."""
        if key not in self._derived:
            self._derived[key] = compute()
        return self._derived[key]

    def host(self, name: str) -> Host:
        host = self.derived("hosts by name", lambda: {h.name: h for h in self.hosts}).get(name)
        if host is None:
            raise KeyError(f"no host named {name!r} in cluster {self.name!r}")
        return host

    def server(self, name: str) -> Server:
        for server in self.servers:
            if server.name == name:
                return server
        raise KeyError(f"no server named {name!r} in cluster {self.name!r}")

    def model(self, name: str) -> Model:
        return self.models[name]

    def runs_llama_cpp(self, host: Host) -> bool:
        """Whether `host` runs a llama.cpp binary: a llama-server or an rpc-server."""
        return bool(host.rpc_servers) or any(s.host == host.name for s in self.servers)

    def rpc_servers(self) -> list[tuple[Host, RpcServer]]:
        """Every rpc-server of the cluster, hosts in file order."""
        return [(host, rpc) for host in self.hosts for rpc in host.rpc_servers]

    def rpc_ports(self) -> list[int]:
        """Every port some host runs an rpc-server on: one resource slot each, on every host."""
        return sorted({rpc.port for _, rpc in self.rpc_servers()})

    def rpc_endpoints(self, server: Server) -> list[RpcEndpoint]:
        """The rpc-servers `server` uses, in --rpc order, with the address it dials."""
        if not server.rpc:
            return []
        # Derived once per server object (a test may pass one the file does not hold).
        seen = self._derived.get(("rpc_endpoints", server.name))
        if seen is not None and seen[0] is server:
            return list(seen[1])
        endpoints = self._rpc_endpoints(server)
        self._derived[("rpc_endpoints", server.name)] = (server, tuple(endpoints))
        return endpoints

    def _rpc_endpoints(self, server: Server) -> list[RpcEndpoint]:
        endpoints = []
        for ref in server.rpc:
            host_name, port = parse_rpc_ref(ref)
            host = self.host(host_name)
            rpc = host.rpc_server(port)
            if rpc is None:
                raise KeyError(f"no rpc-server {ref!r} in cluster {self.name!r}")
            forward = self._forward_port(server.host, host.name, port)
            if forward is not None:
                endpoints.append(RpcEndpoint(host, rpc, "127.0.0.1", forward, host.address))
            else:
                endpoints.append(RpcEndpoint(host, rpc, dial_address(host, rpc, server.host)))
        return endpoints

    def ssh_forwards(self, host: Host) -> list[SshForward]:
        """The forwards `host` runs for its llama-servers (Network.forwards: under the network
        role's network.transport: ssh, one per remote worker), derived once per host."""
        return list(self.derived(("ssh_forwards", host.name),
                                 lambda: tuple(self.network.forwards(self, host))))

    def forwarded_to(self, worker: Host) -> list[tuple[Host, SshForward]]:
        """(orchestrator, its forward) pairs that reach `worker` under network.transport: ssh."""
        out = []
        for host in self.hosts:
            for forward in self.ssh_forwards(host):
                if forward.worker.name == worker.name:
                    out.append((host, forward))
        return out

    def _forward_port(self, orchestrator: str, worker: str, port: int) -> int | None:
        if not self.network.forwarded or orchestrator == worker:
            return None
        for forward in self.ssh_forwards(self.host(orchestrator)):
            if forward.worker.name == worker:
                return next((local for local, remote in forward.ports if remote == port), None)
        return None

    def source_address(self, host: Host) -> str:
        """The address `host` connects to other hosts' rpc-servers from (Network.source_address:
        its tunnel address inside a tunnel, else its address)."""
        return self.network.source_address(host)

    def tunnel_peers(self, host: Host) -> list[Host]:
        """Hosts that `host` exchanges RPC with across hosts (its workers, its orchestrators),
        in file order: its WireGuard peers under network.transport: wireguard."""
        names = set()
        for server in self.servers:
            for e in self.rpc_endpoints(server):
                if e.host.name != server.host and host.name in (e.host.name, server.host):
                    names.add(e.host.name if server.host == host.name else server.host)
        return [h for h in self.hosts if h.name in names]

    def worker_hosts(self, server: Server) -> list[str]:
        """Hosts other than the orchestrator whose rpc-servers `server` dials, in --rpc order."""
        out = []
        for e in self.rpc_endpoints(server):
            if e.host.name != server.host and e.host.name not in out:
                out.append(e.host.name)
        return out

    def supervised(self, server: Server) -> bool:
        """Whether md-failover runs `server` (it has workers it may lose: failover.tolerate)."""
        return server.failover.tolerate > 0 and bool(self.worker_hosts(server))

    def server_devices(self, server: Server) -> list[ServerDevice]:
        """Every device `server` splits across, in llama-server's -ts order: RPC devices
        first, then local ones."""
        out = []
        for e in self.rpc_endpoints(server):
            out += [ServerDevice(f"{e.ref}/{dev}", e.host, dev, e) for dev in e.devices]
        local = self.host(server.host)
        out += [ServerDevice(f"{server.host}/{dev}", local, dev, None) for dev in local.devices]
        return out

    def devices_for(self, server: Server) -> list[str]:
        """Device labels in llama-server's -ts order: RPC devices first, then local ones."""
        return [d.label for d in self.server_devices(server)]


def dial_address(host: Host, rpc: RpcServer, from_host: str) -> str:
    """Where an orchestrator on `from_host` reaches `rpc` on `host`."""
    if rpc.bind is None:
        # A DNS-named host without a bind (config.load.default_bind): the checks ask for one,
        # and read the distribution meanwhile; the host's name is what a client would dial.
        return host.address
    if is_loopback(rpc.bind):
        return rpc.bind
    if host.name == from_host:
        # A wildcard or own-address bind also listens on the host itself; loopback avoids
        # hairpinning through the host's interface and any firewall on it.
        return local_address(rpc.bind)
    if rpc.bind == WILDCARD:
        return host.address
    return rpc.bind


def reachable_from(host: Host, bind: str, from_host: str) -> bool:
    """Whether a listener on `host` bound to `bind` answers a client on host `from_host`."""
    return host.name == from_host or not is_loopback(bind)
