"""The lab's error type, part of the product's error tree."""

from meshdeploy.errors import MeshdeployError

INSTALL_HINT = (
    "install debootstrap systemd-container tinyproxy socat netcat-openbsd iproute2 git "
    "openssh-client"
)


class LabError(MeshdeployError):
    """Something the lab cannot do; the message says what to do next."""

    exit_code = 1
