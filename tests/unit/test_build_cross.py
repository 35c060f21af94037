"""Cross-compiling (roles/llama_cpp/keys.py): an x86-64 host compiles the build of the aarch64
hosts of its release, which copy it; who may, what it compiles, and what the plan says."""

from __future__ import annotations

import subprocess
from dataclasses import replace
from pathlib import Path

from support.gittree import commit_all
from support.require import needs
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import progress, shell
from meshdeploy.core.context import HostContext
from meshdeploy.roles.llama_cpp import copies, keys
from meshdeploy.roles.llama_cpp import operations as ops
from meshdeploy.roles.toolchain import operations as toolchain
from meshdeploy.roles.llama_cpp import settings

ROOT = Path(__file__).resolve().parents[2]
COMMIT = "f35b4f837ba8e08a33034faa9ba21db8713e67df"
CROSS = ["g++-aarch64-linux-gnu", "libc6-dev-arm64-cross"]


def lab(**build):
    """inventories/lab.yaml (node1 llama-server, node2 and node3 rpc-servers), `build` changed."""
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    return settings.with_build(cluster, **build)


def debian(machine="x86_64", version="12", libc="glibc 2.36", builds=None, tools=("apt-get",)):
    return {"toolchain.Platform": {"kernel": "Linux", "machine": machine, "distro": "debian",
                                   "version": version, "tools": list(tools), "termux": False},
            "llama_cpp.Libc": libc, "llama_cpp.CpuFlags": "same",
            "llama_cpp.Builds": {"current": None, "builds": builds or {}},
            "toolchain.DebPackages": {}}


def contexts(cluster, facts, replacing=(), copiers=None):
    resolved = run_values(commit=COMMIT, build_number=11312, replace=tuple(replacing),
                        build_copiers=copiers or {})
    return {h.name: HostContext(cluster, h, facts[h.name], resolved, cluster_facts=facts)
            for h in cluster.hosts}


def decide(cluster, facts, **kw):
    return {name: keys.decide(ctx) for name, ctx in contexts(cluster, facts, **kw).items()}


def arm_node3(**x86):
    """node3 aarch64 on Debian 12, node1 and node2 x86-64 (`x86`: their facts changed)."""
    return {"node1": debian(**x86), "node2": debian(**x86), "node3": debian(machine="aarch64")}


def test_the_x86_host_of_the_same_release_cross_compiles_for_the_aarch64_host():
    cluster, facts = lab(), arm_node3()
    got = decide(cluster, facts)
    arm = got["node3"]
    assert arm.builder == "node1" and arm.cross == "aarch64"
    assert arm.why == "cross-compiled on node1 for aarch64"
    assert arm.members == ("node3",) and arm.portable
    assert arm.key != got["node1"].key and arm.key.startswith(f"{COMMIT[:12]}-cpu-")
    # node1's own build is untouched: node2 copies it, node1 compiles it.
    assert got["node2"].builder == "node1" and got["node1"].members == ("node1", "node2")
    assert keys.copiers(cluster, cluster.hosts, facts, COMMIT) == {"node1": ("node2", "node3")}
    ctxs = contexts(cluster, facts)
    jobs = keys.cross_builds(ctxs["node1"])
    assert [(j.key, j.targets, j.members) for j in jobs] == [(arm.key, ("rpc",), ("node3",))]
    assert keys.cross_builds(ctxs["node2"]) == [] and keys.cross_builds(ctxs["node3"]) == []


def test_the_cross_step_compiles_with_the_aarch64_flags_and_a_toolchain_file():
    cluster, facts = lab(), arm_node3()
    ctxs = contexts(cluster, facts)
    step = ops.cross(ctxs["node1"])
    key = keys.decide(ctxs["node3"]).key
    assert step.change.action == "create"
    assert step.change.reason.startswith(f"cross-compile {key} for aarch64")
    script = step.commands[0]
    for line in ("CROSS=aarch64", "TRIPLET=aarch64-linux-gnu",
                 "CROSS_ROOT=/usr/aarch64-linux-gnu", f"OUT=/opt/meshdeploy/builds/{key}"):
        assert f"\n{line}\n" in script, line
    tree = next(ln for ln in script.splitlines() if ln.startswith("TREE="))
    assert tree.endswith("-aarch64")  # never node1's own tree
    assert "-DGGML_NATIVE=OFF" in script and "CMAKE_TOOLCHAIN_FILE" in script
    assert "WANT_RPC=1" in script and "WANT_SERVER=0" in script
    assert "pack.sh" not in script and f"{key}.tar.gz" in step.commands[1]
    # The aarch64 host compiles nothing and clones nothing: it copies.
    assert ops.build(ctxs["node3"]).change.action == "no-op"
    assert "copies its build from node1" in ops.source(ctxs["node3"]).change.reason
    copy = copies.copy(ctxs["node3"]).change.reason
    assert "(cross-compiled on node1 for aarch64 once for node3)" in copy
    # The builder serves both keys' tarballs, to both copiers, from one md-share.
    serve = copies.copy(ctxs["node1"])
    assert "node2, node3" in serve.change.reason and key in serve.change.reason


