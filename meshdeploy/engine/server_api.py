"""A deployed llama-server as `meshdeploy bench` reaches it: the SSH connection to its host, its
HTTP API through that connection, the fixed measurement, its running argv, and copies of it as
transient systemd units (bench --compare-local, bench --sweep), and the statistics over the
server's own `timings` that bench's views show.

The server usually listens on the orchestrator's loopback: requests travel through the SSH
connection as direct-tcpip channels (no port is opened on the control machine). The API key,
when the server has one, is read on the host with `sudo -n cat` and kept in memory only; it
goes only to a listener that belongs to the unit meant (Api.owned: its cgroup, read as root):
while the sweep has the deployed server stopped its port is anyone's to take.
fabric (remote.connections) and http.client are imported where they are used: the command line
imports this module to build its parser, and ssl must not be imported before gevent's patch.
"""

from __future__ import annotations

import json
import re
import statistics
import time

from meshdeploy.core import shell
from meshdeploy.core.paths import llama_cpp_paths
from meshdeploy.errors import ConnectError, MeshdeployError
from meshdeploy.remote.ssh_settings import SshSettings

# Fixed prompts of different lengths: prompt processing is measured on each, generation after
# each. The long one stays well inside a 2048-token context with N_PREDICT added.
_STORY = ("The lighthouse keeper wrote down the weather every hour: the wind, the height of "
          "the waves, the ships that passed and the colour of the sky at dusk. ")
PROMPTS = (
    ("short", "Write one sentence about the sea."),
    ("medium", "Summarise the following notes in three sentences.\n" + _STORY * 4),
    ("long", "Read the log below and list every kind of entry it contains.\n" + _STORY * 16),
)
N_PREDICT = 64
SEED = 42
WARMUP = 1
# A copy stops itself after this long even if meshdeploy is killed outright.
COPY_MAX_SECONDS = 1800
_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf")
# Flags a copy alone on the orchestrator drops with their value: the workers and their split.
WORKERS = frozenset({"--rpc", "-ts", "--tensor-split"})
_FREE_PORT = ("python3 -c 'import socket; s = socket.socket(); s.bind((\"127.0.0.1\", 0)); "
              "print(s.getsockname()[1])'")


# The two figures every view shows: prompt processing and generation, tokens per second.
METRICS = (("pp", "prompt_n", "prompt_ms"), ("tg", "predicted_n", "predicted_ms"))
TIMING_KEYS = ("prompt_n", "prompt_ms", "prompt_per_second",
               "predicted_n", "predicted_ms", "predicted_per_second")


def spread(values: list[float]) -> dict:
    """{"min", "median", "max"} of `values` (rounded to 0.01 tokens/s)."""
    if not values:
        raise ValueError("no values")
    return {"min": round(min(values), 2), "median": round(statistics.median(values), 2),
            "max": round(max(values), 2)}


def rate(tokens: float, ms: float) -> float:
    return tokens * 1000.0 / ms if ms > 0 else 0.0


def summarize(runs: list[list[dict]], prompts: list[str]) -> dict:
    """Per prompt and over all prompts, min/median/max tokens/s of each metric.

    + runs: one list per run, one `timings` dict per prompt (llama-server's own fields)
    + prompts: the prompts' names, in the order every run sent them
    The "all" row of a run is its tokens over its milliseconds across every prompt, so a long
    prompt weighs as much as the time it took.
    """
    rows = []
    for i, name in enumerate(prompts):
        samples = [run[i] for run in runs]
        row = {"prompt": name, "prompt_n": samples[0]["prompt_n"],
               "predicted_n": samples[0]["predicted_n"]}
        for metric, n, ms in METRICS:
            row[metric] = spread([rate(s[n], s[ms]) for s in samples])
        rows.append(row)
    overall = {"prompt_n": sum(r["prompt_n"] for r in rows),
               "predicted_n": sum(r["predicted_n"] for r in rows)}
    for metric, n, ms in METRICS:
        overall[metric] = spread([rate(sum(s[n] for s in run), sum(s[ms] for s in run))
                                  for run in runs])
    return {"prompts": rows, "overall": overall,
            "samples": [[{k: s[k] for k in TIMING_KEYS if k in s} for s in run]
                        for run in runs]}


