"""The review's findings on network.transport: ssh's authorized_keys write, login probe, pins
and leftovers, each shown first (the pre-fix write, PRE_FIX, run for real: lost lines, a short
file, root's file swapped for the user's; the probe reading a user's $PREFIX) and then refused
or fixed by the scripts and the plan as they are now."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest
from support.nonroot import as_user, give, owned_folder
from support.require import require
from test_ssh_transport_network import (CLUSTER, K1, K2, LINE1, OTHERS, ctx_for, key_fact,
                                        login_fact)

from meshdeploy.core.loading import load_cluster
from meshdeploy.core import shell
from meshdeploy.errors import PlanError
from meshdeploy.roles.network import operations, ssh_ops
from meshdeploy.roles.network.facts import SshLogin

# The write as it was before the review: no lock, no line count, no owner or type check.
PRE_FIX = """umask 077
dir="$HOME/.ssh"
file="$dir/authorized_keys"
if [ -L "$file" ]; then exit 1; fi
if [ ! -e "$file" ] && [ -z "$LINES" ]; then exit 0; fi
if [ ! -d "$dir" ]; then mkdir "$dir" && chmod 700 "$dir" || exit 1; fi
tmp=$(mktemp "$dir/.authorized_keys.meshdeploy.XXXXXX") || exit 1
trap 'rm -f "$tmp"' EXIT
{
  if [ -f "$file" ]; then M="$MARKER" awk 'index($NF, ENVIRON["M"]) != 1' "$file" || exit 1; fi
  if [ -n "$LINES" ]; then printf '%s\\n' "$LINES"; fi
} > "$tmp" || exit 1
chmod 600 "$tmp" && mv -f "$tmp" "$file"
"""
LINE_B = f"restrict {K2} meshdeploy-rpc:other:gpu1"
AWK = shutil.which("awk")
TOOLS = ("sh", "mktemp", "chmod", "mv", "rm", "mkdir", "rmdir", "wc", "ls", "id", "sleep", "cat",
         "sed", "head")


@pytest.fixture
def home():
    folder = owned_folder()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def bins():
    """Where tool_dir makes its PATH: a folder the user reaches (root's pytest tmp is 0700)."""
    folder = owned_folder()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def tool_dir(tmp: Path, awk_body: str | None = None, flock: bool = True) -> str:
    """A PATH of the tools the write needs (flock only when asked), awk a wrapper when given."""
    tmp.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS + (("flock",) if flock else ()):
        if shutil.which(tool):
            (tmp / tool).symlink_to(shutil.which(tool))
    awk = tmp / "awk"
    if awk_body is None:
        awk.symlink_to(AWK)
    else:
        awk.write_text(f"#!/bin/sh\n{awk_body}\n")
        awk.chmod(0o755)
    give(tmp)
    return str(tmp)


def write(home: Path, script: str, path: str, marker="meshdeploy-rpc:lab:", lines=(LINE1,)):
    text = shell.script(script, MARKER=marker, LINES="\n".join(lines))
    argv = as_user([shutil.which("sh"), "-c", text])
    argv[0] = shutil.which(argv[0]) or argv[0]  # setpriv is not on the write's PATH
    return subprocess.run(argv, capture_output=True, text=True,
                          env={"HOME": str(home), "PATH": path})


def now() -> str:
    return str(shell.body(Path(ssh_ops.TEMPLATES) / "ssh-authorize.sh"))


@pytest.fixture
def cluster(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(CLUSTER)
    return load_cluster(path)


# -- 1. two writers at once ------------------------------------------------------------------------

def race(home: Path, script: str, path: str) -> bytes:
    """Two clusters' writes at once, each awk slowed so both read before either renames."""
    (home / ".ssh").mkdir(mode=0o700)
    (home / ".ssh" / "authorized_keys").write_bytes(OTHERS)
    give(home)
    results = []
    runs = [("meshdeploy-rpc:lab:", [LINE1]), ("meshdeploy-rpc:zz:", [LINE_B + "x"])]
    threads = [threading.Thread(target=lambda m=m, ls=ls: results.append(
        write(home, script, path, m, ls))) for m, ls in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.returncode == 0 for r in results), [r.stderr for r in results]
    return (home / ".ssh" / "authorized_keys").read_bytes()


@pytest.mark.parametrize("flock", [True, False], ids=["flock", "mkdir-lock"])
def test_two_writers_at_once_keep_both_lines(home, bins, flock):
    if flock:
        require("flock")
    # Each awk reads, then waits (3 s at most) for a second awk to have read before it prints:
    # unlocked, both writers read the old file before either renames; locked, the second
    # cannot start before the first ends.
    barrier = bins / "barrier"
    barrier.mkdir()
    give(barrier)
    slow = (f'out=$({AWK} "$@"; echo .); d={barrier}; : > "$d/$$"; n=0\n'
            'while [ "$(ls "$d" | wc -l)" -lt 2 ] && [ $n -lt 30 ]; do sleep 0.1; n=$((n+1)); done\n'
            'printf %s "${out%.}"')
    path = tool_dir(bins / "bin", slow, flock=flock)
    lost = race(home, PRE_FIX, path)
    assert (LINE1.encode() in lost) != ((LINE_B + "x").encode() in lost)  # one line lost
    shutil.rmtree(home / ".ssh")
    for arrived in barrier.iterdir():
        arrived.unlink()
    data = race(home, now(), path)
    assert LINE1.encode() in data and (LINE_B + "x").encode() in data and data.startswith(OTHERS)
    assert sorted(p.name for p in (home / ".ssh").iterdir()) == ["authorized_keys"]


# -- 2. a short write that awk's status hides -----------------------------------------------------

def test_a_short_temporary_file_never_replaces_the_old_one(home, bins):
    path = tool_dir(bins / "bin", f"{AWK} \"$@\" | sed '$d'")  # drops the last line, exit 0
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700)
    (ssh / "authorized_keys").write_bytes(OTHERS)
    give(home)
    assert write(home, PRE_FIX, path).returncode == 0
    assert (ssh / "authorized_keys").read_bytes() != OTHERS + LINE1.encode() + b"\n"  # short
    (ssh / "authorized_keys").write_bytes(OTHERS)
    give(home)
    proc = write(home, now(), path)
    assert proc.returncode != 0 and "a short write" in proc.stderr and "left as it was" in proc.stderr
    assert (ssh / "authorized_keys").read_bytes() == OTHERS
    assert sorted(p.name for p in ssh.iterdir()) == ["authorized_keys"]


# -- 3. a file the user does not own, or no regular file -----------------------------------------

@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a root-owned file")
def test_a_root_owned_file_is_not_swapped_for_the_users(home, bins):
    path = tool_dir(bins / "bin")
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700)
    give(home)
    keys = ssh / "authorized_keys"
    keys.write_bytes(OTHERS)
    os.chown(keys, 0, 0)
    keys.chmod(0o644)
    assert write(home, PRE_FIX, path).returncode == 0
    assert keys.stat().st_uid != 0  # root's file is now the login user's
    keys.unlink()
    keys.write_bytes(OTHERS)
    os.chown(keys, 0, 0)
    proc = write(home, now(), path)
    assert proc.returncode != 0 and "owned by another user, not" in proc.stderr
    assert keys.stat().st_uid == 0 and keys.read_bytes() == OTHERS


