"""network: the resources of network.transport: ssh's keys (the forwards themselves are the
services role's).

- network.ssh_key (orchestrators): the forwards' key pair, made on the host;
- network.ssh_authorize (workers): that key in the login user's authorized_keys, limited to
  the forward;
- network.ssh_known_hosts (orchestrators): the workers' host keys, pinned;
- network.sshd_streamlocal (root workers): an sshd_config drop-in that refuses Unix-socket
  forwards to the forwards' logins (authorized_keys options limit TCP forwards only).
"""

from __future__ import annotations

import posixpath

from meshdeploy.core import paths, shell
from meshdeploy.core.context import HostContext, Step
from meshdeploy.core.plan import AttrDiff
from meshdeploy.core.probe import Section
from meshdeploy.errors import PlanError
from meshdeploy.remote import ssh_settings
from meshdeploy.roles.network import ssh as sshk
from meshdeploy.roles.network.facts import ODD_LINE, SshdStreamLocal, SshKey, SshLogin
from meshdeploy.roles.network.rules import TEMPLATES

ROLE = "network"
KEY_FACT = "network.SshKey"
LOGIN_FACT = "network.SshLogin"
SSHD_FACT = "network.SshdStreamLocal"
SSHD_DIR = "/etc/ssh/sshd_config.d"


def sections(cluster, host, destroying: bool = False) -> list[Section]:
    """SshKey on every host whose layout is known (privileged where the host has root: the
    folder is root's), SshLogin on every host (as the login user: its own files) and
    SshdStreamLocal on every root host (as root: sshd -T), whatever
    the transport: what an earlier network.transport: ssh apply left (a key pair, known_hosts,
    authorized lines) is found and removed when the file turns to plain or wireguard, or when a
    host stops forwarding or being forwarded to. Two more sections in the one probe per host; a
    no-op plan stays one remote command per host."""
    out = []
    if not host.rootless:
        out.append(Section(SSHD_FACT, SshdStreamLocal, privileged=True,
                           kwargs={"file": sshd_file(cluster),
                                   "address": _login_address(cluster, host)}))
    layout = host.layout
    if layout is not None:
        out.append(Section(KEY_FACT, SshKey, privileged=True,
                           kwargs={"key": paths.ssh_key(layout),
                                   "known": paths.ssh_known_hosts(layout)}))
    out.append(Section(LOGIN_FACT, SshLogin))
    return out


def preflight(ctx: HostContext) -> None:
    """An orchestrator with forwards needs ssh (the forward) and ssh-keygen (its key)."""
    if not ctx.cluster.ssh_forwards(ctx.host):
        return
    fact = ctx.fact(KEY_FACT)
    if fact is None:
        return  # not probed (a rootless host's account unknown): the plan shows it
    missing = [t for t in ("ssh", "ssh-keygen") if t not in (fact.get("tools") or [])]
    if missing:
        termux = (ctx.fact("toolchain.Platform") or {}).get("termux")
        raise PlanError(f"{ctx.host.name}: no {' or '.join(missing)} on PATH for the ssh forwards "
                        "to its workers (network.transport: ssh)",
                        hint="pkg install openssh" if termux else
                        "install the OpenSSH client on the host (Debian: apt-get install "
                        "openssh-client; an administrator runs it on a host without root)")


# -- network.ssh_key ------------------------------------------------------------------------------