class BenchError(MeshdeployError):
    """The benchmark could not run (server unhealthy, a request failed)."""


def connect(settings: SshSettings):
    """An open fabric Connection to the orchestrator, built by meshdeploy.remote.connections
    from the same settings (ssh_config, user, key, port, ProxyCommand, host-key policy) as plan
    and apply; a refused host key is the same HostKeyError. A local orchestrator is run here,
    its API dialled directly."""
    from meshdeploy.remote import connections as remote

    hosts = remote.connect([settings])
    if settings.host in hosts.unreachable:
        raise ConnectError(f"cannot connect over SSH to {settings.host}: "
                           f"{hosts.unreachable[settings.host]}",
                           hint="check that `meshdeploy status` reaches the host")
    return hosts.connections[settings.host]


def run_remote(conn, command: str, sudo: bool = False) -> str:
    """stdout of `command` (built by meshdeploy.core.shell) on the host; BenchError on failure."""
    if sudo:
        command = shell.sudo(command)
    result = conn.run(command, hide=True, warn=True, in_stream=False)
    if result.exited != 0:
        raise BenchError(f"{conn.original_host}: a command failed (exit {result.exited}): "
                         f"{result.stderr.strip()[:300]}")
    return result.stdout


# The unit's own cgroup and the verdict on every listener on its port (core/templates/
# listener-owner.sh), as root: ss -p names other users' processes only to root.
_OWNER = 'md_owner "$UNIT" "$ADDRESS" "$PORT"'


def foreign_listener(lines, unit: str) -> str | None:
    """Why a connection to the unit's address and port might not reach `unit` (md_owner's lines:
    core/templates/listener-owner.sh), or None when every listener that could take it is the
    unit's own process (status says the same words)."""
    text = [line.strip() for line in lines if line.strip()]
    own = next((line[4:].strip() for line in text if line.split()[0] == "unit"), "")
    verdict = next((line for line in text if line.split()[0] != "unit"), "")
    if verdict == "owned":
        return None
    if verdict == "none":
        return "nothing listens there"
    if verdict == "no-ss":
        return "the host has no ss (iproute2) to tell who holds it"
    if verdict == "ss-failed":
        return "ss could not list the port's listeners (the sockets are not readable here)"
    if verdict.startswith("foreign "):
        who = verdict[8:].strip()
        who = f"process {who[4:]}" if who.startswith("pid ") else f"cgroup {who}"
        return (f"it is held by {who}, not by {unit} "
                f"({own or 'which is not running'}): another process took the port")
    return "who holds it could not be told"


