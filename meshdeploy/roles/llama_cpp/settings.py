"""The llama_cpp role's typed settings: the cluster file's `llama_cpp:` section (schema.json in
this folder), read once per Cluster from the section's plain data, defaults filled.

Other roles do not import this module (roles are independent); the one value a neighbour needs
(whether builds go through ccache, for the toolchain) it reads from the section's data itself.
Where hosts with root keep meshdeploy's things (`prefix`) is the core's Cluster.prefix: the
schema marks the field for it (x-meshdeploy-layout).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from meshdeploy.config.model import Cluster, system_layout

ROLE = "llama_cpp"


@dataclass(frozen=True)
class Build:
    type: str
    jobs: int  # 0 = number of cores of the building host
    ccache: bool
    ccache_dir: str | None
    cmake_flags: tuple[str, ...]
    serial: bool
    copy: bool  # hosts of one build key copy one compile (keys.py)
    # GPU code the build compiles for where the host's driver cannot say (keys.py)
    cuda_architectures: tuple[str, ...] = ()
    amdgpu_targets: tuple[str, ...] = ()


@dataclass(frozen=True)
class LlamaCpp:
    repo: str
    ref: str
    build: Build
    prefix: str
    keep_builds: int


def parse(data: dict[str, Any]) -> LlamaCpp:
    """The typed settings of the section's plain data (schema-valid, defaults filled)."""
    b = data["build"]
    return LlamaCpp(
        repo=data["repo"], ref=data["ref"], prefix=data["prefix"],
        keep_builds=data["keep_builds"],
        build=Build(type=b["type"], jobs=b["jobs"], ccache=b["ccache"],
                    ccache_dir=b["ccache_dir"] or None, cmake_flags=tuple(b["cmake_flags"]),
                    serial=b["serial"], copy=b["copy"],
                    cuda_architectures=tuple(str(a) for a in b["cuda_architectures"]),
                    amdgpu_targets=tuple(b["amdgpu_targets"])))


def of(cluster: Cluster) -> LlamaCpp:
    """The cluster's llama_cpp settings (derived once per Cluster)."""
    return cluster.derived(ROLE, lambda: parse(cluster.sections[ROLE]))


def section_data(settings: LlamaCpp) -> dict[str, Any]:
    """`settings` as the section's plain data: the inverse of parse."""
    b = settings.build
    return {"repo": settings.repo, "ref": settings.ref, "prefix": settings.prefix,
            "keep_builds": settings.keep_builds,
            "build": {"type": b.type, "jobs": b.jobs, "ccache": b.ccache,
                      "ccache_dir": b.ccache_dir or "", "cmake_flags": list(b.cmake_flags),
                      "serial": b.serial, "copy": b.copy,
                      "cuda_architectures": list(b.cuda_architectures),
                      "amdgpu_targets": list(b.amdgpu_targets)}}


def with_settings(cluster: Cluster, settings: LlamaCpp) -> Cluster:
    """`cluster` with these llama_cpp settings (a test's or a variant's): the section's data, the
    prefix the core reads from it and the layout of every host with root move together, as
    loading a file with them would make them."""
    hosts = tuple(h if h.rootless or h.layout is None or h.layout.prefix == settings.prefix
                  else replace(h, layout=system_layout(settings.prefix)) for h in cluster.hosts)
    return replace(cluster, prefix=settings.prefix, hosts=hosts,
                   sections={**cluster.sections, ROLE: section_data(settings)})


def with_build(cluster: Cluster, **changes) -> Cluster:
    """`cluster` with these fields of llama_cpp.build changed."""
    settings = of(cluster)
    return with_settings(cluster, replace(settings, build=replace(settings.build, **changes)))
