"""Build switches (roles/llama_cpp/defaults.py, keys.cmake_flags): every switch the pinned tree
would set by what the building host has installed is set, so a build key is one build wherever
it compiles; build.sh stops where cmake could not honour one (OpenMP).

The scripts run for real on tiny CMake trees shaped as llama.cpp's where build.sh reads them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from support.gittree import commit_all
from support.require import unmet
from support.resolved import run_values

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import progress, shell
from meshdeploy.roles.llama_cpp import keys
from meshdeploy.roles.llama_cpp.operations import TEMPLATES
from meshdeploy.roles.llama_cpp import settings

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"


def platform(kernel="Linux", machine="x86_64"):
    return {"toolchain.Platform": {"kernel": kernel, "machine": machine, "distro": "debian",
                                   "version": "12", "tools": [], "termux": False}}


def flags_of(inventory: Path, host: str, facts=None, **kw) -> list[str]:
    cluster = load_cluster(inventory)
    return keys.cmake_flags(cluster, cluster.host(host), facts=facts, **kw)


@pytest.mark.parametrize("backend_host", [("lab.yaml", "node1"), ("two-cuda-11-16.yaml", "box16")])
def test_rdma_and_openmp_are_set_whatever_the_host_has_installed(backend_host):
    inventory, host = backend_host
    flags = flags_of(ROOT / "inventories" / inventory, host, platform())
    assert "-DGGML_RPC_RDMA=OFF" in flags  # ggml-rpc turns RDMA on where libibverbs is found
    assert "-DGGML_OPENMP=ON" in flags
    for switch in ("LLAMA_OPENSSL", "LLAMA_CURL", "LLAMA_BUILD_UI", "LLAMA_USE_PREBUILT_UI"):
        assert f"-D{switch}=OFF" in flags


def test_macos_builds_turn_openmp_off_rather_than_find_a_homebrew_libomp():
    flags = flags_of(ROOT / "inventories" / "one-mac-mtl0-cpu.yaml", "mac", platform("Darwin"))
    assert "-DGGML_OPENMP=OFF" in flags and "-DGGML_OPENMP=ON" not in flags
    # Without facts (a key computed for a Metal host): macOS all the same.
    assert "-DGGML_OPENMP=OFF" in flags_of(ROOT / "inventories" / "one-mac-mtl0-cpu.yaml", "mac")


def test_cuda_builds_do_not_link_nccl_where_it_happens_to_be_installed():
    flags = flags_of(ROOT / "inventories" / "two-cuda-11-16.yaml", "box16", platform())
    assert "-DGGML_CUDA_NCCL=OFF" in flags


def test_the_switches_are_part_of_the_key():
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")
    host = cluster.host("node1")
    linux = keys.build_key(cluster, host, "0" * 40, facts=platform())
    darwin = keys.build_key(cluster, host, "0" * 40, facts=platform("Darwin"))
    assert linux != darwin


def tiny_tree(root: Path, cmakelists: str) -> str:
    """A git tree shaped like llama.cpp's where build.sh reads it, with `cmakelists`."""
    (root / "tools" / "rpc").mkdir(parents=True)
    (root / "ggml" / "include").mkdir(parents=True)
    (root / "tools" / "rpc" / "CMakeLists.txt").write_text("set(TARGET ggml-rpc-server)\n")
    (root / "ggml" / "include" / "ggml-rpc.h").write_text("#define RPC_PROTO_MAJOR_VERSION 7\n")
    (root / "main.c").write_text('#include <stdio.h>\nint main(void) { puts("usage"); return 0; }\n')
    (root / "CMakeLists.txt").write_text(cmakelists)
    return commit_all(root)


def run_build(tmp_path: Path, commit: str, args: list[str], env: dict | None = None,
              force: bool = False, backend: str = "cpu") -> subprocess.CompletedProcess:
    """build.sh on the tiny tree; + env: the caller's locale variables (none: this process's)"""
    script = shell.template(
        TEMPLATES / "build.sh", prelude=progress.SHELL, args=args,
        SRC=tmp_path / "src", TREE=tmp_path / "tree", OUT=tmp_path / "builds" / "k",
        COMMIT=commit, NUMBER=1, JOBS=2, CCACHE="", WANT_SERVER=1, WANT_RPC=1,
        RPC_TARGETS="ggml-rpc-server", KEY="k", BACKEND=backend, FORCE=int(force))
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("LC_") and k not in ("LANG", "LANGUAGE")}
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=300,
                          env=os.environ if env is None else {**base, **env})


