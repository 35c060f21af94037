"""The multi-host lab: real systemd hosts in network namespaces, for trying and testing."""

from meshdeploy.lab.core import Lab, LabHost, LabInfo
from meshdeploy.lab.errors import LabError

__all__ = ["Lab", "LabHost", "LabInfo", "LabError"]
