"""Cluster-file hosts for the Vagrant lab (the repository's Vagrantfile), from `vagrant ssh-config`.

`vagrant ssh-config` names each machine's SSH endpoint as Vagrant reaches it, usually 127.0.0.1
plus a forwarded port. That address is useless to the cluster: a host's address is also what
llama-server dials for RPC, and the workers must be dialled on the private network. So the
address comes from the Vagrantfile's MESHDEPLOY_HOSTS (or an explicit mapping), and SSH goes to
that private address on port 22, which VirtualBox host-only and libvirt networks make reachable
from the machine that runs Vagrant. User and key come from ssh-config.

    vagrant up && python -m meshdeploy.lab.vagrant > hosts.yaml
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from meshdeploy.lab.errors import LabError

_HOSTS_BLOCK = re.compile(r"^\s*MESHDEPLOY_HOSTS\s*=\s*\{(.*?)\}", re.M | re.S)
_HOST_PAIR = re.compile(r"""["']([\w.-]+)["']\s*=>\s*["'](\d{1,3}(?:\.\d{1,3}){3})["']""")
_LOOPBACK = ("127.", "::1", "localhost")
SSH_PORT = 22


def private_ips_from_vagrantfile(text: str) -> dict[str, str]:
    """The name -> private IPv4 hash MESHDEPLOY_HOSTS of a Vagrantfile, in file order."""
    block = _HOSTS_BLOCK.search(text)
    if block is None:
        raise LabError("the Vagrantfile has no MESHDEPLOY_HOSTS = { \"name\" => \"ip\", ... } hash",
                       hint="pass the private addresses with --ip name=address")
    pairs = _HOST_PAIR.findall(_strip_comments(block.group(1)))
    if not pairs:
        raise LabError("MESHDEPLOY_HOSTS in the Vagrantfile lists no \"name\" => \"IPv4\" pairs")
    return dict(pairs)


def _strip_comments(ruby: str) -> str:
    return "\n".join(line.split("#", 1)[0] for line in ruby.splitlines())


def parse_ssh_config(text: str) -> list[tuple[str, dict[str, list[str]]]]:
    """[(host alias, {lowercased keyword: [values...]})] in file order."""
    entries: list[tuple[str, dict[str, list[str]]]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([^\s=]+)(?:\s*=\s*|\s+)(.+)$", line)
        if match is None:
            raise LabError(f"ssh-config line {lineno}: a keyword without a value: {raw!r}")
        key, value = match.groups()
        try:
            value = " ".join(shlex.split(value))
        except ValueError as exc:
            raise LabError(f"ssh-config line {lineno}: {exc}: {raw!r}") from exc
        if key.lower() == "host":
            entries.append((value, {}))
        elif not entries:
            raise LabError(f"ssh-config line {lineno}: {key} before any Host line",
                           hint="pass the output of `vagrant ssh-config`")
        else:
            entries[-1][1].setdefault(key.lower(), []).append(value)
    return entries


def cluster_hosts_from_ssh_config(text: str, private_ips: dict[str, str] | None = None,
                                  vagrantfile: Path | None = None) -> list[dict]:
    """Host entries [{"name", "address", "ssh": {"user", "port", "key"}}] for a cluster file.

    + text: output of `vagrant ssh-config`
    + private_ips: name -> private-network IPv4; default: MESHDEPLOY_HOSTS of `vagrantfile`
      (default: the Vagrantfile in the current directory)
    """
    if private_ips is None:
        path = Path(vagrantfile) if vagrantfile is not None else Path("Vagrantfile")
        try:
            private_ips = private_ips_from_vagrantfile(path.read_text())
        except OSError as exc:
            raise LabError(f"cannot read {path}: {exc.strerror}",
                           hint="run from the directory of the Vagrantfile or pass --vagrantfile") from exc
    entries = parse_ssh_config(text)
    if not entries:
        raise LabError("ssh-config lists no Host", hint="run `vagrant up` first, then `vagrant ssh-config`")
    hosts = []
    for name, opts in entries:
        if name not in private_ips:
            raise LabError(f"host {name} has no private-network address "
                           f"(known: {', '.join(private_ips) or 'none'})",
                           hint="add it to MESHDEPLOY_HOSTS in the Vagrantfile or pass --ip NAME=ADDRESS")
        hostname = _first(opts, "hostname") or name
        # The forwarded port exists only on the loopback HostName; the private address has sshd
        # on its own port.
        port = SSH_PORT if hostname.startswith(_LOOPBACK) else int(_first(opts, "port") or SSH_PORT)
        ssh = {"user": _first(opts, "user") or "vagrant", "port": port, "key": _first(opts, "identityfile") or ""}
        hosts.append({"name": name, "address": private_ips[name], "ssh": ssh})
    return hosts


def _first(opts: dict[str, list[str]], key: str) -> str | None:
    values = opts.get(key)
    return values[0] if values else None


def hosts_yaml(hosts: list[dict]) -> str:
    """The `hosts:` block of a cluster file (JSON-quoted scalars are valid YAML)."""
    lines = ["hosts:"]
    for h in hosts:
        ssh = h["ssh"]
        lines += [
            f"  {h['name']}:",
            f"    address: {h['address']}",
            f"    ssh: {{user: {json.dumps(ssh['user'])}, port: {ssh['port']}, "
            f"key: {json.dumps(ssh['key'])}, sudo: true}}",
        ]
    return "\n".join(lines) + "\n"


def _parse_ip_args(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, address = value.partition("=")
        if not sep or not name or not re.fullmatch(r"\d{1,3}(\.\d{1,3}){3}", address):
            raise LabError(f"--ip {value!r}: expected NAME=IPv4, e.g. worker1=192.168.56.11")
        out[name] = address
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m meshdeploy.lab.vagrant",
        description="Print the cluster-file hosts of the running Vagrant lab.")
    parser.add_argument("--ssh-config", type=Path,
                        help="saved `vagrant ssh-config` output ('-' = stdin); default: run vagrant")
    parser.add_argument("--vagrantfile", type=Path, default=Path("Vagrantfile"),
                        help="Vagrantfile with MESHDEPLOY_HOSTS (default: ./Vagrantfile)")
    parser.add_argument("--ip", action="append", default=[], metavar="NAME=IPv4",
                        help="private address of a host (repeatable; replaces MESHDEPLOY_HOSTS)")
    args = parser.parse_args(argv)
    try:
        if args.ssh_config is None:
            text = _run_vagrant_ssh_config(args.vagrantfile)
        elif str(args.ssh_config) == "-":
            text = sys.stdin.read()
        else:
            text = args.ssh_config.read_text()
        ips = _parse_ip_args(args.ip) or None
        hosts = cluster_hosts_from_ssh_config(text, ips, args.vagrantfile)
    except (LabError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        hint = getattr(exc, "hint", None)
        if hint:
            print(f"  hint: {hint}", file=sys.stderr)
        return 1
    sys.stdout.write(hosts_yaml(hosts))
    return 0


def _run_vagrant_ssh_config(vagrantfile: Path) -> str:
    try:
        proc = subprocess.run(["vagrant", "ssh-config"], cwd=vagrantfile.resolve().parent,
                              capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise LabError("vagrant is not installed", hint="apt-get install vagrant") from exc
    if proc.returncode != 0:
        raise LabError(f"vagrant ssh-config failed: {proc.stderr.strip()}",
                       hint="start the machines with `vagrant up` first")
    return proc.stdout


if __name__ == "__main__":
    sys.exit(main())