# ggml/src/CMakeLists.txt's OpenMP fallback, reduced: the option, find_package, the INTERNAL flag.
OPENMP_TREE = """cmake_minimum_required(VERSION 3.16)
project(tiny C)
option(GGML_OPENMP "use OpenMP" ON)
if (GGML_OPENMP)
    find_package(OpenMP)
    if (OpenMP_FOUND AND NOT PRETEND_NO_OPENMP)
        set(GGML_OPENMP_ENABLED "ON" CACHE INTERNAL "")
    else()
        set(GGML_OPENMP_ENABLED "OFF" CACHE INTERNAL "")
        message(WARNING "OpenMP not found")
    endif()
else()
    set(GGML_OPENMP_ENABLED "OFF" CACHE INTERNAL "")
endif()
add_executable(llama-server main.c)
add_executable(ggml-rpc-server main.c)
set_target_properties(llama-server ggml-rpc-server PROPERTIES
    RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
"""


def test_build_stops_where_openmp_is_asked_for_and_cmake_found_none(tmp_path):
    commit = tiny_tree(tmp_path / "src", OPENMP_TREE)
    done = run_build(tmp_path, commit, ["-DGGML_OPENMP=ON", "-DPRETEND_NO_OPENMP=ON"])
    assert done.returncode == 1
    assert "GGML_OPENMP=ON but cmake found no OpenMP" in done.stderr
    assert not (tmp_path / "builds" / "k").exists()


def test_build_goes_on_where_openmp_is_found_or_off(tmp_path):
    commit = tiny_tree(tmp_path / "src", OPENMP_TREE)
    done = run_build(tmp_path, commit, ["-DGGML_OPENMP=OFF", "-DPRETEND_NO_OPENMP=ON"])
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "builds" / "k" / "bin" / "llama-server").exists()


def test_every_compile_runs_in_one_locale_whatever_the_callers(tmp_path):
    """ccache hashes LANG, LC_ALL, LC_CTYPE and LC_MESSAGES: a build started over SSH (the
    client's LANG passed on) and one started locally (LC_CTYPE only) must hash alike, or each
    misses every entry the other wrote (a whole llama.cpp compile)."""
    commit = tiny_tree(tmp_path / "src", OPENMP_TREE)
    seen = tmp_path / "seen"
    launcher = tmp_path / "launcher"
    launcher.write_text(f'#!/bin/sh\nenv | grep -E "^(LANG|LANGUAGE|LC_[A-Z]+)=" | sort >> {seen}\n'
                        'exec "$@"\n')
    launcher.chmod(0o755)
    runs = []
    for env in ({"LANG": "de_DE.UTF-8", "LANGUAGE": "de"}, {"LC_CTYPE": "C.UTF-8"},
                {"LC_ALL": "fr_FR.UTF-8", "LC_MESSAGES": "fr_FR.UTF-8"}):
        seen.write_text("")
        shutil.rmtree(tmp_path / "tree", ignore_errors=True)  # every run compiles
        done = run_build(tmp_path, commit, ["-DGGML_OPENMP=OFF",
                                            f"-DCMAKE_C_COMPILER_LAUNCHER={launcher}"],
                         env=env, force=True)
        assert done.returncode == 0, done.stderr
        lines = sorted(set(seen.read_text().splitlines()))
        assert lines, "the launcher never ran"
        runs.append(lines)
    assert runs[0] == runs[1] == runs[2] == ["LANG=C", "LC_ALL=C"]


# A shared build as runtime CPU dispatch makes it: a library beside the binaries in bin/.
SHARED_TREE = """cmake_minimum_required(VERSION 3.16)
project(tiny C)
set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_library(ggml-cpu-x64 SHARED part.c)
add_library(llama SHARED part.c)
set_target_properties(llama PROPERTIES VERSION 0.0.11312 SOVERSION 0)
add_executable(llama-server main.c)
target_link_libraries(llama-server ggml-cpu-x64 llama)
add_executable(ggml-rpc-server main.c)
"""