def ssh_key(ctx: HostContext) -> Step:
    """network.ssh_key: the orchestrator's ed25519 key pair for its forwards, made on the host by
    ssh-keygen (core.paths.ssh_key, in a 0700 folder); the private key never leaves the host.
    `-replace=network.ssh_key` makes a new pair.

    + example: node1/network.ssh_key  + create  public key (known after apply)
    """
    if not ctx.cluster.ssh_forwards(ctx.host):
        left = _key_delete(ctx, "no ssh forwards from this host any more" if
                           ctx.cluster.network.forwarded else
                           "left by an earlier network.transport: ssh apply")
        return left or Step(ctx.change(ROLE, "ssh_key", "no-op", "no ssh forwards from this host"))
    fact = ctx.fact(KEY_FACT) or {}
    have = fact.get("public_key") if fact.get("private") else None
    rotate = ctx.replacing("network.ssh_key")
    if have and not rotate:
        return Step(ctx.change(ROLE, "ssh_key", "no-op",
                               f"key pair present ({sshk.fingerprint(have)})"))
    key = paths.ssh_key(ctx.host.layout)
    diff = AttrDiff("public key", sshk.fingerprint(have), None, forces_replacement=rotate,
                    known_after_apply=True)
    reason = ("-replace: a new key pair, made on the host (the private key never leaves it); "
              "the workers authorize the new key" if have else
              "no key pair yet: made on the host (the private key never leaves it)")
    return Step(ctx.change(ROLE, "ssh_key", "replace" if have else "create", reason, [diff]),
                [shell.template(TEMPLATES / "ssh-keygen.sh", DIR=posixpath.dirname(key),
                                KEY=key, COMMENT=f"{sshk.MARKER[:-1]}@{ctx.host.name}")])


def orchestrator_key(ctx: HostContext, orchestrator) -> str | None:
    """The orchestrator's public key, or None while it is known only after apply: it has none
    yet, or its ssh_key step makes a new one that has not been re-read."""
    fact = ctx.fact_of(orchestrator.name, KEY_FACT) or {}
    key = fact.get("public_key") if fact.get("private") else None
    key = settled_key(ctx, orchestrator.name, key, "network.ssh_key", "network.ssh_key",
                      sshk.fingerprint)
    return key if key and sshk.public_key(key) == key else None


def settled_key(ctx, host_name: str, key: str | None, step_slot: str, replaced: str,
                fingerprint) -> str | None:
    """`key` (a host's public key as its fact says), or None while the key is known only after
    apply: the host's `step_slot` step makes a new one that has not been re-read, or
    `-replace=<replaced>` names the host and its steps are not planned here (WireGuard's keys
    and the ssh forwards' share this)."""
    step = ctx.steps.on(host_name).get(step_slot)
    if step is None and ctx.replacing(replaced, host_name):
        return None  # planned without the host's steps: its key is being replaced
    if step is not None and step.commands:
        before = next((x.before for x in step.change.diffs if x.name == "public key"), None)
        if key is None or fingerprint(key) == before:
            return None
    return key


# -- network.ssh_authorize --------------------------------------------------------------------------

def _live_lines(cluster, fact: dict) -> tuple[dict[str, list[str]], list[str]]:
    """This cluster's authorized lines by orchestrator name, and its marker fields of lines that
    do not parse (each one drift: the write removes it)."""
    marker = sshk.cluster_marker(cluster)
    live: dict[str, list[str]] = {}
    for line in fact.get("authorized") or []:
        comment = line.split()[-1]
        if comment.startswith(marker):
            live.setdefault(comment[len(marker):], []).append(line)
    odd = [m for m in fact.get("unparsed") or [] if m.startswith(marker)]
    return live, odd


def _authorize_diffs(wanted: dict, live: dict, odd: list[str]) -> list[AttrDiff]:
    out = []
    for name in list(wanted) + sorted(set(live) - set(wanted)):
        after = wanted.get(name)
        before = live.get(name) or []
        shown_before = "; ".join(sshk.shown_line(b) for b in before) or None
        if name in wanted and after is None:
            out.append(AttrDiff(f"key of {name}", shown_before, "(known after apply)",
                                known_after_apply=True))
        elif before != ([after] if after else []):
            shown_after = sshk.shown_line(after)
            if shown_after == shown_before:
                shown_after += " (other options)"
            out.append(AttrDiff(f"key of {name}", shown_before, shown_after))
    if odd:
        out.append(AttrDiff("unreadable lines", ", ".join(odd), None))
    return out


def authorize_script(cluster, lines: list[str]) -> str:
    """The write of the login user's authorized_keys: this cluster's lines become `lines`."""
    return shell.template(TEMPLATES / "ssh-authorize.sh", MARKER=sshk.cluster_marker(cluster),
                          LINES="\n".join(lines))


