"""Faults an apply survives, on real hosts (lab mdft: node1 runs llama-server, node2 an
rpc-server with a seeded cache; both download the model).

One fresh lab, one chain of applies, each stopped at a chosen moment that the test sees happen
on the host (a process or a file appears there; the step is then frozen with SIGSTOP so the
moment cannot pass before the signal lands), never by sleeping:

1. Ctrl-C during node1's build: the build in flight finishes, nothing else starts, exit 130,
   locks released, the state records what ran, no build process left;
2. Ctrl-C twice during node2's build: the build is stopped on the host;
3. SIGKILL of meshdeploy during node2's build, during the downloads (links shaped with tbf so
   the download takes a while), during node2's cache seeding, during the unit step: each rerun
   takes over the dead run's locks, stops what it left running, and goes on;
4. the converged cluster runs exactly the locked commit's binaries and the model whose sha256
   the file names, answers a chat completion, and the next plan is empty;
5. node2 stopped mid-apply: apply fails naming it, node1 is left consistent; node2 back ->
   the rerun converges;
6. node2's models folder on a small filesystem: the plan refuses with the numbers; the disk
   filling during the download: one error with the numbers, no model file, the rerun converges.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import own_lab
from support.cli import meshdeploy

from meshdeploy.lab import base, hosts, net, procs
from support.labfile import lab_text, without_host

pytestmark = [pytest.mark.lab, pytest.mark.build]

SHA = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL = "/opt/meshdeploy/models/gemma/gemma-3-270m-q4_k_m.gguf"
CACHE = "/var/cache/private/meshdeploy-rpc-50052/rpc"
SERVER_UNIT = "meshdeploy-server-main"
RPC_UNIT = "meshdeploy-rpc-50052"
NODES = ("node1", "node2")


@pytest.fixture(scope="module")
def ft_lab(lab_available, request):
    with own_lab(request, "mdft", hosts=2, toolchain=True) as both:
        yield both


@pytest.fixture(scope="module")
def cluster_file(ft_lab, tmp_path_factory):
    """The lab inventory without node3, every host compiling its own build; node2's
    rpc-server keeps a seeded cache."""
    info, _ = ft_lab
    text = without_host(lab_text(info), "node3")
    # fetch: false keeps a whole GGUF on node2 (downloaded and seeded from), so its download
    # and disk faults are tried on a worker too.
    text = text.replace("      - port: 50052\n",
                        "      - port: 50052\n        cache: true\n        fetch: false\n")
    # Each host compiles (no copy of node1's build), so a build's faults are tried on each.
    assert "    serial: true" in text
    text = text.replace("    serial: true", "    copy: false\n    serial: true", 1)
    path = tmp_path_factory.mktemp("faults") / "lab.yaml"
    path.write_text(text)
    return path


def sh(info, host: str, command: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """A command on a lab host as root."""
    proc = subprocess.run(hosts.ssh_argv(Path(info.ssh["config"]), host,
                                         "sudo sh -c " + _quote(command)),
                          capture_output=True, text=True, timeout=timeout)
    return proc


def _quote(text: str) -> str:
    return "'" + text.replace("'", "'\"'\"'") + "'"


# On the host: wait until a process named {comm} runs, freeze it (SIGSTOP) and print its pid;
# give up once {quit} exists (another host's watcher won).
_FREEZE = ('rm -f {quit}; while [ ! -e {quit} ]; do for p in /proc/[0-9]*; do '
           '[ "$(cat "$p/comm" 2>/dev/null)" = "{comm}" ] && {{ kill -STOP "${{p#/proc/}}" && '
           'echo "${{p#/proc/}}" && exit 0; }}; done; done; exit 1')
_QUIT = "/run/meshdeploy-test-watch-quit"


def _freeze_argv(info, host: str, comm: str, timeout: float) -> list[str]:
    script = _FREEZE.format(comm=comm, quit=_QUIT)
    return hosts.ssh_argv(Path(info.ssh["config"]), host, "sudo sh -c " + _quote(
        f"timeout {int(timeout)} sh -c " + _quote(script)))


def freeze_when_running(info, host: str, comm: str, timeout: float = 600) -> int:
    out = subprocess.run(_freeze_argv(info, host, comm, timeout), capture_output=True, text=True,
                         timeout=timeout + 30)
    assert out.returncode == 0 and out.stdout.strip(), f"{comm} never ran on {host}: {out.stderr}"
    return int(out.stdout.split()[0])


def freeze_first(info, names, comm: str, timeout: float = 600) -> tuple[str, int]:
    """The first of `names` where `comm` runs, with the frozen pid; the others stop watching."""
    watchers = {h: subprocess.Popen(_freeze_argv(info, h, comm, timeout), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                for h in names}
    deadline = time.monotonic() + timeout
    while True:
        done = [h for h, w in watchers.items() if w.poll() is not None]
        if done:
            break
        assert time.monotonic() < deadline, f"{comm} never ran on {names}"
        time.sleep(0.05)
    for h, w in watchers.items():
        if h not in done:
            sh(info, h, f"touch {_QUIT}")
        w.wait(timeout=60)
    first = done[0]
    out = watchers[first].stdout.read()
    assert watchers[first].returncode == 0 and out.strip(), f"{comm} on {first}: {out}"
    return first, int(out.split()[0])


def wait_on_host(info, host: str, condition: str, timeout: float = 600) -> None:
    """Until `condition` (shell) holds on the host."""
    out = sh(info, host, f"timeout {int(timeout)} sh -c "
             + _quote(f"until {condition}; do sleep 0.2; done"), timeout=timeout + 30)
    assert out.returncode == 0, f"{host}: never {condition!r}: {out.stderr}"


def running(info, host: str, comm: str) -> list[str]:
    out = sh(info, host, "for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = "
             f"{comm} ] && echo ${{p#/proc/}}; done; true")
    return out.stdout.split()


class Apply:
    """`meshdeploy apply FILE --auto-approve` in a process group of its own, as a terminal
    runs it (a Ctrl-C there signals the whole group)."""

    def __init__(self, cluster_file: Path, tag: str):
        self.out = cluster_file.with_name(f"{tag}.out")
        self.started = time.monotonic()
        with open(self.out, "w") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "meshdeploy", "apply", str(cluster_file),
                 "--auto-approve"], stdout=f, stderr=subprocess.STDOUT,
                env=dict(os.environ, PYTHONUNBUFFERED="1"),
                stdin=subprocess.DEVNULL, start_new_session=True, text=True)

    def text(self) -> str:
        return self.out.read_text()

    def ctrl_c(self) -> None:
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.text():
            assert self.proc.poll() is None or text in self.text(), self.text()[-3000:]
            assert time.monotonic() < deadline, f"no {text!r} in:\n{self.text()[-3000:]}"
            time.sleep(0.2)

    def end(self, timeout: float = 900) -> int:
        code = self.proc.wait(timeout=timeout)
        print(f"$ meshdeploy apply -> {code} in {time.monotonic() - self.started:.1f} s")
        print(self.text()[-5000:])
        return code


def host_lock_free(info) -> None:
    for h in NODES:
        out = sh(info, h, "test -e /run/meshdeploy/apply.lock && echo held || echo free")
        assert out.stdout.strip() == "free", f"{h}: the host lock is still held"


def control_lock_free(cluster_file: Path) -> None:
    import fcntl

    path = cluster_file.with_name(cluster_file.stem + ".state.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises when another process holds it
        fcntl.flock(f, fcntl.LOCK_UN)


def state(cluster_file: Path) -> dict:
    return json.loads(cluster_file.with_name(cluster_file.stem + ".state.json").read_text())


def builds(info, host: str) -> list[str]:
    return sh(info, host, "ls /opt/meshdeploy/builds 2>/dev/null; true").stdout.split()


def no_temporary_files(info) -> None:
    """Nothing half-written that a later step could take for whole (the partial downloads and
    cache entries a stopped step leaves are removed or completed by the next run)."""
    for h in NODES:
        out = sh(info, h, "find /opt/meshdeploy /etc/systemd/system /var/cache/private "
                          "/run/meshdeploy /tmp \\( -name '*.tmp' -o -name '*.meshdeploy-tmp' "
                          "-o -name '*.part' \\) -print 2>/dev/null; true")
        assert out.stdout.strip() == "", f"{h}: {out.stdout}"


@pytest.fixture(scope="module")
def interrupted(ft_lab, cluster_file):
    """The first apply, Ctrl-C'd while node1 builds; the build is frozen until the interrupt
    is seen, then let go: it finishes, nothing else starts."""
    info, _ = ft_lab
    run = Apply(cluster_file, "apply-ctrl-c")
    # The hosts build one at a time (serial), in pyinfra's order: the first is interrupted.
    first, ninja = freeze_first(info, NODES, "ninja")
    run.ctrl_c()
    run.wait_for("Interrupt received")
    assert run.proc.poll() is None, "apply left at the first Ctrl-C instead of letting the build end"
    sh(info, first, f"kill -CONT {ninja}")
    code = run.end()
    second = next(h for h in NODES if h != first)
    return {"code": code, "text": run.text(), "first": first, "second": second}


def test_ctrl_c_lets_the_build_in_flight_finish_and_starts_nothing(interrupted, ft_lab,
                                                                   cluster_file):
    info, _ = ft_lab
    assert interrupted["code"] == 130, interrupted["text"][-2000:]
    assert "apply interrupted: " in interrupted["text"]
    assert "the steps in flight finished" in interrupted["text"]
    first, second = interrupted["first"], interrupted["second"]
    assert running(info, first, "ninja") == [] and running(info, first, "cmake") == []
    assert len(builds(info, first)) == 1  # finished and installed
    assert builds(info, second) == []  # never started
    host_lock_free(info)
    control_lock_free(cluster_file)
    last = state(cluster_file)["last_apply"]
    assert last["result"] == "interrupted"
    ran = {(s["host"], s["step"]): s["status"] for s in last["steps"]}
    assert ran[(first, "llama_cpp.build")] == "ok" and (second, "llama_cpp.build") not in ran
    no_temporary_files(info)


@pytest.fixture(scope="module")
def stopped_hard(interrupted, ft_lab, cluster_file):
    """Ctrl-C twice while the other host builds: the build is stopped on the host."""
    info, _ = ft_lab
    run = Apply(cluster_file, "apply-ctrl-c-twice")
    freeze_when_running(info, interrupted["second"], "ninja")
    run.ctrl_c()
    run.wait_for("Interrupt received")
    second = time.monotonic()
    run.ctrl_c()
    code = run.end()
    print(f"second Ctrl-C -> exit {code} in {time.monotonic() - second:.1f} s")
    return {"code": code, "text": run.text(), "host": interrupted["second"]}


def test_second_ctrl_c_stops_the_remote_build(stopped_hard, ft_lab, cluster_file):
    info, _ = ft_lab
    host = stopped_hard["host"]
    assert stopped_hard["code"] == 130, stopped_hard["text"][-2000:]
    assert f"{host}: stopped llama_cpp.build" in stopped_hard["text"]
    assert running(info, host, "ninja") == [] and running(info, host, "cmake") == []
    assert builds(info, host) == []
    host_lock_free(info)
    control_lock_free(cluster_file)
    assert state(cluster_file)["last_apply"]["result"] == "interrupted"


def shape(info, host: str, rate: str | None) -> None:
    """tbf on the bridge side of the host's veth: what the host receives is `rate` at most."""
    dev = f"v-{host}"
    subprocess.run(["tc", "-n", info.name, "qdisc", "del", "dev", dev, "root"],
                   capture_output=True)
    if rate:
        subprocess.run(["tc", "-n", info.name, "qdisc", "add", "dev", dev, "root", "tbf",
                        "rate", rate, "burst", "64kb", "latency", "500ms"], check=True)