class Api:
    """llama-server's HTTP API on (address, port) as the host sees it, over the SSH connection.
    + unit: the unit that must hold the port before the key is sent (a system unit's is
      checked as root, with `sudo`); None sends it unchecked
    + layout: a rootless host's (manager, services folder): the unit is the user manager's or
      a runit service (listener-owner.sh's MANAGER)"""
    def __init__(self, conn, address: str, port: int, key: str | None, timeout: float = 600,
                 unit: str | None = None, sudo: bool = False, layout=None):
        self.conn, self.address, self.port, self.key, self.timeout = \
            conn, address, port, key, timeout
        self.unit, self.sudo = unit, sudo
        self.manager, self.services = (layout.manager, layout.services) if layout else ("", "")

    def owned(self) -> None:
        """BenchError unless every listener on the port is a process of self.unit."""
        if self.unit is None:
            return
        out = run_remote(self.conn, shell.script(_OWNER, prelude=shell.LISTENER_OWNER,
                                                 UNIT=self.unit, ADDRESS=self.address,
                                                 PORT=self.port, MANAGER=self.manager,
                                                 SVDIR_MD=self.services), self.sudo)
        why = foreign_listener(out.splitlines(), self.unit)
        if why is not None:
            raise BenchError(f"{self.conn.original_host}: {self.address}:{self.port}: {why}; "
                             "nothing with the API key was sent to it",
                             hint=f"check who listens there (ss -ltnp 'sport = :{self.port}')")

    def call(self, method: str, path: str, body: dict | None = None,
             keyed: bool = True) -> tuple[int, dict]:
        """+ keyed: with the API key (checked first: Api.owned); /health needs none"""
        import http.client

        keyed = keyed and bool(self.key)
        if keyed:
            self.owned()
        channel = self.conn.dial(self.address, self.port, timeout=30)
        channel.settimeout(self.timeout)
        client = http.client.HTTPConnection(self.address, self.port)
        client.sock = channel  # http.client then never dials itself
        headers = {"Content-Type": "application/json"}
        if keyed:
            headers["Authorization"] = f"Bearer {self.key}"
        try:
            client.request(method, path, json.dumps(body) if body is not None else None, headers)
            response = client.getresponse()
            data = response.read()
        finally:
            client.close()
        try:
            return response.status, json.loads(data) if data else {}
        except ValueError:
            return response.status, {}

    def completion(self, prompt: str, n_predict: int) -> dict:
        status, answer = self.call("POST", "/completion", request_body(prompt, n_predict))
        if status != 200 or "timings" not in answer:
            message = (answer.get("error") or {}).get("message") if isinstance(
                answer.get("error"), dict) else answer.get("error")
            raise BenchError(f"llama-server on {self.address}:{self.port} answered "
                             f"HTTP {status} to /completion: {message or 'no timings'}")
        return answer["timings"]

    def wait_healthy(self, seconds: float, alive=None) -> None:
        """Until /health answers 200; BenchError after `seconds`, or as soon as alive(), when
        given, says the process is gone (a copy that failed to load). /health is asked without
        the key (llama-server serves it to anyone); with a key, a 200 counts once the listener
        is the unit's own (Api.owned), and one that is not ends the wait at once."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                status, _ = self.call("GET", "/health", keyed=False)
            except Exception:  # not listening yet: the channel open fails
                status = None
            if status == 200:
                if self.key:
                    self.owned()
                return
            if alive is not None and not alive():
                raise BenchError(f"llama-server on {self.address}:{self.port} exited before it "
                                 "was healthy")
            if time.monotonic() > deadline:
                raise BenchError(f"llama-server on {self.address}:{self.port} is not healthy "
                                 f"(last answer: {status or 'no connection'})",
                                 hint="check it with `meshdeploy status FILE`")
            time.sleep(1)


def request_body(prompt: str, n_predict: int) -> dict:
    """Deterministic and the same every run: greedy, fixed seed, exactly n_predict tokens, and
    no prompt cache, so every run processes the whole prompt."""
    return {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "seed": SEED,
            "cache_prompt": False, "ignore_eos": True, "stream": False}


def measure(api: Api, runs: int, n_predict: int, progress) -> dict:
    """One warm-up request, then `runs` passes over every prompt; their summary (summarize)."""
    for _ in range(WARMUP):
        api.completion(PROMPTS[0][1], 8)
    passes = []
    for i in range(runs):
        progress(f"  run {i + 1}/{runs}")
        passes.append([api.completion(text, n_predict) for _, text in PROMPTS])
    return summarize(passes, [name for name, _ in PROMPTS])


# -- the running server and copies of it ---------------------------------------------------------

def planned_argv(conn, cluster, server) -> list[str]:
    """The deployed llama-server's argv as the plan renders it (roles.services.argv) for the
    build the host's `current` link names, with the options that build's --help lists: never
    read from the running process, which can rewrite its own /proc/PID/cmdline."""
    from meshdeploy.core.paths import installed_build, model_path
    from meshdeploy.roles.llama_cpp.facts import Builds
    from meshdeploy.roles.services.argv import llama_server_argv

    host = cluster.host(server.host)
    paths = llama_cpp_paths(host.layout.prefix)
    facts = Builds.process(Builds(), run_remote(conn, Builds.command(
        Builds(), paths["builds"], paths["current"])).splitlines())
    key = facts["current"]
    if key is None or key not in facts["builds"]:
        raise BenchError(f"{server.host} has no current llama.cpp build",
                         hint="run `meshdeploy apply`")
    flags = facts["builds"][key].get("flags")
    return llama_server_argv(f"{installed_build(host.layout.prefix, key)}/bin/llama-server",
                             cluster, server, model_path(cluster, server.model, host),
                             frozenset(flags) if flags else None)


def local_argv(argv: list[str], port: int, key_path: str | None,
               drop: frozenset[str] = WORKERS) -> list[str]:
    """The running llama-server's argv for a copy on loopback: the flags in `drop` left out with
    their values (by default --rpc and -ts: the copy runs alone), --host 127.0.0.1, --port
    `port`, the API key from `key_path`."""
    out, i = [argv[0]], 1
    replace = {"--host": "127.0.0.1", "--port": str(port), "--api-key-file": key_path}
    while i < len(argv):
        flag = argv[i]
        name, eq, _ = flag.partition("=")
        if name in drop:
            i += 1 if eq else 2
            continue
        if name in replace:
            out += [name, replace[name]] if replace[name] else []
            i += 1 if eq else 2
            continue
        out.append(flag)
        i += 1
    if "--host" not in out:
        out += ["--host", "127.0.0.1"]
    if "--port" not in out:
        out += ["--port", str(port)]
    return out


def model_files(argv: list[str]) -> list[str]:
    """Every file of the model in argv's -m: all parts of a split GGUF."""
    path = next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a in ("-m", "--model")), None)
    if path is None:
        raise BenchError("the running llama-server has no -m/--model argument")
    split = _SPLIT.fullmatch(path)
    if not split:
        return [path]
    stem, total = split.group(1), int(split.group(3))
    return [f"{stem}-{k:05d}-of-{total:05d}.gguf" for k in range(1, total + 1)]