# sshd's AuthorizedKeysFile values that name the file ssh-authorize.sh writes.
_OUR_FILE = {".ssh/authorized_keys", "%h/.ssh/authorized_keys", "~/.ssh/authorized_keys"}


def _refuse_other_keys_file(ctx, fact: dict) -> None:
    keys_file = fact.get("keys_file")
    if keys_file is None or _OUR_FILE & set(keys_file.split()):
        return
    raise PlanError(
        f"{ctx.host.name}: sshd reads AuthorizedKeysFile {keys_file}, not ~/.ssh/authorized_keys, "
        "where meshdeploy writes the forwards' keys: the forwards would be refused",
        hint="add .ssh/authorized_keys to AuthorizedKeysFile in sshd_config (then reload sshd), "
             "or use network.transport: plain or wireguard")


def _refuse_link(ctx, fact: dict) -> None:
    if fact.get("authorized_link"):
        raise PlanError(
            f"{ctx.host.name}: ~/.ssh/authorized_keys of {fact.get('user') or 'the login user'} "
            "is a symbolic link; meshdeploy does not write through it (nor replace it: the "
            "keys it points at would stop being the ones sshd reads)",
            hint="make it a regular file with the same lines (cp --remove-destination "
                 "\"$(readlink -f ~/.ssh/authorized_keys)\" ~/.ssh/authorized_keys), then plan "
                 "again; or use network.transport: plain or wireguard")


def ssh_authorize(ctx: HostContext) -> Step:
    """network.ssh_authorize: in the worker's login user's ~/.ssh/authorized_keys, one line per
    orchestrator that forwards to it (ssh.authorized_line: a forced command, port forwarding to
    exactly its rpc ports on loopback, from its address), marked `meshdeploy-rpc:<cluster>:<host>`;
    every other line kept byte for byte. Runs as the login user, never sudo.

    + example: node2/network.ssh_authorize  ~ update  key of node1: forwards 127.0.0.1:50052 ...
    """
    cluster = ctx.cluster
    fact = ctx.fact(LOGIN_FACT) or {}
    pairs = cluster.forwarded_to(ctx.host)
    keys = {s.name: orchestrator_key(ctx, s) for s, _ in pairs}
    wanted = {s.name: (sshk.authorized_line(cluster, s, f, keys[s.name])
                       if keys[s.name] else None) for s, f in pairs}
    live, odd = _live_lines(cluster, fact)
    diffs = _authorize_diffs(wanted, live, odd)
    if not diffs:
        return Step(ctx.change(ROLE, "ssh_authorize", "no-op",
                               f"{len(wanted)} orchestrator key(s) authorized as wanted" if wanted
                               else "no ssh forward reaches this host"), sudo=False)
    action = "create" if not live and not odd else ("delete" if not wanted else "update")
    if None in wanted.values():
        who = sorted(n for n, line in wanted.items() if line is None)
        return Step(ctx.change(ROLE, "ssh_authorize", action,
                               f"public keys known after apply ({', '.join(who)})", diffs),
                    sudo=False)
    _refuse_link(ctx, fact)
    if wanted:
        _refuse_other_keys_file(ctx, fact)
    reason = ("no key of this cluster authorized yet" if action == "create" else
              "left by an earlier network.transport: ssh apply"
              if action == "delete" and not cluster.network.forwarded else
              "no ssh forward reaches this host any more" if action == "delete" else
              "authorized lines differ (a new key, port or address, or drift)")
    return Step(ctx.change(ROLE, "ssh_authorize", action, reason, diffs),
                [authorize_script(cluster, list(wanted.values()))], sudo=False)


# -- network.ssh_known_hosts ------------------------------------------------------------------------

