"""Build keys: which hosts can run the same llama.cpp binaries, and which one compiles them.

A build key names one installed build (`builds/<key>/`): `<commit12>-<backend>-<hash>`, the hash
over what decides whether a binary built on one host runs on another:

- the backend and every cmake flag the build gets (the common ones, the backend's and the GPU
  code it compiles for (gpu_code), Termux's GGML_NATIVE=OFF, the portable flags below, ccache,
  the file's cmake_flags): what is compiled;
- the platform: the kernel, the CPU architecture (`uname -m`), the distribution and its release
  (toolchain.Platform) and the C library and its version (facts.Libc). The binaries are static
  only in llama.cpp's own libraries; they still link the system's C library, libstdc++ and
  OpenMP, so they run where those are the ones they were linked against, on the same
  instruction set.

Not the targets: hosts of one key share one build, and the host that compiles it builds the
union of what they need (llama-server where a server runs, the RPC worker where rpc-servers
run). An installed build is used only where it holds the binaries its host needs (`covers`).

Portable builds. Upstream's GGML_NATIVE (on by default) compiles for the CPU that builds
(-march=native): such binaries can die with "Illegal instruction" on another CPU of the same
architecture. So when two or more hosts share a key and their CPUs differ (facts.CpuFlags: the
sha256 of /proc/cpuinfo's flags; a host that does not say counts as different), their build is
portable: on x86-64 llama.cpp's runtime CPU dispatch (every x86 level as a loadable
libggml-cpu-<variant>.so, the best one chosen at start: nothing lost on a newer CPU, nothing
that an older one cannot run), elsewhere -DGGML_NATIVE=OFF. Where they all report the same
flags -march=native is right for every one of them and stays (a dispatch build compiles about
twice as long). llama_cpp.build.cmake_flags naming GGML_NATIVE wins over both, as on Termux. A
host alone with its key keeps the default flags: its build, its cmake invocation and its ccache
entries stay what they were. Whether hosts share is decided on the hosts the run probes (a
`--limit` run sees only its own); a plan without the other hosts' facts (a pyinfra deploy
calling one operation) keeps whichever of the two keys its host runs now.

Who compiles. Per key one builder; the others copy its installed build (llama_cpp.copy), so a
key costs one compile. The builder packs it (a tarball and its sha256); apply reads that sha256
back from the builder over SSH and each copy is checked against it, so a copy never trusts what
the LAN alone says. The builder is, in this order: a host that `-replace=HOST/llama_cpp.build`
names (it compiles anyway); a host that already has the build installed with every binary the
key's hosts need (no compile at all), unless llama_cpp.build.serial (one host at a time in file
order: the build that the others copy must come first); else the first host of the key in file
order. Other hosts that -replace names compile too, for themselves.

Never up a privilege boundary. A rootless host's build is the login user's: its tarball, the
sha256 beside it and its manifest sit in that user's folders, where anything running as that
user (its own llama-server, a taken-over rpc-server) can replace them together. So a rootless
host builds for others only where every host of the key is rootless: where the key has a host
with root, its builder is a host with root (-replace of a rootless host makes it compile for
itself alone, and a build a rootless host holds does not make it the one that has the build),
and the rootless hosts of the key copy from that builder, as root's bytes may flow down to them.
Under a tunnel the stars are formed with the hosts with root first, so a star a host with root
joins has one as its first host.

Cross-compiling. A Raspberry Pi compiles llama.cpp in an hour or more, an emulated arm64 host
far longer. So the hosts of an aarch64 CPU key (a key of one platform: the same Debian release
and C library) have their build compiled by an x86-64 host of the cluster with root, apt and
that same release and C library, a CPU build host itself: the first such in file order,
chosen from the probed platforms alone (never from installed builds or -replace), so the same
host every run; it comes before a host that holds a copy of the build, and cross-compiles even
in a run where it copies its own build from another (-replace elsewhere). It installs Debian's cross compiler
(g++-aarch64-linux-gnu, whose C library is its release's own version, built for arm64) and
compiles with a cmake toolchain file (llama_cpp.cross, after its own build), portable code
(GGML_NATIVE=OFF: the builder cannot ask the target's CPU); the aarch64 hosts copy that build,
checked as every copy is, and run its binaries first as nobody before they become current. A
key with a cross builder is portable whoever compiles it, so a native build of it (-replace on
an aarch64 host) is the same key, and a run that cannot see the cross builder (--limit, the
builder away) keeps the portable build the host runs rather than compiling another natively.
No cross build where the file's cmake_flags turn GGML_NATIVE on. Portable code on aarch64 is the armv8-a baseline (no dotprod, no i8mm): llama.cpp's
runtime CPU dispatch for ARM Linux (b11312) always compiles two armv9.2-a+sme variants, which
GCC 12 (Debian 12's, native or cross) refuses ("unknown value for -march"), so it is not used
there. No cross-compiling under a tunnel (the copy would have to cross between
stars), nor for GPU backends (their libraries for another architecture are not set up).

The builders and their copiers go to the other roles as the run's build_copiers (copiers()):
network.allowlist opens md-share's port on a builder to its copiers alone, as for models.

Nobody shares where the file says so (llama_cpp.build.copy: false: every host compiles), nor
where the copy could not travel when it runs: a host whose platform the probe
could not tell (no C library version: macOS, Termux), and every host under network.transport:
ssh (llama_cpp runs before the forwards exist).

Under network.transport: wireguard the copy travels through the tunnel (network.wireguard runs
before llama_cpp.copy), which joins only RPC peers (Cluster.tunnel_peers). So the hosts of a key
form stars in file order (tunnel_stars): each joins the first star whose first host is its
peer, or starts one; a star's first host is its builder (compiling, or holding the build
already), the rest copy from it, and a host that -replace names elsewhere in a star compiles
for itself alone.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace

from meshdeploy.core.context import HostContext, Resolved
from meshdeploy.roles.llama_cpp import defaults as d
from meshdeploy.roles.llama_cpp import run, settings

RESOURCE = "llama_cpp.build"
SHA256 = re.compile(r"[0-9a-f]{64}")
_NATIVE = re.compile(r"(-D\s*)?GGML_NATIVE[:=]")


def targets(cluster, host) -> list[str]:
    """What this host needs: llama-server where a server runs, the worker where RPC is served."""
    wanted = []
    if any(s.host == host.name for s in cluster.servers):
        wanted.append(d.llama_cpp_server_target)
    if host.rpc_servers:
        wanted.append("rpc")
    return wanted


def _names_native(cluster) -> bool:
    return any(_NATIVE.match(f) for f in settings.of(cluster).build.cmake_flags)


def kernel(host, facts: dict | None) -> str:
    """The host's kernel as the probe saw it (toolchain.Platform); without facts what its backend
    implies (Metal: macOS)."""
    seen = ((facts or {}).get("toolchain.Platform") or {}).get("kernel")
    return seen or ("Darwin" if host.backend == "metal" else "Linux")


def gpu_code(cluster, host, facts: dict | None) -> tuple[str, ...] | None:
    """The GPU code a cuda or rocm build compiles for: the file's list
    (llama_cpp.build.cuda_architectures / amdgpu_targets: one list for every host, so hosts
    with other GPUs can share a build), else what the host's driver reports (facts.py); None
    where neither says (llama_cpp's preflight refuses), () for the other backends."""
    b, facts = settings.of(cluster).build, facts or {}
    if host.backend == "cuda":
        return b.cuda_architectures or tuple(facts.get("llama_cpp.CudaCompute") or ()) or None
    if host.backend == "rocm":
        hip = facts.get("llama_cpp.Hip") or {}
        return b.amdgpu_targets or tuple(hip.get("targets") or ()) or None
    return ()


def gpu_flags(cluster, host, facts: dict | None) -> tuple[str, ...]:
    code = gpu_code(cluster, host, facts)
    name = d.llama_cpp_gpu_code_flags.get(host.backend)
    return (f"-D{name}={';'.join(code)}",) if name and code else ()


def machine(facts: dict | None) -> str | None:
    return ((facts or {}).get("toolchain.Platform") or {}).get("machine")


def one_cpu(ctx, members) -> bool:
    """Whether every host of `members` reports the same CPU flags (facts.CpuFlags): then
    -march=native on the builder is right for all of them, and their shared build stays native
    (no dispatch build, which takes about twice as long to compile)."""
    seen = {(_facts_of(ctx, m) or {}).get("llama_cpp.CpuFlags") for m in members}
    return len(seen) == 1 and None not in seen


def cmake_flags(cluster, host, termux: bool = False, portable: bool = False,
                facts: dict | None = None) -> list[str]:
    """The build's cmake flags; `termux`: the host is Termux (toolchain.Platform), `portable`: its
    build is copied to other hosts; either gets -DGGML_NATIVE=OFF unless
    llama_cpp.build.cmake_flags set GGML_NATIVE. `facts`: the host's (its kernel)."""
    b = settings.of(cluster).build
    host_flags = d.llama_cpp_termux_cmake_flags if termux and not _names_native(cluster) else ()
    if portable and not host_flags and not _names_native(cluster):
        host_flags = d.llama_cpp_portable_cmake_flags
        if machine(facts) in d.llama_cpp_dispatch_machines:
            host_flags = d.llama_cpp_dispatch_cmake_flags
    return ([f"-DCMAKE_BUILD_TYPE={b.type}", *d.llama_cpp_common_cmake_flags,
             *d.llama_cpp_openmp_cmake_flags.get(kernel(host, facts), ()),
             *d.llama_cpp_backend_cmake_flags[host.backend], *gpu_flags(cluster, host, facts),
             *host_flags,
             f"-DGGML_CCACHE={'ON' if b.ccache else 'OFF'}", *b.cmake_flags])


def platform(facts: dict) -> str | None:
    """What of a host's platform its binaries depend on, from its facts: "Linux x86_64 debian 12
    glibc 2.36"; None when the probe could not tell (no machine or C library: macOS, Termux)."""
    p = facts.get("toolchain.Platform") or {}
    libc = facts.get("llama_cpp.Libc")
    if not p.get("machine") or not libc or p.get("termux"):
        return None
    return " ".join([p.get("kernel") or "?", p["machine"], p.get("distro") or "?",
                     p.get("version") or "?", libc])


def flavour(cluster, host, termux: bool = False, where: str | None = None,
            portable: bool = False, facts: dict | None = None) -> str:
    """Hash of everything but the commit that decides whether two hosts can run one build."""
    blob = "\n".join([host.backend, *cmake_flags(cluster, host, termux, portable, facts),
                      f"platform={where or 'unknown'}"])
    return hashlib.sha256(blob.encode()).hexdigest()[:8]


def build_key(cluster, host, commit: str, termux: bool = False, where: str | None = None,
              portable: bool = False, facts: dict | None = None) -> str:
    return (f"{commit[:12]}-{host.backend}-"
            f"{flavour(cluster, host, termux, where, portable, facts)}")


def on_termux(facts: dict) -> bool:
    return bool((facts.get("toolchain.Platform") or {}).get("termux"))


def covers(manifest: dict | None, wanted) -> bool:
    """Whether an installed build (its manifest) holds every binary of `wanted` (targets())."""
    if not manifest:
        return False
    have = set((manifest.get("targets") or "").split())
    rpc = manifest.get("rpc_binary") or ""
    return all((rpc in have and bool(rpc)) if t == "rpc" else t in have for t in wanted)


@dataclass(frozen=True)
class Decision:
    """What llama_cpp decides for one host's build."""

    key: str
    builder: str  # the host that compiles the key's build; this host's own name when it does
    members: tuple[str, ...]  # the hosts of the key that share the build (file order)
    targets: tuple[str, ...]  # what this host compiles (builders), or needs (copiers)
    why: str  # why that host compiles, as the plan says it
    portable: bool = False  # built with llama_cpp_portable_cmake_flags
    code: str = ""  # the CPU code a shared build compiles, and why (the plan says it)
    cross: str = ""  # the machine the builder cross-compiles for (aarch64), "" when native

    def copies(self, host_name: str) -> bool:
        return self.builder != host_name

    def copiers(self) -> list[str]:
        return [m for m in self.members if m != self.builder]


def _facts_of(ctx, name: str) -> dict:
    if name == ctx.host.name:
        return ctx.facts
    return (ctx.cluster_facts or {}).get(name) or {}


def _shares(cluster) -> bool:
    return settings.of(cluster).build.copy and not cluster.network.forwarded


def tunnel_stars(cluster, names: list[str]) -> list[list[str]]:
    """`names` (file order) as stars under a tunnel: each host joins the first star whose first
    host is its tunnel peer, or starts one (module docstring)."""
    stars: list[list[str]] = []
    for name in names:
        peers = {p.name for p in cluster.tunnel_peers(cluster.host(name))}
        star = next((s for s in stars if s[0] in peers), None)
        if star is None:
            stars.append([name])
        else:
            star.append(name)
    return stars


def group(ctx) -> list[str] | None:
    """The hosts (file order; under a tunnel this host's star, hosts with root first) whose
    builds could be this host's: same backend, flags and platform, each probed in this run;
    None when the other hosts' facts are not known."""
    if ctx.cluster_facts is None:
        return None
    cluster, host = ctx.cluster, ctx.host
    mine = platform(ctx.facts)
    if mine is None or not _shares(cluster):
        return [host.name]
    termux = on_termux(ctx.facts)
    same = [h.name for h in cluster.hosts
            if (h.name == host.name or h.name in ctx.cluster_facts)
            and h.backend == host.backend and targets(cluster, h)
            and platform(_facts_of(ctx, h.name)) == mine
            and on_termux(_facts_of(ctx, h.name)) == termux
            and gpu_code(cluster, h, _facts_of(ctx, h.name)) == gpu_code(cluster, host, ctx.facts)]
    if not cluster.network.tunnel:
        return same
    # The hosts with root first: a star's first host builds for it (module docstring).
    ordered = sorted(same, key=lambda name: cluster.host(name).rootless)
    return next(star for star in tunnel_stars(cluster, ordered) if host.name in star)


def cross_builder(ctx, members: list[str]) -> str | None:
    """The host that cross-compiles this host's key (module docstring), or None: this host is
    not of an architecture others compile for, or no host of the cluster can. Chosen from the
    probed platforms and the file alone (never from installed builds or -replace), so it stays
    the same from run to run."""
    cluster, host, facts = ctx.cluster, ctx.host, ctx.cluster_facts or {}
    target = machine(ctx.facts)
    mine = platform(ctx.facts)
    if (mine is None or target not in d.llama_cpp_cross_triplets or cluster.network.tunnel
            or host.backend not in d.llama_cpp_cross_backends or not _shares(cluster)
            or _native_on(cluster)):
        return None
    for h in cluster.hosts:
        theirs = _facts_of(ctx, h.name) if h.name in facts else {}
        built_on = machine(theirs)
        if (h.name in members or h.rootless or h.backend != host.backend
                or built_on not in d.llama_cpp_cross_from or not targets(cluster, h)
                or "apt-get" not in ((theirs.get("toolchain.Platform") or {}).get("tools") or ())
                or platform(theirs) != mine.replace(f" {target} ", f" {built_on} ", 1)):
            continue
        return h.name
    return None


def _native_on(cluster) -> bool:
    """Whether llama_cpp.build.cmake_flags turn GGML_NATIVE on: code for the CPU that compiles,
    which a cross build cannot have."""
    flags = [f.split("=", 1)[-1].upper() for f in settings.of(cluster).build.cmake_flags
             if _NATIVE.match(f)]
    return bool(flags) and flags[-1] in ("ON", "1", "TRUE", "YES", "Y")


def cross_builds(ctx) -> list[Decision]:
    """The builds this host cross-compiles (llama_cpp.cross): one Decision per key of another
    architecture whose builder it is, its targets what the key's hosts need together."""
    if ctx.cluster_facts is None or not targets(ctx.cluster, ctx.host):
        return []
    cluster, here = ctx.cluster, machine(ctx.facts)
    out: dict[str, Decision] = {}
    for h in cluster.hosts:
        if h.name == ctx.host.name or h.name not in ctx.cluster_facts or not targets(cluster, h):
            continue
        facts = ctx.cluster_facts[h.name]
        theirs = decide(HostContext(cluster, h, facts, ctx.resolved,
                                    cluster_facts=ctx.cluster_facts))
        if theirs.builder != ctx.host.name or machine(facts) == here or theirs.key in out:
            continue
        out[theirs.key] = replace(theirs, targets=tuple(needed(cluster, theirs.members)))
    return list(out.values())


def may_build_for(cluster, members) -> list[str]:
    """The hosts of `members` whose build the others may copy: the hosts with root, or all of
    them where every one is rootless (never a build up a privilege boundary: module docstring)."""
    return [m for m in members if not cluster.host(m).rootless] or list(members)


# Stands for the commit in decide() while the ref is not resolved yet (RemoteRef on a first host
# without git): no installed build has its key, so the builder is the one a fresh key gets. The
# steps never show that key: theirs is known after apply.
UNRESOLVED = "0" * 40


def copiers(cluster, hosts, facts: dict, commit: str | None,
            replacing=()) -> dict[str, tuple[str, ...]]:
    """builder -> the hosts that copy its build (decide(), `replacing`: the run's -replace
    addresses), for every planned builder that has some: network opens md-share's port on it
    to them alone.

    Also while the commit is unknown (None: no host had git when the plan probed, as on hosts
    with nothing installed): which hosts share a build depends on their platform, backend and
    flags, all probed before anything is installed, never on the commit, and the builder is
    the first of them in file order (with root, where any has) unless a host holds the key's
    build, which the plan takes none to do. So the first plan on fresh hosts shows the allow-list that apply converges to,
    and the plan after it has nothing to open. Apply decides again once it resolves the ref
    (llama_cpp.resolve).

    A host that -replace makes compile its own build in this run (an arm64 host's native
    build) stays among the copiers of the builder it copies from in runs without it, where that
    builder still compiles its own: -replace is for this run, and the builder's md-share port
    would otherwise close for it now and open again in the next plan."""
    def builders(replace) -> dict[str, str]:
        resolved = Resolved(replace=tuple(replace)).fixed(run.ROLE, run.Run(commit=commit))
        return {h.name: decide(HostContext(cluster, h, facts[h.name], resolved,
                                           cluster_facts=facts)).builder
                for h in hosts if targets(cluster, h) and h.name in facts}

    now = builders(replacing)
    usual = builders(()) if replacing else now
    out: dict[str, list[str]] = {}
    for name, builder in now.items():
        if builder == name and usual[name] != name and now.get(usual[name]) == usual[name]:
            builder = usual[name]  # compiles itself in this run only (-replace)
        if builder != name:
            out.setdefault(builder, []).append(name)
    return {builder: tuple(names) for builder, names in out.items()}


def _installed(ctx, name: str, key: str) -> dict | None:
    return ((_facts_of(ctx, name).get("llama_cpp.Builds") or {}).get("builds") or {}).get(key)


def needed(cluster, members) -> list[str]:
    """What the hosts of `members` need together (targets()): what their builder compiles."""
    return [t for t in ("llama-server", "rpc")
            if any(t in targets(cluster, cluster.host(m)) for m in members)]


def runs_portable(ctx, termux: bool, where: str | None) -> bool:
    """Whether the build the host runs now is its portable one, of whatever commit (a key is
    <commit12>-<backend>-<flavour>: compared without the commit)."""
    current = (ctx.fact("llama_cpp.Builds") or {}).get("current") or ""
    portable = build_key(ctx.cluster, ctx.host, UNRESOLVED, termux, where, True, ctx.facts)
    return current.partition("-")[2] == portable.partition("-")[2]


def decide(ctx) -> Decision:
    """This host's build key, who compiles it, and what that compile builds (module docstring);
    while the ref is not resolved the key stands for a build of an unknown commit (UNRESOLVED)
    and the builder is the one such a build gets."""
    cluster, host, commit = ctx.cluster, ctx.host, run.of(ctx.resolved).commit or UNRESOLVED
    termux = on_termux(ctx.facts)
    where = platform(ctx.facts)
    own = targets(cluster, host)
    members = group(ctx)
    if members is None:  # alone here: keep the key of the build it runs now, portable or not
        portable = runs_portable(ctx, termux, where)
        key = build_key(cluster, host, commit, termux, where, portable, ctx.facts)
        return Decision(key, host.name, (host.name,), tuple(own), "", portable)
    cross = cross_builder(ctx, members)
    portable = bool(cross) or (len(members) > 1 and not one_cpu(ctx, members))
    if not portable and machine(ctx.facts) in d.llama_cpp_cross_triplets:
        # A run that cannot see its cross builder (--limit, the builder away) keeps the
        # portable build the host runs, rather than compiling another key natively.
        portable = runs_portable(ctx, termux, where)
    key = build_key(cluster, host, commit, termux, where, portable, ctx.facts)
    if len(members) == 1 and not cross:
        return Decision(key, host.name, (host.name,), tuple(own), "")
    cpus = ("their CPUs differ" if all(_facts_of(ctx, m).get("llama_cpp.CpuFlags")
                                       for m in members) else "not every CPU reported its flags")
    if _names_native(cluster):
        code = "GGML_NATIVE as llama_cpp.build.cmake_flags sets it"
    elif cross:
        code = f"portable code: compiled where no {machine(ctx.facts)} CPU can be asked"
    elif not portable:
        code = "-march=native: every host of it reports the same CPU flags"
    elif machine(ctx.facts) in d.llama_cpp_dispatch_machines and not termux:
        code = f"runtime CPU dispatch: {cpus}"
    else:
        code = f"portable code: {cpus}"
    replaced = [m for m in members if ctx.replacing(RESOURCE, m)]
    trusted = may_build_for(cluster, members)
    # Other -replace'd hosts compile alone; under a tunnel every one but the star's first host
    # (one with root where the star has one: group()), else every one but the first that may
    # build for the others.
    tunnel = cluster.network.tunnel
    lead = members[:1] if tunnel else [m for m in replaced if m in trusted][:1]
    alone = [m for m in replaced if m not in lead]
    sharing = [m for m in members if m not in alone]
    if host.name in alone:
        return Decision(key, host.name, (host.name,), tuple(own), "-replace builds it here",
                        portable)
    need = needed(cluster, sharing)
    installed = [m for m in sharing if m in trusted and covers(_installed(ctx, m, key), need)]
    if tunnel:  # the star's first host: its peers alone can reach it through the tunnel
        builder = sharing[0]
        why = ("-replace builds it there" if builder in replaced
               else "it has that build installed" if builder in installed
               else "the first host of the key in file order whose tunnel peers copy it")
    elif lead:
        builder, why = lead[0], "-replace builds it there"
    elif cross:  # before the hosts that hold a copy: the same builder every run
        builder, why = cross, f"cross-compiled on {cross} for {machine(ctx.facts)}"
        return Decision(key, builder, tuple(sharing), tuple(own), why, portable, code,
                        machine(ctx.facts) or "")
    elif installed and not settings.of(cluster).build.serial:
        builder, why = installed[0], "it has that build installed"
    elif trusted[0] != sharing[0]:
        builder, why = trusted[0], "the first host of the key in file order with root"
    else:
        builder, why = sharing[0], "the first host of the key in file order"
    wanted = need if builder == host.name else own
    return Decision(key, builder, tuple(sharing), tuple(wanted), why, portable, code)