def test_a_shared_build_carries_its_libraries_and_finds_them_beside_itself(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part.c").write_text("int part(void) { return 1; }\n")
    commit = tiny_tree(tmp_path / "src", SHARED_TREE)
    done = run_build(tmp_path, commit, ["-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"])
    assert done.returncode == 0, done.stderr
    out = tmp_path / "builds" / "k" / "bin"
    assert (out / "libggml-cpu-x64.so").exists()
    # libllama under its soname, as a plain file: a copy refuses links (copy.sh); not the
    # linker's libllama.so nor libllama.so.0.0.11312.
    assert sorted(f.name for f in out.iterdir() if f.name.startswith("libllama")) == [
        "libllama.so.0"]
    assert not [f for f in out.iterdir() if f.is_symlink()]
    subprocess.run(["rm", "-rf", str(tmp_path / "tree")], check=True)  # as on a copying host
    ran = subprocess.run([str(out / "llama-server")], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout == "usage\n", ran.stderr


def test_a_shared_build_whose_rpath_points_into_the_build_tree_is_not_installed(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part.c").write_text("int part(void) { return 1; }\n")
    commit = tiny_tree(tmp_path / "src", SHARED_TREE)
    done = run_build(tmp_path, commit, [])  # cmake's default: the tree's absolute path
    assert done.returncode == 1 and "is not $ORIGIN" in done.stderr
    assert not (tmp_path / "builds" / "k").exists()


def test_an_rpath_to_a_system_library_folder_is_kept_and_any_other_refused(tmp_path):
    """A CUDA build on Debian: cmake names the folder of the NVIDIA driver's libcuda.so.1
    (/usr/lib/x86_64-linux-gnu/nvidia/current), root's on every host. A user's folder, or one
    that climbs out of /usr/lib, would let whoever owns it choose the copy's libraries."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part.c").write_text("int part(void) { return 1; }\n")
    commit = tiny_tree(tmp_path / "src", SHARED_TREE)
    system = "/usr/lib/x86_64-linux-gnu/nvidia/current"
    done = run_build(tmp_path, commit, ["-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
                                        f"-DCMAKE_BUILD_RPATH={system}"])
    assert done.returncode == 0, done.stderr
    binary = tmp_path / "builds" / "k" / "bin" / "llama-server"
    assert system in subprocess.run(["readelf", "-d", str(binary)], capture_output=True,
                                    text=True).stdout
    for other in ("/home/u/lib", "/usr/lib/../../home/u/lib"):
        shutil.rmtree(tmp_path / "tree")
        shutil.rmtree(tmp_path / "builds")
        done = run_build(tmp_path, commit, ["-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
                                            f"-DCMAKE_BUILD_RPATH={other}"], force=True)
        assert done.returncode == 1 and "is not $ORIGIN, a system library folder" in \
            done.stderr, (other, done.stderr)
        assert not (tmp_path / "builds" / "k").exists()


def test_the_cuda_toolkits_own_library_folder_is_kept_where_root_alone_writes_it(tmp_path):
    """NVIDIA's toolkit (not Debian's) keeps libcudart and libcublas in /usr/local/cuda-13.0/
    targets/x86_64-linux/lib, and cmake names that folder in a CUDA build's RUNPATH (seen on an
    H200 machine: docs/gpu.md). A folder holding libcudart is kept in a CUDA build where root
    owns it, the folder it resolves to and every folder above each, writable by no one else;
    anywhere else it is refused like any other folder."""
    if os.geteuid() != 0:
        unmet("needs root: the toolkit's stand-in folder must belong to root")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "part.c").write_text("int part(void) { return 1; }\n")
    commit = tiny_tree(tmp_path / "src", SHARED_TREE)
    root = Path(tempfile.mkdtemp(prefix="md-cuda-", dir="/run"))   # root's, 0755 up to /
    try:
        root.chmod(0o755)
        toolkit = root / "cuda-13.0" / "targets" / "x86_64-linux" / "lib"
        toolkit.mkdir(parents=True)
        (toolkit / "libcudart.so.13").write_bytes(b"")
        users = tmp_path / "cuda" / "lib"
        users.mkdir(parents=True)
        (users / "libcudart.so.13").write_bytes(b"")
        (tmp_path / "cuda").chmod(0o777)   # anyone may write above it, whatever TMPDIR is
        # Root's link to root's folder, whose own parent anyone may write (the folder can be
        # swapped for another): every folder above where it resolves counts too.
        linked = tmp_path / "linked" / "lib"
        linked.mkdir(parents=True)
        (linked / "libcudart.so.13").write_bytes(b"")
        (tmp_path / "linked").chmod(0o755)
        tmp_path.chmod(0o777)
        (root / "cuda").symlink_to(tmp_path / "linked")
        cases = [(toolkit, "cuda", 0),          # the toolkit's, root's all the way up: kept
                 (toolkit, "cpu", 1),           # not a CUDA build: refused, as before
                 ("/usr/share/doc", "cuda", 1),     # root's, but no CUDA runtime in it
                 (users, "cuda", 1),            # the runtime, but anyone writes above it
                 (root / "cuda" / "lib", "cuda", 1)]    # through a link, to such a folder
        for rpath, backend, code in cases:
            shutil.rmtree(tmp_path / "tree", ignore_errors=True)
            shutil.rmtree(tmp_path / "builds", ignore_errors=True)
            done = run_build(tmp_path, commit, ["-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
                                                f"-DCMAKE_BUILD_RPATH={rpath}"], force=True,
                             backend=backend)
            assert done.returncode == code, (rpath, backend, done.stderr)
            assert (tmp_path / "builds" / "k").exists() == (code == 0)
            if code:
                assert f"{rpath} is not $ORIGIN, a system library folder" in done.stderr, \
                    done.stderr
    finally:
        shutil.rmtree(root)


def dispatch_facts(cpu: str, machine="x86_64"):
    return {**platform(machine=machine), "llama_cpp.Libc": "glibc 2.36", "llama_cpp.CpuFlags": cpu,
            "llama_cpp.Builds": {"current": None, "builds": {}}}


def decide_all(cluster, facts):
    from meshdeploy.core.context import HostContext
    resolved = run_values(commit="0c1e57098bba43ac29e6e3b677cdceebdd22334f", build_number=1)
    return {h.name: keys.decide(HostContext(cluster, h, facts[h.name], resolved,
                                            cluster_facts=facts)) for h in cluster.hosts}


def test_hosts_of_one_cpu_share_a_native_build_and_others_a_dispatched_one():
    lab = load_cluster(ROOT / "inventories" / "lab.yaml")
    # Without the lab file's own GGML_NATIVE: the CPU code is meshdeploy's to choose.
    cluster = settings.with_build(lab, cmake_flags=())
    same = {h.name: dispatch_facts("a" * 16) for h in cluster.hosts}
    got = decide_all(cluster, same)
    assert not got["node1"].portable and "-march=native" in got["node1"].code
    flags = keys.cmake_flags(cluster, cluster.host("node1"), False, False, same["node1"])
    assert "-DGGML_NATIVE=OFF" not in flags and "-DGGML_BACKEND_DL=ON" not in flags
    mixed = {**same, "node3": dispatch_facts("b" * 16)}
    got = decide_all(cluster, mixed)
    assert got["node1"].portable and "runtime CPU dispatch" in got["node1"].code
    assert len({d.key for d in got.values()}) == 1
    flags = keys.cmake_flags(cluster, cluster.host("node1"), False, True, mixed["node1"])
    for flag in ("-DGGML_NATIVE=OFF", "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON",
                 "-DBUILD_SHARED_LIBS=ON", "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON"):
        assert flag in flags
    assert flags.index("-DBUILD_SHARED_LIBS=ON") > flags.index("-DBUILD_SHARED_LIBS=OFF")
    # arm64 has no dispatch build here: portable code as before.
    arm = keys.cmake_flags(cluster, cluster.host("node1"), False, True,
                           dispatch_facts("c" * 16, "aarch64"))
    assert "-DGGML_NATIVE=OFF" in arm and "-DGGML_BACKEND_DL=ON" not in arm


def test_the_files_ggml_native_decides_and_the_plan_says_so():
    cluster = load_cluster(ROOT / "inventories" / "lab.yaml")  # cmake_flags: [-DGGML_NATIVE=OFF]
    mixed = {h.name: dispatch_facts(c * 16) for h, c in zip(cluster.hosts, "abc")}
    got = decide_all(cluster, mixed)
    assert got["node1"].code == "GGML_NATIVE as llama_cpp.build.cmake_flags sets it"
    flags = keys.cmake_flags(cluster, cluster.host("node1"), False, True, mixed["node1"])
    assert "-DGGML_BACKEND_DL=ON" not in flags and flags[-1] == "-DGGML_NATIVE=OFF"