def ssh_known_hosts(ctx: HostContext) -> Step:
    """network.ssh_known_hosts: the orchestrator's pinned known_hosts for its forwards
    (core.paths.ssh_known_hosts, 0644 in the key's 0700 folder): each worker's sshd host keys as
    its SshLogin fact read them over meshdeploy's own checked connection, `ADDR type key` (port
    22) or `[ADDR]:PORT type key`. The forwards accept no other key and learn none.

    + example: node1/network.ssh_known_hosts  + create  node2: 10.200.0.12 ssh-ed25519 SHA256:...
    """
    forwards = ctx.cluster.ssh_forwards(ctx.host)
    if not forwards:
        return Step(ctx.change(ROLE, "ssh_known_hosts", "no-op", "no ssh forwards from this host"))
    live = (ctx.fact(KEY_FACT) or {}).get("known_hosts")
    missing, found = [], []
    for forward in forwards:
        _refuse_unchecked(ctx, forward.worker)
        login = ctx.fact_of(forward.worker.name, LOGIN_FACT)
        if login is None:
            missing.append(forward.worker.name)
            continue
        if not login.get("host_keys"):
            raise PlanError(
                f"{forward.worker.name}: no sshd host key found to pin for the forward from "
                f"{ctx.host.name} (read as the login user: /etc/ssh/ssh_host_*_key.pub, and "
                "$PREFIX/etc/ssh/ under Termux)",
                hint="make the host keys' .pub files readable there (sshd's own keys: "
                     "ssh-keygen -A makes them), or use network.transport: plain or wireguard")
        found.append((forward.worker, login["host_keys"]))
    path = paths.ssh_known_hosts(ctx.host.layout)
    diffs = []
    want = sshk.known_hosts_lines(found)
    have = live or []
    for worker, _ in found:
        prefix = sshk.known_hosts_host(worker) + " "
        after = [line[len(prefix):] for line in want if line.startswith(prefix)]
        before = [line[len(prefix):] for line in have if line.startswith(prefix)]
        if after != before:
            diffs.append(AttrDiff(f"host keys of {worker.name}",
                                  _keys_shown(prefix, before), _keys_shown(prefix, after)))
    for name in missing:
        diffs.append(AttrDiff(f"host keys of {name}", None, "(known after apply)",
                              known_after_apply=True))
    known = {sshk.known_hosts_host(w) + " " for w, _ in found} | {
        sshk.known_hosts_host(f.worker) + " " for f in forwards}
    stale = [line for line in have if not any(line.startswith(k) for k in known)]
    if stale:
        diffs.append(AttrDiff("other lines", f"{len(stale)} line(s)"
                              + (" not in meshdeploy's form" if ODD_LINE in stale else ""), None))
    action = "create" if live is None else "update"
    if missing:
        return Step(ctx.change(ROLE, "ssh_known_hosts", action,
                               f"host keys known after apply ({', '.join(missing)})", diffs))
    if not diffs:
        return Step(ctx.change(ROLE, "ssh_known_hosts", "no-op",
                               f"{len(want)} host key(s) of {len(found)} worker(s) pinned"))
    folder = posixpath.dirname(path)
    return Step(ctx.change(ROLE, "ssh_known_hosts", action,
                           "not written yet" if live is None else
                           "pinned keys differ (a new host key, address or ssh port)", diffs),
                [shell.command("umask", "077", shell.THEN, "mkdir", "-p", folder, shell.AND,
                               "chmod", "700", folder),
                 shell.write_file(path, "\n".join(want), "0644")])


def _refuse_unchecked(ctx, worker) -> None:
    """The host keys pinned are what the worker's SshLogin probe read over meshdeploy's own
    connection: with host-key checking off, whoever sat on that path chose them."""
    settings = ssh_settings.resolve(worker)
    if settings.host_key != ssh_settings.NO:
        return
    raise PlanError(
        f"{worker.name}: meshdeploy reaches it with host-key checking off ({settings.host_key_from}"
        f"), so the host keys it read there are not pins for the forward from {ctx.host.name}",
        hint=f"set hosts.{worker.name}.ssh.host_key: yes (or accept-new), or drop "
             "StrictHostKeyChecking no from the ssh_config, then plan again")