@pytest.fixture(scope="module")
def killed_runs(stopped_hard, ft_lab, cluster_file):
    """SIGKILL of meshdeploy in the build, the downloads, the seeding and the unit step; each
    next run goes on from there."""
    info, _ = ft_lab
    texts = {"builder": stopped_hard["host"]}
    # The build: one host's is done, the other's runs.
    run = Apply(cluster_file, "kill-build")
    freeze_when_running(info, stopped_hard["host"], "ninja")
    run.kill()
    assert running(info, stopped_hard["host"], "ninja"), "the orphaned build should still be there"
    # The downloads, slowed down so that they are in flight for a while.
    for h in NODES:
        shape(info, h, "40mbit")
    run = Apply(cluster_file, "kill-download")
    wait_on_host(info, "node1", f"[ -s {MODEL}.part ]")
    run.kill()
    texts["download"] = run.text()
    # The seeding: frozen once its first cache entry is being written. The links stay slow
    # until this run has stopped the orphaned downloads: at full speed they could end first.
    run = Apply(cluster_file, "kill-seed")
    for h in NODES:
        run.wait_for(f"{h}: stopped models.gguf[gemma/gemma-3-270m-q4_k_m.gguf]")
    for h in NODES:
        shape(info, h, None)
    freeze_when_running(info, "node2", "md-rpc-seed")
    run.kill()
    texts["seed"] = run.text()
    # The unit step: once node1's llama-server unit file is there.
    run = Apply(cluster_file, "kill-units")
    wait_on_host(info, "node1", f"[ -f /etc/systemd/system/{SERVER_UNIT}.service ]")
    run.kill()
    texts["units"] = run.text()
    final = meshdeploy("apply", cluster_file, "--auto-approve")
    return {"texts": texts, "final": final}


