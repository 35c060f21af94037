"""`-target=ADDRESS`: plan and apply only some resources, and what they need.

As Terraform's `-target`, for exceptional runs (bring up the allow-list and the toolchain of
hosts whose build would take hours, repair one resource): an address names a resource
(`network.allowlist`, `models.gguf[gemma]`) on every host or on one (`node2/network.allowlist`).
A targeted resource brings what it needs (registry.Resource.needs): the resources it declares,
on its host (for a cluster-wide one, those and itself on every host), or, where it declares
none, every resource before it and itself on every host. What is left out is neither planned
nor applied; the plan says so.
"""

from __future__ import annotations

from meshdeploy.core import registry
from meshdeploy.errors import PlanError

HINT = ("write RESOURCE or HOST/RESOURCE as a plan prints it, e.g. -target=network.allowlist "
        "or -target=node2/models.gguf[gemma]")


def _matches(name: str, slot: registry.Slot) -> bool:
    return name in (slot.name, slot.resource.qualified)


def check(cluster, addresses, hosts=None) -> tuple[str, ...]:
    """Each address names a resource of this file's slots and, when given, a host of the run
    (`hosts`: the file's, or those --limit leaves): one PlanError naming the first that does
    not."""
    hosts = {h.name for h in (cluster.hosts if hosts is None else hosts)}
    slots = registry.slots(cluster, apply=True)
    for address in addresses:
        host, _, name = address.rpartition("/")
        if (host and host not in hosts) or not any(_matches(name, s) for s in slots):
            raise PlanError(f"-target={address}: no such resource address", hint=HINT)
    return tuple(addresses)


def closure(cluster, hosts, addresses) -> frozenset[tuple[str, str]] | None:
    """The (host, slot name) pairs a run with these -target addresses plans and applies; None
    when there are none (everything)."""
    if not addresses:
        return None
    names = [h.name for h in hosts]
    slots = registry.slots(cluster, apply=True)
    order = {s.name: i for i, s in enumerate(slots)}
    wanted: set[tuple[str, str]] = set()
    for address in addresses:
        host, _, name = address.rpartition("/")
        wanted |= {(h, s.name) for s in slots if _matches(name, s)
                   for h in ([host] if host else names) if h in names}
    todo = list(wanted)
    while todo:
        host, slot_name = todo.pop()
        slot = next(s for s in slots if s.name == slot_name)
        needs = slot.resource.needs
        if needs is None:
            # Every earlier slot, and this one, on every host: an instance may use what the same
            # instance does elsewhere (a copier's models.gguf[M] fetches from the host whose
            # models.gguf[M] fetches M and serves it; llama_cpp.copy from its builder's).
            more = {(h, s.name) for s in slots if order[s.name] <= order[slot_name]
                    for h in names}
        elif slot.resource.cluster_wide:
            # Its plan reads every host's (a tunnel's peers): what it needs, and itself, on
            # every host; one end of a tunnel alone would name a key its peers do not know.
            more = {(h, s.name) for s in slots
                    if s.resource.qualified in needs or s.name == slot_name for h in names}
        else:
            more = {(host, s.name) for s in slots if s.resource.qualified in needs}
        for pair in more - wanted:
            wanted.add(pair)
            todo.append(pair)
    return frozenset(wanted)


def warning(addresses, planned: int, left_out: int) -> str:
    return (f"-target={','.join(addresses)}: {planned} of {planned + left_out} resource instances "
            f"planned (those and what they need); {left_out} left out, and no host's destroy. "
            "This plan is not the whole cluster: run plan without -target afterwards")