def _keys_shown(prefix: str, keys: list[str]) -> str | None:
    if not keys:
        return None
    return prefix + ", ".join(f"{k.split()[0]} {sshk.fingerprint(k)}" for k in keys)


# -- destroy ----------------------------------------------------------------------------------------

def destroy(ctx: HostContext) -> list[Step]:
    """This cluster's authorized lines (as the login user), and the key pair and known_hosts
    with their folder once empty."""
    steps: list[Step] = []
    live, odd = _live_lines(ctx.cluster, ctx.fact(LOGIN_FACT) or {})
    if live or odd:
        diffs = _authorize_diffs({}, live, odd)
        _refuse_link(ctx, ctx.fact(LOGIN_FACT) or {})
        steps.append(Step(ctx.change(ROLE, "ssh_authorize", "delete", "leaves the cluster", diffs),
                          [authorize_script(ctx.cluster, [])], sudo=False))
    left = _key_delete(ctx, "leaves the cluster")
    dropin = (ctx.fact(SSHD_FACT) or {}).get("content")
    if dropin is not None and not ctx.host.rootless:
        steps.append(Step(ctx.change(ROLE, "sshd_streamlocal", "delete", "leaves the cluster",
                                     [AttrDiff("AllowStreamLocalForwarding", "no", None)]),
                          [shell.command("rm", "-f", sshd_file(ctx.cluster)), _reload_sshd()]))
    return steps + ([left] if left else [])


def _key_delete(ctx: HostContext, reason: str) -> Step | None:
    """The removal of the key pair and known_hosts (and their folder once empty) the host's
    SshKey fact found, or None when it found none."""
    fact = ctx.fact(KEY_FACT)
    if not fact or not (fact.get("private") or fact.get("public_key") or
                        fact.get("known_hosts") is not None):
        return None
    key = paths.ssh_key(ctx.host.layout)
    folder = posixpath.dirname(key)
    return Step(ctx.change(ROLE, "ssh_key", "delete", reason,
                           [AttrDiff("public key", sshk.fingerprint(fact.get("public_key")), None)]),
                [shell.command("rm", "-f", key, f"{key}.pub",
                               paths.ssh_known_hosts(ctx.host.layout), shell.THEN,
                               "rmdir", folder, ctx.host.layout.config, shell.QUIET,
                               shell.OR, "true")])


# -- network.sshd_streamlocal ----------------------------------------------------------------------

def sshd_file(cluster) -> str:
    """The drop-in of this cluster: first among sshd_config.d's files, as sshd applies the first
    Match block that sets a keyword for a connection."""
    return f"{SSHD_DIR}/00-meshdeploy-{cluster.name}.conf"


def _login_address(cluster, host) -> str:
    """Where an orchestrator's forward logs in to `host` from (the first one's), for sshd -T;
    the host's own address where nothing forwards to it."""
    for orchestrator, _ in cluster.forwarded_to(host):
        try:
            return sshk.source_address(cluster, orchestrator)
        except PlanError:
            continue
    return "127.0.0.1"


def sshd_dropin(cluster, host, user: str) -> str | None:
    """The drop-in a root worker's sshd reads: for the forwards' logins (the login user from
    the orchestrators' addresses, as their authorized lines' from= says), no Unix-socket
    forwarding. None where no forward reaches the host."""
    pairs = cluster.forwarded_to(host)
    if not pairs:
        return None
    addresses = sorted({sshk.source_address(cluster, s) for s, _ in pairs})
    return (f"# Managed by meshdeploy (cluster {cluster.name}); `meshdeploy apply` rewrites this "
            "file.\n"
            "# network.transport: ssh: the orchestrators' forward keys log in as this user from "
            "these\n# addresses. Their authorized_keys options (permitopen, permitlisten) limit "
            "TCP forwards\n# only: Unix-socket forwards (ssh -L or -R to a socket path) are "
            "refused here.\n"
            f"Match User {user} Address {','.join(addresses)}\n"
            "\tAllowStreamLocalForwarding no\n")


def _reload_sshd() -> str:
    return shell.command("systemctl", "reload", "ssh.service", shell.QUIET, shell.OR,
                         "systemctl", "reload", "sshd.service")


