"""`meshdeploy lab up|down|status`: the multi-host lab from the command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from meshdeploy.lab import arches, base, kinds
from meshdeploy.lab.core import DEFAULT_NAME, Lab
from meshdeploy.lab.errors import LabError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshdeploy lab",
        description="Real hosts for trying meshdeploy: systemd-nspawn containers on a private "
        "bridge, with an apt proxy and llama.cpp/model mirrors.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--name", default=DEFAULT_NAME, help="lab name (default: %(default)s)")
    common.add_argument("--state-dir", help="default: /var/lib/meshdeploy/lab/NAME")
    up = sub.add_parser("up", parents=[common], help="start (or complete) the lab")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts (default: 3)")
    up.add_argument("--rogue", type=int, default=0, metavar="N",
                    help="N more hosts after them on the same bridge, for no cluster file "
                    "(default: 0)")
    up.add_argument("--no-mirrors", action="store_true",
                    help="skip the git and Hugging Face mirrors (apt proxy only)")
    up.add_argument("--toolchain", action="store_true",
                    help="hosts start with cmake, g++, git, curl, ninja and ccache installed, "
                    "like prepared build machines (default: meshdeploy installs them)")
    up.add_argument("--kind", action="append", default=[], metavar="HOST=KIND",
                    help="make HOST a host of KIND, one of " + ", ".join(kinds.KINDS) +
                    f" (default: {kinds.ROOT}); repeatable; kinds other than {kinds.ROOT} "
                    "need --toolchain")
    up.add_argument("--suite", action="append", default=[], metavar="HOST=RELEASE",
                    help="boot HOST from Debian RELEASE, one of " + ", ".join(base.SUITES) +
                    f" (default: {base.SUITE}); repeatable")
    up.add_argument("--arch", action="append", default=[], metavar="HOST=ARCH",
                    help="boot HOST from Debian for ARCH, one of " + ", ".join(arches.ARCHES) +
                    f" (default: {arches.NATIVE}; others run under qemu-user, which "
                    "qemu-user-static brings); repeatable")
    sub.add_parser("down", parents=[common],
                   help="stop the lab and remove its hosts, networks and processes (its key "
                        "pairs and ssh_config stay for the next lab of that name)")
    st = sub.add_parser("status", parents=[common], help="show the lab's hosts")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lab = None
    try:
        if args.command == "up":
            lab = Lab(args.name, hosts=args.hosts, state_dir=args.state_dir,
                      mirrors=not args.no_mirrors, log=_err, rogue=args.rogue,
                      toolchain=args.toolchain, kinds=kinds.parse(args.kind),
                      suites=kinds.parse(args.suite, "--suite", "bullseye"),
                      arches=kinds.parse(args.arch, "--arch", "arm64"))
            started = time.monotonic()
            info = lab.up()
            print(f"lab {info.name}: {len(info.hosts)} hosts up in "
                  f"{time.monotonic() - started:.1f} s")
            if info.rogue:
                print(f"  rogue (in no cluster file): {', '.join(info.rogue)}")
            for h in info.hosts:
                if h.kind != kinds.ROOT:
                    print(f"  {h.name}: {h.kind} (user {h.user}, port {h.port}, no sudo)")
                if h.suite != base.SUITE:
                    print(f"  {h.name}: Debian {base.SUITES[h.suite]} ({h.suite})")
                if h.arch != arches.NATIVE:
                    print(f"  {h.name}: {h.arch} (under qemu-user)")
            print(f"  ssh -F {info.ssh['config']} node1")
            print(f"  description: {info.state_dir}/lab.json")
            return 0
        lab = Lab(args.name, state_dir=args.state_dir, log=_err)
        if args.command == "down":
            took = lab.down()
            print(f"lab {args.name}: down in {took:.1f} s")
            return 0
        rows = lab.status()
        if args.json:
            print(json.dumps(rows, indent=2))
        elif not rows:
            print(f"lab {args.name}: no hosts")
        else:
            print(_table(rows))
        return 0
    except LabError as exc:
        _err(f"error: {exc}")
        started = args.command == "up" and lab is not None and lab.touched
        hint = exc.hint or (f"run `meshdeploy lab down --name {args.name}` to remove what was "
                            "started" if started else None)
        if hint:
            _err(f"  hint: {hint}")
        return exc.exit_code
    except KeyboardInterrupt:
        _err("interrupted: run `meshdeploy lab down` to remove what was started")
        return 130


def _table(rows: list[dict]) -> str:
    from tabulate import tabulate

    return tabulate(
        [[r["host"], r["address"], r["netns"], "yes" if r["running"] else "no",
          "yes" if r["ssh"] else "no", r["processes"], r["pss_mib"]] for r in rows],
        headers=["HOST", "ADDRESS", "NETNS", "RUNNING", "SSH", "PROCS", "PSS MiB"],
    )


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