def free_port(conn) -> int:
    """A TCP port free on the host's loopback now."""
    return int(run_remote(conn, shell.Raw(_FREE_PORT)).strip())


class Copy:
    """A copy of `server` as the transient system unit `unit` on its host, in the deployed
    unit's sandbox (roles.services.unit_files.server_sandbox: DynamicUser, its groups, device
    and IP rules, the API key as a credential; key_path is where the copy reads it), stopped by
    stop() and after COPY_MAX_SECONDS at the latest."""

    def __init__(self, conn, sudo: bool, cluster, server, unit: str, key: str | None):
        from meshdeploy.roles.services.unit_files import server_sandbox

        self.conn, self.sudo, self.unit = conn, sudo, unit
        self.key_path = f"/run/credentials/{unit}.service/api-key" if key else None
        self.props = [p for p in server_sandbox(cluster, cluster.host(server.host), server)
                      if key or not p.startswith("LoadCredential=")]
        self.props.append(f"RuntimeMaxSec={COPY_MAX_SECONDS}")

    def api(self, port: int, key: str | None) -> Api:
        """The copy's API on a loopback port: the key goes only to this unit's listener."""
        return Api(self.conn, "127.0.0.1", port, key, unit=self.unit,
                   sudo=self.sudo)

    def refusal(self, argv: list[str]) -> str | None:
        """Why `argv` cannot run as this unit, or None."""
        # systemd-run hands argv over D-Bus; `$` may still be expanded and `%` resolved by some
        # versions, so a word holding either is refused rather than escaped here.
        odd = next((w for w in argv + self.props if "$" in w or "%" in w), None)
        return None if odd is None else \
            f"{odd!r} holds '$' or '%', which a transient unit may expand"

    def start(self, argv: list[str]) -> None:
        self.stop()  # one left by a killed run holds the name
        start = ["systemd-run", "--quiet", "--collect", "--unit", self.unit]
        for prop in self.props:
            start += ["-p", prop]
        run_remote(self.conn, shell.join([*start, "--", *argv]), self.sudo)

    def active(self) -> bool:
        state = run_remote(self.conn, shell.command("systemctl", "is-active", self.unit,
                                                    shell.OR, "true"))
        return state.strip() in ("active", "activating", "reloading")

    def stop(self) -> None:
        run_remote(self.conn, shell.command(
            "systemctl", "stop", self.unit, shell.QUIET, shell.THEN, "systemctl",
            "reset-failed", self.unit, shell.QUIET, shell.THEN, "true"), self.sudo)