def test_the_builder_installs_the_cross_compiler_and_the_copier_none():
    cluster, facts = lab(), arm_node3()
    copiers = keys.copiers(cluster, cluster.hosts, facts, COMMIT)
    ctxs = contexts(cluster, facts, copiers=copiers)
    node1 = toolchain.packages(ctxs["node1"]).change.diffs[0].after.split()
    assert node1[-3:] == [*CROSS, "python3"]  # python3: md-share serves the builds
    node3 = toolchain.packages(ctxs["node3"]).change.diffs[0].after.split()
    assert not set(node3) & {"g++", "cmake", *CROSS}
    assert toolchain.cross_targets(ctxs["node1"]) == ("aarch64",)
    assert toolchain.cross_targets(ctxs["node2"]) == ()


def test_no_cross_builder_means_the_aarch64_host_compiles_for_itself():
    cluster = lab()
    cases = {
        "another release": arm_node3(version="13", libc="glibc 2.41"),
        "no apt": arm_node3(tools=()),
        "another C library": arm_node3(libc="glibc 2.31"),
    }
    for why, facts in cases.items():
        got = decide(cluster, facts)["node3"]
        assert (got.builder, got.cross, got.portable) == ("node3", "", False), why
    # A host without root never builds for others (keys.py: never up a privilege boundary).
    hosts = [replace(h, rootless=True) if h.name != "node3" else h for h in cluster.hosts]
    got = decide(replace(cluster, hosts=hosts), arm_node3())["node3"]
    assert got.builder == "node3" and not got.cross


def test_a_machine_name_no_cross_compiler_is_known_for_never_reaches_the_toolchain_file():
    """The machine is the host's own word (uname -m); build.sh prints it into cmake code. Only a
    name of llama_cpp_cross_triplets makes a cross build: anything else compiles on its host."""
    cluster = lab()
    hostile = "aarch64)\nexecute_process(COMMAND touch /tmp/owned)\n#"
    facts = {"node1": debian(), "node2": debian(), "node3": debian(machine=hostile)}
    got = decide(cluster, facts)["node3"]
    assert (got.builder, got.cross) == ("node3", "")
    assert keys.cross_builds(contexts(cluster, facts)["node1"]) == []
    node1 = contexts(cluster, facts)["node1"]
    assert "execute_process" not in "\n".join(ops.cross(node1).commands + [
        ops.cross(node1).change.reason])


def test_no_cross_compiling_where_copies_do_not_travel_or_for_a_gpu_backend():
    facts = arm_node3()
    assert decide(lab(copy=False), facts)["node3"].builder == "node3"
    cluster = lab()
    hosts = [replace(h, backend="vulkan") if h.name == "node3" else h for h in cluster.hosts]
    assert decide(replace(cluster, hosts=hosts), facts)["node3"].builder == "node3"


def installed(key):
    return {"current": key, "builds": {key: {"commit": COMMIT, "rpc_binary": "ggml-rpc-server",
                                             "targets": "ggml-rpc-server"}}}


