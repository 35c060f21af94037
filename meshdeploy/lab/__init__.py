"""The multi-host lab: real systemd hosts in network namespaces, for trying and testing."""

from meshdeploy.lab.core import Lab
from meshdeploy.lab.errors import LabError
from meshdeploy.lab.labinfo import LabHost, LabInfo

__all__ = ["Lab", "LabHost", "LabInfo", "LabError"]
