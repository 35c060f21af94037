"""What every command's arguments build on: the Args base and the options several commands share,
declared once (each command's own are in its module)."""

from __future__ import annotations

import argparse
import dataclasses

from meshdeploy.views import completion


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The base of each command's `Args`: a frozen dataclass whose fields are its parser's
    destinations (all but --verbose and --debug, which the command line keeps), built once."""

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace):
        given = vars(ns)
        return cls(**{f.name: given[f.name] for f in dataclasses.fields(cls)})


def host_list(value: str) -> list[str]:
    hosts = [h.strip() for h in value.split(",") if h.strip()]
    if not hosts:
        raise argparse.ArgumentTypeError("expected HOST[,HOST...]")
    return hosts


def limit(p: argparse.ArgumentParser, what: str = "only these hosts") -> None:
    p.add_argument("--limit", type=host_list, metavar="HOST,...",
                   help=what).completer = completion.complete_hosts


def connect_timeout(value: str) -> float:
    """An argparse type: --connect-timeout's seconds (above 0, at most a day)."""
    from meshdeploy.remote.ssh_settings import parse_seconds

    seconds = parse_seconds(value)
    if seconds is None:
        raise argparse.ArgumentTypeError(f"expected seconds above 0, got {value!r}")
    return seconds


def auto_approve(p: argparse.ArgumentParser) -> None:
    p.add_argument("-auto-approve", "--auto-approve", dest="auto_approve", action="store_true",
                   help="do not ask for confirmation")


def host_keys(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept-new-host-keys", action="store_true",
                   help="record the key of a host not yet in known_hosts (first contact); "
                        "a changed key is still refused")


def lock_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument("-lock-timeout", "--lock-timeout", dest="lock_timeout", metavar="DURATION",
                   help="wait this long for another apply or destroy to release the "
                        "cluster's lock (30s, 5m; default 0: fail at once, naming it)")


def purge(p: argparse.ArgumentParser, who: str) -> None:
    p.add_argument("--purge", action="store_true",
                   help=f"also remove the llama.cpp builds, models and rpc-server caches of "
                        f"{who} (kept otherwise: their bytes are expensive); the toolchain's "
                        "packages always stay")


def target(p: argparse.ArgumentParser) -> None:
    p.add_argument("-target", "--target", action="append", metavar="ADDRESS",
                   help="plan and apply only this resource and what it needs (repeatable; "
                        "Terraform's spelling, for exceptional runs: -target=network.allowlist, "
                        "-target=node2/models.gguf[gemma]); the rest is left as it is"
                   ).completer = completion.complete_addresses


def replace(p: argparse.ArgumentParser) -> None:
    p.add_argument("-replace", "--replace", action="append", metavar="ADDRESS",
                   help="replace this resource even if it matches (repeatable; Terraform's "
                        "spelling: -replace=network.wireguard rotates every host's WireGuard "
                        "keys, -replace=node2/network.wireguard one host's)"
                   ).completer = completion.complete_addresses


def whole_seconds(low: int, high: int):
    """An argparse type: whole seconds from `low` to `high` (status --window, prometheus
    --interval)."""
    def parse(value: str) -> int:
        try:
            seconds = int(value)
        except ValueError:
            seconds = low - 1
        if not low <= seconds <= high:
            raise argparse.ArgumentTypeError(
                f"expected whole seconds from {low} to {high}, got {value!r}")
        return seconds
    return parse