def test_after_apply_the_cross_builder_stays_the_builder_so_nothing_moves():
    """Without build.serial an installed copy would make its holder the builder; the cross
    builder comes first, so the next plan keeps the same builder, copiers and open ports."""
    cluster = lab(serial=False)
    facts = {"node1": debian(), "node2": debian(machine="aarch64"),
             "node3": debian(machine="aarch64")}
    first = decide(cluster, facts)
    key = first["node2"].key
    assert first["node2"].builder == first["node3"].builder == "node1"
    assert first["node2"].members == ("node2", "node3")
    before = keys.copiers(cluster, cluster.hosts, facts, COMMIT)
    facts["node1"]["llama_cpp.Builds"] = installed(key)
    facts["node3"]["llama_cpp.Builds"] = installed(key)
    then = decide(cluster, facts)
    assert then["node2"].key == key and then["node2"].builder == "node1"
    assert keys.copiers(cluster, cluster.hosts, facts, COMMIT) == before
    facts["node2"]["llama_cpp.Builds"] = installed(key)
    assert ops.cross(contexts(cluster, facts)["node1"]).change.action == "no-op"


def test_the_cross_builder_is_the_same_whatever_replace_names_on_the_x86_hosts():
    """-replace=node2/llama_cpp.build makes node2 the x86 key's builder for one run (node1
    copies from it); node1 still cross-compiles, with the build tools, and serves node3."""
    cluster, facts = lab(), arm_node3()
    copiers = keys.copiers(cluster, cluster.hosts, facts, COMMIT, ("node2/llama_cpp.build",))
    assert copiers == {"node2": ("node1",), "node1": ("node3",)}
    ctxs = contexts(cluster, facts, replacing=["node2/llama_cpp.build"], copiers=copiers)
    assert keys.decide(ctxs["node1"]).builder == "node2"
    assert keys.decide(ctxs["node3"]).builder == "node1"
    step = ops.cross(ctxs["node1"])
    assert step.change.action == "create" and "\nCROSS=aarch64\n" in step.commands[0]
    assert "cmake" in toolchain.packages(ctxs["node1"]).change.diffs[0].after.split()
    copy = copies.copy(ctxs["node1"])  # copies its own build from node2, serves node3's
    assert "copy its build from node2" in copy.change.reason
    assert "serve" in copy.change.reason and "node3" in copy.change.reason


def test_a_limited_run_keeps_the_portable_build_an_aarch64_host_runs():
    """--limit node3 (or node1 away): no cross builder in the run. node3 keeps the portable
    build it runs (no native compile of another key on an arm64 board). The file names no
    GGML_NATIVE here: the portable key is another key than a native one."""
    cluster, facts = lab(cmake_flags=()), arm_node3()
    key = decide(cluster, facts)["node3"].key
    alone = {"node3": facts["node3"]}
    ctx = HostContext(cluster, cluster.host("node3"), facts["node3"], run_values(commit=COMMIT),
                      cluster_facts=alone)
    assert keys.decide(ctx).key != key  # nothing installed: nothing to keep
    facts["node3"]["llama_cpp.Builds"] = installed(key)
    ctx = HostContext(cluster, cluster.host("node3"), facts["node3"], run_values(commit=COMMIT),
                      cluster_facts={"node3": facts["node3"]})
    got = keys.decide(ctx)
    assert (got.key, got.builder) == (key, "node3")
    assert ops.build(ctx).change.action == "no-op"
    # A pin moved in the same limited run: the new commit's build, still the portable one.
    moved = HostContext(cluster, cluster.host("node3"), facts["node3"],
                        run_values(commit="1" * 40), cluster_facts={"node3": facts["node3"]})
    assert keys.decide(moved).key == "1" * 12 + key[12:]


def test_no_cross_build_where_the_file_turns_ggml_native_on():
    got = decide(lab(cmake_flags=("-DGGML_NATIVE=ON",)), arm_node3())["node3"]
    assert (got.builder, got.cross) == ("node3", "")
    assert decide(lab(cmake_flags=("-DGGML_NATIVE=OFF",)), arm_node3())["node3"].cross


def test_replace_on_an_aarch64_host_compiles_there_natively_under_the_same_key():
    cluster, facts = lab(), arm_node3()
    cross_key = decide(cluster, facts)["node3"].key
    got = decide(cluster, facts, replacing=["node3/llama_cpp.build"])["node3"]
    assert (got.builder, got.key, got.cross) == ("node3", cross_key, "")
    ctx = contexts(cluster, facts, replacing=["node3/llama_cpp.build"])["node3"]
    script = ops.build(ctx).commands[0]
    assert "\nCROSS=''\n" in script and "-DGGML_NATIVE=OFF" in script
    # node1's md-share port stays open to node3, which copies from it again in the next run.
    assert keys.copiers(cluster, cluster.hosts, facts, COMMIT, ("node3/llama_cpp.build",)) == \
        keys.copiers(cluster, cluster.hosts, facts, COMMIT) == {"node1": ("node2", "node3")}


