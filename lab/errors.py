"""The lab's error type, part of the product's error tree when the engine provides one."""

try:
    from meshdeploy.deploy.errors import MeshdeployError as _Base
except ImportError:  # the engine's error module is optional for the lab
    _Base = Exception


INSTALL_HINT = (
    "install debootstrap systemd-container tinyproxy socat netcat-openbsd iproute2 git "
    "openssh-client"
)


class LabError(_Base):
    """Something the lab cannot do; the message says what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message