# What each run after a kill took (printed by Apply.end / meshdeploy(): "-> code in N s"): the
# figures in docs/benchmarks.md ("Faults survived").


def test_each_killed_run_is_taken_over(killed_runs):
    texts = killed_runs["texts"]
    # Every rerun found the dead run's host lock, took it over, and stopped what it had left.
    assert f"{texts['builder']}: stopped llama_cpp.build" in texts["download"], \
        texts["download"][-3000:]
    for h in NODES:
        assert f"{h}: stopped models.gguf[gemma/gemma-3-270m-q4_k_m.gguf]" in texts["seed"], \
            texts["seed"][-3000:]
    assert "node2: stopped rpc_cache.seed[50052]" in texts["units"], texts["units"][-3000:]
    final = killed_runs["final"]
    assert final.returncode == 0, final.stderr
    assert "took over a stale lock" in final.stdout


def unit_process(info, host: str, unit: str) -> tuple[str, list[str]]:
    """(the executable, argv) of the unit's running program: its main process, or the
    llama-server md-failover (the main process of a server that may lose a worker) runs."""
    pid = sh(info, host, f"p=$(systemctl show -p MainPID --value {unit}); "
                         "set -- $(cat /proc/$p/task/$p/children 2>/dev/null); "
                         'echo "${1:-$p}"').stdout.strip()
    assert pid.isdigit() and pid != "0", f"{host}/{unit} is not running"
    exe = sh(info, host, f"readlink /proc/{pid}/exe").stdout.strip()
    argv = sh(info, host, f"tr '\\0' '\\n' < /proc/{pid}/cmdline").stdout.splitlines()
    return exe, argv


