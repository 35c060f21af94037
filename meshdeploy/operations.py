"""Every resource as a pyinfra operation, for a pyinfra deploy of your own.

    from meshdeploy.operations import services, toolchain

    toolchain.packages(cluster="cluster.yaml")
    services.rpc_server(50052, cluster="cluster.yaml")

Each name is a role (meshdeploy/roles/<name>/); its attributes are that role's resources, made
pyinfra operations by meshdeploy.execute.operations: the same plan code `meshdeploy apply` runs,
on pyinfra's terms (docs/examples/deploy.py). The roles themselves stay below the executor, so
the operations are made here, on first use, not in the roles' packages.
"""

from __future__ import annotations

from types import SimpleNamespace

from meshdeploy.core import registry
from meshdeploy.execute.operations import operation_for


def __getattr__(name: str) -> SimpleNamespace:
    try:
        role = registry.role(name)
    except KeyError:
        raise AttributeError(f"meshdeploy.operations has no role {name!r}") from None
    return SimpleNamespace(**{r.name: operation_for(r) for r in role.resources})


def __dir__() -> list[str]:
    return [role.name for role in registry.roles()]
