"""toolchain: build tools (cmake, compiler, git, curl, ninja, ccache), what a host that copies
its llama.cpp build needs instead, and the apt proxy."""

from __future__ import annotations

import re

from meshdeploy.config import distribution
from meshdeploy.core import shell
from meshdeploy.core.context import HostContext, Step, Teardown
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.errors import PlanError
from meshdeploy.roles.toolchain import defaults as d
from meshdeploy.roles.toolchain.facts import AptComponents, AptProxy, DebPackages, Platform

ROLE = "toolchain"


# Who copies. A host among the llama_cpp run's build_copiers (keys.copiers) copies its
# llama.cpp build and compiles none of it, so on apt it gets the copy set (defaults.py), not
# cmake, a C++ compiler or ninja. llama_cpp.resolve decides the copiers again at apply, after
# this step; can a plan's copier then compile? A key's builder (keys.decide) is the first host
# -replace names, else a host that has the key's build installed, else the first host of the
# key in file order. -replace is the same at plan and apply, and a -replace'd host is never a
# copier. The key's hosts are the same (their probed platforms, backends and flags); only the
# commit can differ, unknown at plan (keys.UNRESOLVED, which no installed build has), and with
# it only which host has the build installed. So a plan's copier becomes a builder at apply only
# as one that has the build: it packs and serves it (pack.sh, md-share) and compiles nothing.
# Every other builder at apply is the first -replace'd or the first in file order, as at plan.
# A failed copy never falls back to a compile either: llama_cpp.copy stops and names
# -replace=HOST/llama_cpp.build, whose plan gives HOST the whole toolchain.

# The llama_cpp role: its section of the cluster file (builds_use_ccache), and its run values'
# build_copiers (who copies a build: _copiers).
LLAMA_CPP = "llama_cpp"


def _copiers(ctx: HostContext) -> dict:
    """Builder -> the hosts that copy its llama.cpp build (llama_cpp's prepare, keys.copiers)."""
    return ctx.resolved.value(LLAMA_CPP, "build_copiers", {})


def copies_from(ctx: HostContext) -> str | None:
    """The host whose llama.cpp build this one copies (_copiers), or None where it
    compiles its own, runs none, or -replace makes it compile."""
    if ctx.replacing("llama_cpp.build"):
        return None
    return next((builder for builder, copiers in _copiers(ctx).items()
                 if ctx.host.name in copiers), None)