def test_converged_cluster_runs_whole_verified_parts(killed_runs, ft_lab, cluster_file):
    info, _ = ft_lab
    commit = json.loads(cluster_file.with_name("lab.lock.json").read_text())["llama_cpp"]["commit"]
    for host, unit in (("node1", SERVER_UNIT), ("node2", RPC_UNIT)):
        exe, argv = unit_process(info, host, unit)
        build = exe.rsplit("/bin/", 1)[0]
        manifest = sh(info, host, f"cat {build}/manifest").stdout
        assert f"commit={commit}\n" in manifest, (host, exe, manifest)
        current = sh(info, host, "readlink -f /opt/meshdeploy/current").stdout.strip()
        assert current == build, (host, current, build)
    _, argv = unit_process(info, "node1", SERVER_UNIT)
    model = argv[argv.index("-m") + 1]
    for host in NODES:
        digest = sh(info, host, f"sha256sum {model}").stdout.split()[0]
        assert digest == SHA, (host, digest)
    # Every cache entry is whole: its size is the one the seeding marker records.
    marker = sh(info, "node2", f"cat {CACHE}/.meshdeploy-seeded").stdout.split("\n")
    sizes = {line.split()[3]: int(line.split()[2]) for line in marker if len(line.split()) == 4}
    assert sizes, "no seeding marker"
    listed = sh(info, "node2", f"cd {CACHE} && stat -c '%n %s' " + " ".join(sizes)).stdout
    assert {n: int(s) for n, s in (l.split() for l in listed.splitlines())} == sizes
    no_temporary_files(info)
    chat = sh(info, "node1", "curl -sf http://127.0.0.1:8080/v1/chat/completions "
              "-H 'Content-Type: application/json' -d '{\"messages\": [{\"role\": \"user\", "
              "\"content\": \"Say hello.\"}], \"max_tokens\": 16, \"temperature\": 0}'")
    reply = json.loads(chat.stdout)["choices"][0]["message"]["content"]
    assert reply.strip(), chat.stdout
    plan = meshdeploy("plan", cluster_file)
    assert plan.returncode == 0 and "No changes." in plan.stdout, plan.stdout[-3000:]
    host_lock_free(info)


