"""The lab's error type, part of the product's error tree."""

from meshdeploy.errors import MeshdeployError

INSTALL_HINT = (
    "install debootstrap systemd-container tinyproxy socat netcat-openbsd iproute2 git "
    "openssh-client"
)


class LabError(MeshdeployError):
    """Something the lab cannot do; the message says what to do next."""

    exit_code = 1


def check_hosts(chosen, host_names, what: str) -> None:
    """Refuse `chosen` (host -> value, from `--kind` or `--suite`) naming a host the lab lacks;
    `what` says which setting ("host kinds", "host releases")."""
    unknown = sorted(set(chosen) - set(host_names))
    if unknown:
        raise LabError(f"{what} name {', '.join(unknown)}, not a host of this lab "
                       f"(hosts: {', '.join(host_names)})")


def per_host(chosen, host_names, what: str, check, default: str) -> dict[str, str]:
    """Every host's value (`default` unless `chosen`, host -> value, names it), checked: hosts of
    the lab only (`what` names the setting: "host releases") and values `check` accepts (it
    raises LabError, reported with the host's name)."""
    chosen = dict(chosen or {})
    check_hosts(chosen, host_names, what)
    for host, value in sorted(chosen.items()):
        try:
            check(value)
        except LabError as exc:
            raise LabError(f"{host}: {exc}") from None
    return {h: chosen.get(h, default) for h in host_names}