@pytest.mark.parametrize("kind", ["fifo", "folder"])
def test_no_regular_file_is_refused(home, bins, kind):
    path = tool_dir(bins / "bin")
    ssh = home / ".ssh"
    ssh.mkdir(mode=0o700)
    keys = ssh / "authorized_keys"
    os.mkfifo(keys) if kind == "fifo" else keys.mkdir()
    give(home)
    assert write(home, PRE_FIX, path).returncode == 0
    assert keys.is_file() if kind == "fifo" else (keys.is_dir() and any(keys.iterdir()))
    shutil.rmtree(keys) if kind == "folder" else keys.unlink()
    os.mkfifo(keys) if kind == "fifo" else keys.mkdir()
    give(home)
    proc = write(home, now(), path)
    assert proc.returncode != 0 and "is not a regular file" in proc.stderr
    assert (keys.is_fifo() if kind == "fifo" else not any(keys.iterdir()))


# -- 3b/4. the login probe: sshd's AuthorizedKeysFile, $PREFIX only on Termux ----------------------

def probe(home: Path, **env) -> dict:
    out = subprocess.run(as_user(["sh", "-c", SshLogin().command()]), capture_output=True,
                         text=True, env={"HOME": str(home), "PATH": os.environ["PATH"], **env})
    return SshLogin().process(out.stdout.splitlines())


def test_prefix_host_keys_are_read_on_termux_only(home):
    """A user's own PREFIX on a plain Linux host is no sshd's: its key is not pinned."""
    for prefix in (home / "usr", home / "data/data/com.termux/files/usr"):
        (prefix / "etc" / "ssh").mkdir(parents=True)
        (prefix / "etc" / "ssh" / "ssh_host_ed25519_key.pub").write_text(K1 + " planted\n")
    give(home)
    assert K1 not in probe(home, PREFIX=str(home / "usr"))["host_keys"]
    assert K1 in probe(home, PREFIX=str(home / "data/data/com.termux/files/usr"))["host_keys"]
    assert K1 in probe(home, PREFIX=str(home / "usr"), TERMUX_VERSION="0.118.1")["host_keys"]