def wanted_packages(cluster, manager: str, host, copier: bool = False,
                    first: bool = False, cross: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The packages `host` wants from `manager`: the build tools, or on apt for a `copier`
    (copies_from) what copying and running the build needs, git where it is the `first` host
    of the run (it resolves the ref) and a C compiler where md-rpc-seed runs; on apt the cross
    compilers for the machines of `cross` (cross_targets)."""
    if copier and manager == "apt":
        base = d.toolchain_apt_copier_packages
        if first:
            base = base + (d.toolchain_apt_git_package,)
        if distribution.seeds(cluster, host):
            base = base + d.toolchain_apt_seed_packages
        base = base + d.toolchain_apt_copier_backend.get(host.backend, ())
    else:
        base = {"apt": d.toolchain_apt_packages, "dnf": d.toolchain_dnf_packages,
                "brew": d.toolchain_brew_packages}[manager]
        if builds_use_ccache(cluster):
            base = base + (d.toolchain_ccache_package,)
        base = base + d.toolchain_backend_packages.get(manager, {}).get(host.backend, ())
        if manager == "apt":
            for target in cross:
                base = base + d.toolchain_apt_cross_packages.get(target, ())
    if (distribution.share_clients(cluster, host) or _supervises(cluster, host)) \
            and manager != "brew":  # macOS ships python3 with its CLT
        # md-share serves the host's model copy; md-failover runs its llama-servers.
        base = base + (d.toolchain_python_package,)
    if manager == "apt" and not host.rootless and cluster.ssh_forwards(host):
        # The forwards run as a DynamicUser, and ssh exits when it cannot look its own user up:
        # nss-systemd names those users (Debian's package adds it to nsswitch.conf; Fedora has
        # it by default).
        base = base + (d.toolchain_nss_systemd_package,)
    return base


def cross_targets(ctx: HostContext) -> tuple[str, ...]:
    """The machines this host compiles llama.cpp builds for besides its own: those of the hosts
    that copy its builds (_copiers) with another machine (llama_cpp/keys.py)."""
    def machine(name: str):
        return (ctx.fact_of(name, "toolchain.Platform") or {}).get("machine")

    mine = machine(ctx.host.name)
    return tuple(sorted({machine(m) for m in _copiers(ctx).get(ctx.host.name, ())
                         if machine(m) and machine(m) != mine}))


def copy_note(source: str | None, manager: str) -> str:
    """What the plan adds to toolchain.packages' reason where the host gets the copy set rather
    than the build tools (apt alone: wanted_packages)."""
    return f"; copies its llama.cpp build from {source}: no compiler" \
        if source and manager == "apt" else ""


def sections(cluster, host) -> list[Section]:
    # The probe runs before anyone knows who copies: DebPackages asks for what either kind of
    # host could want (first=True: git is in the build tools anyway).
    # The cross compilers too, on a host with root: whether it compiles for another
    # architecture is known once every host is probed.
    cross = () if host.rootless else tuple(d.toolchain_apt_cross_packages)
    queried = dict.fromkeys(wanted_packages(cluster, "apt", host, cross=cross)
                            + wanted_packages(cluster, "apt", host, copier=True, first=True))
    out = [
        Section("toolchain.Platform", Platform),
        Section("toolchain.DebPackages", DebPackages, {"packages": tuple(queried)}),
    ]
    if not host.rootless:  # apt's configuration is root's: a rootless host has no proxy file
        out.append(Section("toolchain.AptProxy", AptProxy))
    if host.backend == "cuda":  # Debian's CUDA toolkit is in non-free (Ubuntu's in multiverse)
        out.append(Section("toolchain.AptComponents", AptComponents))
    return out


def package_manager(platform: dict) -> str | None:
    tools = platform.get("tools", [])
    if platform.get("kernel") == "Darwin":
        return "brew" if "brew" in tools else None
    if platform.get("termux"):  # Termux has apt-get too, inside the app, driven by pkg
        return "pkg"
    for manager, binary in (("apt", "apt-get"), ("dnf", "dnf")):
        if binary in tools:
            return manager
    return None


def preflight(ctx: HostContext) -> None:
    """Refuse, before any change, what cannot work on this host."""
    platform = ctx.fact("toolchain.Platform") or {}
    host, backend = ctx.host.name, ctx.host.backend
    kernel = platform.get("kernel") or "an unknown OS"
    tools = platform.get("tools", [])
    if backend == "metal" and kernel != "Darwin":
        raise PlanError(f"llama.cpp Metal builds need macOS; host {host} reports {kernel}",
                        hint=f"set hosts.{host}.backend to cpu or vulkan")
    if backend == "cuda" and "nvcc" not in tools:
        refuse_cuda_toolkit(ctx, platform)
    # No NVIDIA driver is no refusal here: a host may compile for GPUs it does not have
    # (llama_cpp's preflight wants llama_cpp.build.cuda_architectures then).
    if platform.get("termux") and not ctx.host.rootless:
        raise PlanError(f"host {host} runs Termux, where nothing has root",
                        hint=f"set hosts.{host}.rootless: true")
    if ctx.host.rootless:
        refuse_missing(ctx, platform)
    elif package_manager(platform) is None:
        extra = d.toolchain_backend_packages["apt"].get(backend)
        raise PlanError(f"host {host}: no supported package manager (apt, dnf, Homebrew) found",
                        hint="install cmake, a C++ compiler, git, curl and ninja"
                             + (f" and what {backend} builds need (Debian's names: "
                                f"{' '.join(extra)})" if extra else "")
                             + " by hand or use a Debian, Ubuntu, Fedora/RHEL or macOS host")
    have = platform.get("cmake_version")
    if (have and tuple(have) < d.toolchain_cmake_min and package_manager(platform) != "brew"
            and not copies_from(ctx)):  # a copier runs no cmake
        need = ".".join(map(str, d.toolchain_cmake_min))
        raise PlanError(f"host {host} has cmake {'.'.join(map(str, have))}; llama.cpp needs "
                        f">= {need}",
                        hint="install a newer cmake (e.g. from backports or pip install cmake)")


def refuse_cuda_toolkit(ctx: HostContext, platform: dict) -> None:
    """PlanError where a cuda host lacks nvcc and its package manager cannot bring it: apt
    installs Debian's or Ubuntu's nvidia-cuda-toolkit once the component that holds it is
    enabled, as a user of that distribution enables it; anywhere else the toolkit comes from
    NVIDIA."""
    host = ctx.host.name
    components = d.toolchain_cuda_components.get(platform.get("distro") or "")
    if package_manager(platform) != "apt" or ctx.host.rootless or components is None:
        raise PlanError(f"host {host} has backend cuda but no nvcc on PATH",
                        hint="install the CUDA toolkit (and the NVIDIA driver) on it, "
                             "or choose another backend")
    enabled = ctx.fact("toolchain.AptComponents") or []
    missing = [c for c in components if c not in enabled]
    if missing:
        need, lack = " and ".join(components), " and ".join(missing)
        raise PlanError(f"host {host} has backend cuda and no nvcc; its distribution's "
                        f"nvidia-cuda-toolkit needs the {need} components, and its apt "
                        f"sources do not enable {lack}",
                        hint=f"add {' '.join(missing)} to the Components: line of "
                             "/etc/apt/sources.list.d/*.sources (or to the deb lines of "
                             "/etc/apt/sources.list) on it, then plan again")


def apt_proxy(ctx: HostContext) -> Step:
    """toolchain.apt_proxy: the apt proxy snippet for hosts without internet."""
    want_url = ctx.section(ROLE)["apt_proxy"] or None  # "" = none (the role's schema.json)
    have = ctx.fact("toolchain.AptProxy")
    manager = package_manager(ctx.fact("toolchain.Platform") or {})
    path = d.toolchain_apt_proxy_file
    if ctx.host.rootless and want_url is not None:
        return Step(ctx.change(ROLE, "apt_proxy", "no-op",
                               f"{want_url} not applied: apt's configuration needs root, and "
                               f"{ctx.host.name} has none"))
    if manager != "apt" or (want_url is None and have is None):
        return Step(ctx.change(ROLE, "apt_proxy", "no-op", "no apt proxy configured"))
    if want_url is None:
        return Step(ctx.change(ROLE, "apt_proxy", "delete", "apt proxy removed from the file",
                               [AttrDiff("path", path, None)]),
                    [shell.command("rm", "-f", path)])
    want = apt_proxy_conf(want_url)
    if have == want:
        return Step(ctx.change(ROLE, "apt_proxy", "no-op", f"apt uses {want_url}"))
    action = "create" if have is None else "update"
    before = None if have is None else have.split('"')[1] if '"' in have else have.strip()
    return Step(ctx.change(ROLE, "apt_proxy", action, f"apt must go through {want_url}",
                           [AttrDiff("proxy", before, want_url)]),
                [shell.write_file(path, want)])


# An apt.conf string ends at '"'; ';', '{' and '}' end or open statements: a proxy URL holding any
# of them (or whitespace, a backslash, a control character) could write further apt options,
# such as an APT::Update::Pre-Invoke hook that runs as root.
_APT_UNSAFE = re.compile(r'["\\;{}\s\x00-\x1f\x7f]')


def apt_proxy_conf(url: str) -> str:
    """The apt.conf snippet for `url`; PlanError for a value apt would read as more than a URL."""
    if not url or _APT_UNSAFE.search(url):
        raise PlanError(f"toolchain.apt_proxy {url!r} cannot be written into apt.conf: it holds a "
                        "quote, ';', '{', '}', a backslash, whitespace or a control character",
                        hint="use a plain URL such as http://10.0.0.1:3142")
    return f'Acquire::http::Proxy "{url}";\nAcquire::https::Proxy "{url}";\n'


def builds_use_ccache(cluster) -> bool:
    """llama_cpp.build.ccache: the llama_cpp role's section, read as data (roles do not import
    each other); the toolchain installs ccache for it."""
    return bool(cluster.sections[LLAMA_CPP]["build"]["ccache"])


def _supervises(cluster, host) -> bool:
    """Whether md-failover (Python) runs a llama-server on `host`."""
    return any(s.host == host.name and cluster.supervised(s) for s in cluster.servers)


def packages(ctx: HostContext) -> Step:
    """toolchain.packages: cmake, compiler, git, curl, ninja (and ccache when asked); on an apt
    host that copies its llama.cpp build (copies_from), what the copy and the binaries need.

    Example: create "install with apt; copies its llama.cpp build from node1: no compiler",
    packages = "curl libgomp1"
    """
    platform = ctx.fact("toolchain.Platform") or {}
    if ctx.host.rootless:
        return rootless_packages(ctx, platform)
    manager = package_manager(platform)
    if manager is None:
        preflight(ctx)  # raises the plain "no supported package manager" error
    cross = cross_targets(ctx)
    # A host that cross-compiles for others needs the build tools, whoever compiles its own.
    source = None if cross else copies_from(ctx)
    wanted = wanted_packages(ctx.cluster, manager, ctx.host, bool(source), ctx.first, cross)
    if (_copiers(ctx).get(ctx.host.name) and manager != "brew"
            and d.toolchain_python_package not in wanted
            and "python3" not in platform.get("tools", [])):
        # md-share serves the llama.cpp build this host compiles to the hosts that copy it
        # (the llama_cpp run's build_copiers); where python3 is on PATH already, nothing to install.
        wanted = wanted + (d.toolchain_python_package,)
    if manager == "apt":
        installed = ctx.fact("toolchain.DebPackages") or {}
        tools = platform.get("tools", [])
        missing = [p for p in wanted if not installed.get(p)
                   and d.toolchain_toolkit_tools.get(p, "-") not in tools]
        command = ("export DEBIAN_FRONTEND=noninteractive; "
                   + shell.command("apt-get", "update", "-qq", shell.AND, "apt-get", "install",
                                   "-y", "-qq", "--no-install-recommends", *missing))
    else:
        # dnf/brew hosts: tools on PATH stand for their packages.
        by_tool = {"cmake": "cmake", "git": "git", "curl": "curl", "ninja": "ninja",
                   "ccache": "ccache", "c++": None}
        tools = set(platform.get("tools", []))
        missing = [p for p in wanted if by_tool.get(p.replace("-build", ""), p) not in tools
                   and p not in ("ca-certificates", "gcc-c++")]
        if manager == "dnf" and "c++" not in tools:
            missing.append("gcc-c++")
        if d.toolchain_backend_tool.get(ctx.host.backend, "-") in tools:
            backend = d.toolchain_backend_packages.get(manager, {}).get(ctx.host.backend, ())
            missing = [p for p in missing if p not in backend]
        if manager == "brew":
            # Homebrew refuses to run as root: never sudo for brew.
            command = shell.command("brew", "install", *missing)
        else:
            command = shell.command("dnf", "install", "-y", *missing)
    copying = copy_note(source, manager)
    if not missing:
        return Step(ctx.change(ROLE, "packages", "no-op",
                               f"{', '.join(wanted)} installed{copying}"))
    return Step(ctx.change(ROLE, "packages", "create", f"install with {manager}{copying}",
                           [AttrDiff("packages", None, " ".join(missing))]),
                [command], sudo=manager != "brew")


# -- hosts without root --------------------------------------------------------------------------
# Termux installs into the app's own prefix as the app's user, so `pkg` needs no root; anywhere
# else a rootless host can only be told what an administrator must install.

def termux_missing(cluster, host, platform: dict) -> list[str]:
    """Termux packages that bring the tools this host lacks (each once, in the role's order)."""
    want = dict(d.toolchain_termux_packages)
    if builds_use_ccache(cluster):
        want.update(d.toolchain_termux_ccache)
    if distribution.share_clients(cluster, host) or _supervises(cluster, host):
        want.update(d.toolchain_termux_python)  # md-share, md-failover
    tools = set(platform.get("tools", []))
    missing = [pkg for tool, pkg in want.items() if tool not in tools]
    if d.toolchain_backend_tool.get(host.backend, "-") not in tools:
        missing += d.toolchain_termux_backend.get(host.backend, ())
    return list(dict.fromkeys(missing))


def rootless_missing(ctx: HostContext, platform: dict) -> tuple[str | None, list[str]]:
    """(package manager or None, what a rootless host that is not Termux lacks): package names
    of apt or dnf, or tool names where neither is there. A package counts as present when its
    tool is on PATH (the user's own cmake, say) or dpkg lists it installed."""
    manager = package_manager(platform)
    manager = manager if manager in ("apt", "dnf") else None
    wanted = wanted_packages(ctx.cluster, manager or "apt", ctx.host, bool(copies_from(ctx)),
                             ctx.first)
    installed = (ctx.fact("toolchain.DebPackages") or {}) if manager == "apt" else None
    tools = set(platform.get("tools", []))
    missing = []
    for package in wanted:
        tool = d.toolchain_package_tools.get(package, package)
        if tool in tools or (installed or {}).get(package) or (tool is None and installed is None):
            continue
        missing.append(package if manager else tool)
    return manager, missing


def refuse_missing(ctx: HostContext, platform: dict) -> None:
    """PlanError naming what a rootless host lacks and the one command an administrator runs;
    nothing on Termux, where `pkg` installs it (toolchain.packages)."""
    if platform.get("termux"):
        return
    manager, missing = rootless_missing(ctx, platform)
    if not missing:
        return
    host = ctx.host.name
    if manager is None:
        hint = (f"an administrator of the host installs {' '.join(missing)} with its package "
                "manager")
    else:
        binary = {"apt": "apt-get", "dnf": "dnf"}[manager]
        hint = ("an administrator of the host runs, once: "
                + shell.command("sudo", binary, "install", "-y", *missing))
    raise PlanError(f"host {host} has no root and lacks {', '.join(missing)}: meshdeploy "
                    "cannot install packages there", hint=hint)


def rootless_packages(ctx: HostContext, platform: dict) -> Step:
    """toolchain.packages on a host without root: `pkg install` on Termux; elsewhere nothing to
    do, or the refusal preflight gives."""
    if not platform.get("termux"):
        refuse_missing(ctx, platform)
        source = copies_from(ctx)
        manager = rootless_missing(ctx, platform)[0] or "apt"
        wanted = wanted_packages(ctx.cluster, manager, ctx.host, bool(source), ctx.first)
        return Step(ctx.change(ROLE, "packages", "no-op",
                               f"{', '.join(wanted)} present{copy_note(source, manager)}"))
    missing = termux_missing(ctx.cluster, ctx.host, platform)
    if not missing:
        return Step(ctx.change(ROLE, "packages", "no-op", "build tools present (Termux)"))
    return Step(ctx.change(ROLE, "packages", "create", "install with pkg (Termux)",
                           [AttrDiff("packages", None, " ".join(missing))]),
                [shell.command("pkg", "install", "-y", *missing)], sudo=False)


def destroy(ctx: HostContext, purge: bool) -> Teardown:
    """meshdeploy's apt proxy snippet; the packages stay, whatever purge says (other software on
    the host may need cmake, git or a compiler, and they are the host's tools, not a cluster's)."""
    if ctx.fact("toolchain.AptProxy") is None:
        return Teardown()
    path = d.toolchain_apt_proxy_file
    return Teardown(steps=(Step(ctx.change(ROLE, "apt_proxy", "delete", "leaves the cluster",
                                           [AttrDiff("path", path, None)]),
                                [shell.command("rm", "-f", path)]),))