def test_a_cross_build_on_the_builder_is_packed_again_for_a_host_that_lacks_it():
    cluster, facts = lab(), arm_node3()
    key = decide(cluster, facts)["node3"].key
    facts["node1"]["llama_cpp.Builds"] = {
        "current": None, "builds": {key: {"commit": COMMIT, "rpc_binary": "ggml-rpc-server",
                                          "targets": "ggml-rpc-server"}}}
    step = ops.cross(contexts(cluster, facts)["node1"])
    assert step.change.action == "update" and "no compile" in step.change.reason
    assert len(step.commands) == 1 and f"{key}.tar.gz" in step.commands[0]


# ggml's OpenMP switch reduced (build.sh stops where GGML_OPENMP=ON found none), and the two
# targets, in a tree shaped as llama.cpp's where build.sh reads it.
TINY = """cmake_minimum_required(VERSION 3.16)
project(tiny C)
find_package(OpenMP)
set(GGML_OPENMP_ENABLED ${OpenMP_FOUND} CACHE INTERNAL "")
option(GGML_OPENMP "" ON)
add_executable(llama-server main.c)
add_executable(ggml-rpc-server main.c)
target_link_libraries(llama-server OpenMP::OpenMP_C)
target_link_libraries(ggml-rpc-server OpenMP::OpenMP_C)
set_target_properties(llama-server ggml-rpc-server PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""


@needs("aarch64-linux-gnu-gcc", "qemu-aarch64-static")
def test_build_sh_cross_compiles_for_aarch64_with_its_toolchain_file(tmp_path):
    """build.sh as llama_cpp.cross renders it, on a tiny tree: aarch64 binaries (OpenMP from the
    cross compiler's libgomp), never run where they were built, that run under qemu."""
    src = tmp_path / "src"
    (src / "tools" / "rpc").mkdir(parents=True)
    (src / "ggml" / "include").mkdir(parents=True)
    (src / "tools" / "rpc" / "CMakeLists.txt").write_text("set(TARGET ggml-rpc-server)\n")
    (src / "ggml" / "include" / "ggml-rpc.h").write_text("#define RPC_PROTO_MAJOR_VERSION 7\n")
    (src / "main.c").write_text("#include <stdio.h>\n#include <omp.h>\nint main(void) "
                                '{ printf("usage %d\\n", omp_get_max_threads() > 0); }\n')
    (src / "CMakeLists.txt").write_text(TINY)
    commit = commit_all(src)
    script = shell.template(
        ops.TEMPLATES / "build.sh", prelude=progress.SHELL, args=["-DGGML_OPENMP=ON"],
        SRC=src, TREE=tmp_path / "tree", OUT=tmp_path / "builds" / "k", COMMIT=commit, NUMBER=1,
        JOBS=2, CCACHE="", WANT_SERVER=1, WANT_RPC=1, RPC_TARGETS="ggml-rpc-server", KEY="k",
        BACKEND="cpu", FORCE=0, CROSS="aarch64", TRIPLET="aarch64-linux-gnu",
        CROSS_ROOT="/usr/aarch64-linux-gnu")
    done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "builds" / "k"
    for name in ("llama-server", "ggml-rpc-server"):
        header = (out / "bin" / name).read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == 0xB7
    assert not (out / "llama-server.help").exists()  # run first where it is copied (copy.sh)
    toolchain = (tmp_path / "tree.toolchain.cmake").read_text()
    assert "set(CMAKE_SYSTEM_PROCESSOR aarch64)" in toolchain
    assert "set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)" in toolchain
    assert "set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)" in toolchain
    cache = (tmp_path / "tree" / "CMakeCache.txt").read_text()
    assert "CMAKE_C_COMPILER_AR:FILEPATH=/usr/bin/aarch64-linux-gnu-gcc-ar" in cache
    ran = subprocess.run(["qemu-aarch64-static", "-L", "/usr/aarch64-linux-gnu",
                          str(out / "bin" / "llama-server")], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout == "usage 1\n", ran.stderr