def sshd_streamlocal(ctx: HostContext) -> Step:
    """network.sshd_streamlocal: on a root worker of network.transport: ssh, an sshd_config
    drop-in (sshd_file) that refuses Unix-socket forwards to the forwards' logins: the login
    user from the orchestrators' addresses. Checked with `sshd -t` before sshd reloads, and with
    `sshd -T` after. A host whose sshd_config does not include sshd_config.d gets none (every
    plan warns); a rootless worker's sshd is not meshdeploy's to configure (docs/security.md).

    + example: node2/network.sshd_streamlocal  + create  AllowStreamLocalForwarding: no
    """
    fact = ctx.fact(SSHD_FACT)
    if ctx.host.rootless or fact is None:
        return Step(ctx.change(ROLE, "sshd_streamlocal", "no-op",
                               "rootless: sshd is not meshdeploy's" if ctx.host.rootless
                               else "sshd not read"))
    user = (ctx.fact(LOGIN_FACT) or {}).get("user") or fact.get("user")
    want = sshd_dropin(ctx.cluster, ctx.host, user) if user else None
    have = fact.get("content")
    path = sshd_file(ctx.cluster)
    if want is None:
        if have is None:
            return Step(ctx.change(ROLE, "sshd_streamlocal", "no-op",
                                   "no ssh forward reaches this host"))
        return Step(ctx.change(ROLE, "sshd_streamlocal", "delete",
                               "no ssh forward reaches this host any more",
                               [AttrDiff("AllowStreamLocalForwarding", "no", None)]),
                    [shell.command("rm", "-f", path), _reload_sshd()])
    if not fact.get("include"):
        return Step(ctx.change(ROLE, "sshd_streamlocal", "no-op",
                               "sshd_config does not include sshd_config.d (warned)"))
    if have == want and fact.get("effective") == "no":
        return Step(ctx.change(ROLE, "sshd_streamlocal", "no-op",
                               "Unix-socket forwards refused to the forwards' logins"))
    address = _login_address(ctx.cluster, ctx.host)
    check = shell.command("sshd", "-T", "-C", f"user={user},host={address},addr={address}")
    return Step(ctx.change(ROLE, "sshd_streamlocal", "create" if have is None else "update",
                           "Unix-socket forwards of the forwards' logins not refused yet" if
                           have is None else "drop-in differs, or sshd does not apply it",
                           [AttrDiff("AllowStreamLocalForwarding", fact.get("effective"), "no")]),
                [shell.write_file(path, want, "0644"),
                 'PATH="$PATH:/usr/sbin:/sbin"; ' + shell.command("sshd", "-t") + " || { "
                 + shell.command("rm", "-f", path) + "; "
                 + shell.command("echo", f"{ctx.host.name}: sshd refuses {path}; removed",
                                 shell.TO_STDERR) + "; exit 1; }",
                 _reload_sshd(),
                 'PATH="$PATH:/usr/sbin:/sbin"; ' + check
                 + " | grep -qx 'allowstreamlocalforwarding no' || { "
                 + shell.command("echo", f"{ctx.host.name}: sshd does not apply {path} to "
                                 f"{user}", shell.TO_STDERR) + "; exit 1; }"])


def sshd_warnings(cluster, facts: dict) -> list[str]:
    """Root workers whose sshd_config does not include sshd_config.d: their forwards' logins
    keep Unix-socket forwarding."""
    out = []
    for host in cluster.hosts:
        fact = (facts.get(host.name) or {}).get(SSHD_FACT)
        if not host.rootless and fact is not None and not fact.get("include") \
                and cluster.forwarded_to(host):
            out.append(f"{host.name}: sshd_config does not include /etc/ssh/sshd_config.d/, so "
                       "meshdeploy cannot refuse Unix-socket forwards (ssh -L/-R to a socket "
                       "path) to the forward key's logins there; add `Match User <login user>` "
                       "with `AllowStreamLocalForwarding no` to sshd_config yourself")
    return out