def test_probe_reads_authorized_keys_file_outside_match(home):
    etc = home / "data/data/com.termux/files/usr/etc/ssh"
    (etc / "sshd_config.d").mkdir(parents=True)
    (etc / "sshd_config").write_text("Port 8022\nauthorizedkeysfile  /etc/keys/%u  x\n")
    give(home)
    prefix = str(home / "data/data/com.termux/files/usr")
    assert probe(home, PREFIX=prefix)["keys_file"] == "/etc/keys/%u  x"
    (etc / "sshd_config.d" / "10.conf").write_text("Match User x\nAuthorizedKeysFile none\n")
    (etc / "sshd_config.d" / "00.conf").write_text("AuthorizedKeysFile .ssh/authorized_keys\n")
    give(home)
    assert probe(home, PREFIX=prefix)["keys_file"] == ".ssh/authorized_keys"


@pytest.mark.parametrize("keys_file, refused", [
    ("/etc/ssh/authorized_keys/%u", True), ("none", True),
    (".ssh/authorized_keys .ssh/authorized_keys2", False),
    ("%h/.ssh/authorized_keys", False), (None, False)])
def test_a_custom_authorized_keys_file_is_refused_at_plan_time(cluster, keys_file, refused):
    facts = {"node1": {"network.SshKey": key_fact()},
             "node2": {"network.SshLogin": {**login_fact(), "keys_file": keys_file}}}
    if not refused:
        [script] = ssh_ops.ssh_authorize(ctx_for(cluster, "node2", facts)).commands
        assert f"{K1} meshdeploy-rpc:lab:node1" in script
        return
    with pytest.raises(PlanError, match=f"sshd reads AuthorizedKeysFile {keys_file}, not") as exc:
        ssh_ops.ssh_authorize(ctx_for(cluster, "node2", facts))
    assert "add .ssh/authorized_keys to AuthorizedKeysFile" in exc.value.hint
    # Removing this cluster's lines (no forward wanted any more) is still planned.
    facts["node2"]["network.SshLogin"]["authorized"] = [LINE1]
    gone = ssh_ops.destroy(ctx_for(cluster, "node2", facts))
    assert gone[0].change.action == "delete"


# -- 5. pins read over an unchecked connection ----------------------------------------------------

@pytest.mark.parametrize("where", ["file", "ssh_config"])
def test_host_keys_read_without_host_key_checking_are_no_pins(tmp_path, where):
    if where == "file":
        text = CLUSTER.replace("ssh: {port: 8022}", "ssh: {port: 8022, host_key: 'no'}")
    else:
        (tmp_path / "ssh_config").write_text("Host *\n  StrictHostKeyChecking no\n")
        text = CLUSTER.replace("ssh: {port: 8022}",
                               f"ssh: {{port: 8022, config: {tmp_path / 'ssh_config'}}}")
    (tmp_path / "c.yaml").write_text(text)
    cluster = load_cluster(tmp_path / "c.yaml")
    facts = {"node1": {"network.SshKey": key_fact()},
             **{n: {"network.SshLogin": login_fact()} for n in ("node2", "node3")}}
    with pytest.raises(PlanError, match="node2: meshdeploy reaches it with host-key checking off"
                       ) as exc:
        ssh_ops.ssh_known_hosts(ctx_for(cluster, "node1", facts))
    assert "host_key: yes (or accept-new)" in exc.value.hint


# -- 6. leaving network.transport: ssh ------------------------------------------------------------

def test_leaving_ssh_removes_what_an_ssh_apply_left(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER.replace("transport: ssh", "transport: plain\n  firewall: false"))
    cluster = load_cluster(tmp_path / "c.yaml")
    keys = [s.key for s in operations.sections(cluster, cluster.host("node1"))]
    assert "network.SshKey" in keys and "network.SshLogin" in keys
    facts = {"node1": {"network.SshKey": key_fact(known=["10.200.0.12 " + K2])},
             "node2": {"network.SshLogin": login_fact([LINE1, LINE_B])}}
    key = ssh_ops.ssh_key(ctx_for(cluster, "node1", facts))
    assert key.change.action == "delete" and "earlier network.transport: ssh" in key.change.reason
    assert "/etc/meshdeploy/ssh/known_hosts" in key.commands[0]
    auth = ssh_ops.ssh_authorize(ctx_for(cluster, "node2", facts))
    assert auth.change.action == "delete" and auth.sudo is False
    assert "LINES=''" in auth.commands[0] and "MARKER=meshdeploy-rpc:lab:" in auth.commands[0]
    # Nothing left: no-ops.
    clean = {"node1": {"network.SshKey": {**key_fact(None), "tools": []}},
             "node2": {"network.SshLogin": login_fact([LINE_B])}}
    assert ssh_ops.ssh_key(ctx_for(cluster, "node1", clean)).change.action == "no-op"
    assert ssh_ops.ssh_authorize(ctx_for(cluster, "node2", clean)).change.action == "no-op"