# -- the server and its build ------------------------------------------------------------------

def read_key(conn, server, sudo: bool) -> str | None:
    """The server's API key from its root-only file on the host (first non-empty line), or None
    when it has none. Never printed, logged or stored."""
    if not server.api_key_file:
        return None
    text = run_remote(conn, shell.command("cat", "--", server.api_key_file), sudo=sudo)
    return next((line.strip() for line in text.splitlines() if line.strip()), None)


def rootless_layout(conn, host):
    """A rootless host's layout: its prefix, manager and services folder (core.account, read
    over this connection)."""
    from meshdeploy.core import account

    text = run_remote(conn, shell.command("sh", "-c", account.SCRIPT))
    return account.layout(account.parse(host.name, text.splitlines()))


def build_of(conn, api: Api, prefix: str) -> dict:
    manifest = run_remote(conn, shell.script(
        'sed -n \'s/^commit=//p\' "$CURRENT/manifest" 2>/dev/null; true',
        CURRENT=llama_cpp_paths(prefix)["current"])).strip()
    try:
        _, props = api.call("GET", "/props")
    except Exception:  # older servers without /props: the manifest says enough
        props = {}
    return {"commit": manifest or None, "info": props.get("build_info")}


# -- the orchestrator alone ----------------------------------------------------------------------

# Memory a llama-server needs besides the model's bytes (context, compute buffers): a rough,
# documented margin for the "does it fit" check.
LOCAL_MARGIN = 512 << 20


def fits(model_bytes: int, available_bytes: int) -> tuple[bool, str]:
    """Whether a second copy of the model fits beside what runs: the model's bytes plus
    LOCAL_MARGIN against MemAvailable (system memory only: GPU memory is not checked)."""
    gib = 1 << 30
    need = model_bytes + LOCAL_MARGIN
    text = (f"model {model_bytes / gib:.2f} GiB + {LOCAL_MARGIN >> 20} MiB margin, "
            f"{available_bytes / gib:.2f} GiB available")
    return need <= available_bytes, text


_MEMINFO = "sed -n 's/^MemAvailable: *\\([0-9]*\\) kB$/\\1/p' /proc/meminfo"


LOCAL_UNIT = "meshdeploy-bench-{name}"


def compare_local(conn, sudo: bool, cluster, server, key: str | None, runs: int,
                  n_predict: int, progress, argv: list[str] | None = None) -> dict:
    """The same binary and model, without the workers, on a free loopback port of the
    orchestrator, as a transient systemd unit (Copy: stopped afterwards in every case).
    + argv: the deployed server's as planned_argv renders it (bench --sweep has it already)"""
    unit = Copy(conn, sudo, cluster, server, LOCAL_UNIT.format(name=server.name), key)
    argv = planned_argv(conn, cluster, server) if argv is None else argv
    files = model_files(argv)
    sizes = run_remote(conn, shell.command("stat", "-L", "-c", "%s", "--", *files), sudo)
    available = int(run_remote(conn, shell.command(shell.Raw(_MEMINFO))).strip() or 0) * 1024
    ok, why = fits(sum(int(s) for s in sizes.split()), available)
    if not ok:
        return {"skipped": f"the model does not fit beside what runs on the host ({why})"}
    port = free_port(conn)
    argv = local_argv(argv, port, unit.key_path)
    odd = unit.refusal(argv)
    if odd is not None:
        return {"skipped": odd}
    try:
        progress(f"starting {unit.unit} on port {port} (no workers)")
        unit.start(argv)
        api = unit.api(port, key)
        api.wait_healthy(server.health.retries * server.health.interval + 30)
        result = measure(api, runs, n_predict, progress)
    finally:
        unit.stop()
    return {**result, "port": port, "fits": why, "argv": argv}