def _comm(pid: int) -> str:
    """A process's name, or "" once it has exited (a pid listed a moment ago may be gone)."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def stop_host(ft_lab, host: str) -> None:
    """Power the lab host off (SIGTERM to its systemd-nspawn: a clean shutdown)."""
    info, lab = ft_lab
    ns = net.host_netns(info.name, host)
    nspawns = [p for p in net.netns_pids(ns) if _comm(p) == "systemd-nspawn"]
    assert nspawns, f"{host} is not running"
    assert procs.kill_all(nspawns, grace=30) == []
    deadline = time.monotonic() + 30
    while hosts.is_booted(Path(info.state_dir), host, lab.marker):
        assert time.monotonic() < deadline, f"{host}'s restart loop did not end"
        time.sleep(0.2)


def start_host(ft_lab, host: str) -> None:
    info, lab = ft_lab
    hosts.boot(info.name, Path(info.state_dir), host, base.cache_root() / "ccache", lab.marker)
    hosts.wait_ready(Path(info.state_dir), [host], Path(info.ssh["config"]), lab.marker, 120)


@pytest.fixture(scope="module")
def host_stopped(killed_runs, ft_lab, cluster_file):
    """A change on both hosts (one more cmake flag: a new build everywhere, then both services
    restart); node2 powered off while its build runs (frozen there, so it is surely in flight)."""
    info, _ = ft_lab
    text = cluster_file.read_text()
    flags = "    cmake_flags: [-DGGML_NATIVE=OFF]"  # inventories/lab.yaml's own
    assert flags in text
    cluster_file.write_text(text.replace(
        flags, "    cmake_flags: [-DGGML_NATIVE=OFF, -DMESHDEPLOY_LAB_FLAVOUR=2]", 1))
    run = Apply(cluster_file, "host-stopped")
    freeze_when_running(info, "node2", "ninja")
    stop_host(ft_lab, "node2")
    code = run.end()
    failed = {"code": code, "text": run.text()}
    node1 = {"active": sh(info, "node1", f"systemctl is-active {SERVER_UNIT}").stdout.strip(),
             "exe": unit_process(info, "node1", SERVER_UNIT)[0],
             "current": sh(info, "node1", "readlink -f /opt/meshdeploy/current").stdout.strip()}
    start_host(ft_lab, "node2")
    rerun = meshdeploy("apply", cluster_file, "--auto-approve")
    return {"failed": failed, "node1": node1, "rerun": rerun}


def test_stopped_host_fails_the_apply_naming_it_and_the_rerun_converges(host_stopped, ft_lab,
                                                                        cluster_file):
    info, _ = ft_lab
    failed = host_stopped["failed"]
    assert failed["code"] == 5, failed["text"][-3000:]
    lines = failed["text"].splitlines()
    assert any(line.split()[:3] == ["node2", "llama_cpp.build", "failed"] for line in lines
               if line.strip()), failed["text"][-3000:]
    assert "node2: llama_cpp.build failed:\n    (no output: the SSH connection to it was lost; " \
        "is the host up?)" in failed["text"], failed["text"][-3000:]
    # node1 built and switched `current`; md-failover (the server may lose its worker) started
    # llama-server on the new build, on the plan's placement without node2: it serves.
    assert "left as it was" not in failed["text"], failed["text"][-3000:]
    node1 = host_stopped["node1"]
    assert node1["active"] == "active"
    assert node1["exe"].startswith(node1["current"] + "/"), node1
    rerun = host_stopped["rerun"]
    print(f"node2 back -> converged in {rerun.seconds:.1f} s")
    assert rerun.returncode == 0, rerun.stderr
    host_lock_free(info)
    for host, unit in (("node1", SERVER_UNIT), ("node2", RPC_UNIT)):
        exe, _ = unit_process(info, host, unit)
        current = sh(info, host, "readlink -f /opt/meshdeploy/current").stdout.strip()
        assert exe.startswith(current + "/bin/"), (host, exe, current)
    plan = meshdeploy("plan", cluster_file)
    assert "No changes." in plan.stdout, plan.stdout[-3000:]


@pytest.fixture(scope="module")
def small_disk(host_stopped, ft_lab, cluster_file):
    """node2's models folder on a tmpfs: 200 MiB (the plan refuses), then 1 GiB filled by
    another writer while the download runs."""
    info, _ = ft_lab
    models = "/opt/meshdeploy/models"
    out = {}
    sh(info, "node2", f"mount -t tmpfs -o size=200m tmpfs {models}", timeout=30)
    try:
        out["plan"] = meshdeploy("plan", cluster_file)
    finally:
        sh(info, "node2", f"umount {models}", timeout=30)
    sh(info, "node2", f"mount -t tmpfs -o size=1g tmpfs {models}", timeout=30)
    try:
        shape(info, "node2", "40mbit")
        run = Apply(cluster_file, "disk-full")
        wait_on_host(info, "node2", f"[ -s {MODEL}.part ]")
        # Fill what is left, whatever the download wrote meanwhile: a size read first and then
        # allocated can already be too large, and then nothing is filled at all.
        sh(info, "node2", f"dd if=/dev/zero of={models}/filler bs=1M 2>/dev/null; "
                          f"df -Pk {models} | tail -n 1", timeout=120)
        out["code"] = run.end()
        out["text"] = run.text()
        shape(info, "node2", None)
        out["left"] = sh(info, "node2", f"ls -la {models}/gemma; true").stdout
        sh(info, "node2", f"rm -f {models}/filler")
        out["plan_after"] = meshdeploy("plan", cluster_file)
        out["rerun"] = meshdeploy("apply", cluster_file, "--auto-approve")
        out["digest"] = sh(info, "node2", f"sha256sum {MODEL}").stdout.split()[:1]
    finally:
        shape(info, "node2", None)
        sh(info, "node2", f"umount {models}", timeout=30)
    return out


def test_full_disk_is_one_error_with_the_numbers(small_disk, ft_lab, cluster_file):
    info, _ = ft_lab
    plan = small_disk["plan"]
    assert plan.returncode != 0
    assert "host node2: gemma needs 0.24 GiB more" in plan.stderr and "GiB free" in plan.stderr, \
        plan.stderr
    assert small_disk["code"] == 5, small_disk["text"][-3000:]
    text = small_disk["text"]
    assert "the disk is full: needs " in text and " MiB) free on /opt/meshdeploy/models/gemma" \
        in text, text[-3000:]
    assert text.count("the disk is full") == 1
    # No model file: only the partial, which is resumed and hashed before it is ever renamed.
    assert "gemma-3-270m-q4_k_m.gguf.part" in small_disk["left"]
    assert " gemma-3-270m-q4_k_m.gguf\n" not in small_disk["left"]
    assert "node2/models.gguf[gemma]" in small_disk["plan_after"].stdout
    assert small_disk["rerun"].returncode == 0, small_disk["rerun"].stderr
    assert small_disk["digest"] == [SHA]
    host_lock_free(info)
