"""Plans and apply results as text (Terraform-style) and JSON.

Renderers only read `meshdeploy.core.plan` records; they never decide what changes. Text and
JSON come from the same records, so the JSON carries every fact the text shows (placement,
network, model bytes per host, warnings, per-host counts; docs/plan-json.md). Returned strings
carry no trailing newline: callers print() them.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, fields, is_dataclass, replace
from typing import Any

from tabulate import tabulate

from meshdeploy.core.plan import (
    FORMAT_VERSION,
    AttrDiff,
    Change,
    HostAccess,
    Network,
    Placement,
    PlacementRow,
    Plan,
    TransferRow,
    size_text,
)
from meshdeploy.errors import terminal_text

# Symbols are right-aligned to the width of "-/+" so resource lines line up, as in Terraform.
_SYMBOL = {"create": "  +", "update": "  ~", "delete": "  -", "replace": "-/+"}
_LEGEND = {
    "create": "create",
    "update": "update in-place",
    "delete": "destroy",
    "replace": "destroy and then create replacement",
}
_LEGEND_ORDER = ("create", "update", "delete", "replace")
_VERB = {
    "create": "will be created",
    "update": "will be updated in-place",
    "replace": "must be replaced",
    "delete": "will be destroyed",
}
NO_CHANGES = "No changes. The cluster matches the configuration."
# The confirmation asked before an apply or a destroy changes anything (Terraform's words).
CONFIRM = "\nDo you want to perform these actions? Only 'yes' will be accepted."
PROMPT = "  Enter a value: "


def render_running(verb: str = "Apply") -> str:
    """The line between the plan and the live progress: `Applying:`, `Destroying:`."""
    return f"\n{verb[:-1] if verb.endswith('e') else verb}ing:"


_SENSITIVE = "(sensitive value)"
_KNOWN_AFTER = "(known after apply)"

_GREEN, _YELLOW, _RED, _CYAN, _BOLD, _RESET = (
    "\x1b[32m", "\x1b[33m", "\x1b[31m", "\x1b[36m", "\x1b[1m", "\x1b[0m"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class _Paint:
    def __init__(self, on: bool):
        self.on = on

    def __call__(self, code: str, text: str) -> str:
        return f"{code}{text}{_RESET}" if self.on and text.strip() else text

    def symbol(self, sym: str) -> str:
        if not self.on:
            return sym
        # Colour each character so "-/+" reads red-slash-green, like Terraform.
        colours = {"+": _GREEN, "~": _YELLOW, "-": _RED}
        return "".join(self(colours[ch], ch) if ch in colours else ch for ch in sym)


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _literal(value: Any) -> str:
    """A value as Terraform prints it: quoted strings, bare numbers, true/false/null."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{terminal_text(str(k))} = {_literal(v)}"
                                for k, v in value.items()) + " }"
    # json.dumps escapes C0 controls (\u001b), not C1 ones (U+0080 to U+009F): terminal_text does.
    return terminal_text(json.dumps(str(value), ensure_ascii=False))


def _attr_line(d: AttrDiff, action: str, width: int, paint: _Paint) -> str:
    def shown(v: Any) -> str:
        return _SENSITIVE if d.sensitive else _literal(v)

    if action == "delete" or (d.after is None and d.before is not None and not d.known_after_apply):
        sym, value = "-", f"{shown(d.before)} -> null"
    elif action == "create" or d.before is None:
        sym, value = "+", _KNOWN_AFTER if d.known_after_apply else shown(d.after)
    elif d.known_after_apply:
        sym, value = "~", f"{shown(d.before)} -> {_KNOWN_AFTER}"
    elif d.sensitive:
        sym, value = "~", _SENSITIVE  # Terraform does not hint at which way a secret moved
    else:
        sym, value = "~", f"{shown(d.before)} -> {shown(d.after)}"
    line = f"      {paint.symbol(sym)} {d.name.ljust(width)} = {value}"
    if d.forces_replacement:
        line += paint(_RED, " # forces replacement")
    return line


def _unit_diff_lines(change: Change, paint: _Paint) -> list[str]:
    sym = {"create": "+", "delete": "-"}.get(change.action, "~")
    out = [f"      {paint.symbol(sym)} unit_file = <<-EOT"]
    for raw in change.unit_diff.splitlines():
        if raw.startswith(("+++", "---")):
            text = paint(_BOLD, raw)
        elif raw.startswith("+"):
            text = paint(_GREEN, raw)
        elif raw.startswith("-"):
            text = paint(_RED, raw)
        elif raw.startswith("@@"):
            text = paint(_CYAN, raw)
        else:
            text = raw
        out.append(f"          {text}".rstrip())
    out.append("        EOT")
    return out


def _change_block(change: Change, paint: _Paint) -> list[str]:
    lines = [paint(_BOLD, f"  # {change.address} {_VERB[change.action]}")]
    if change.reason:
        lines.append(f"  # ({change.reason})")
    sym = paint.symbol(_SYMBOL[change.action])
    lines.append(f'{sym} resource "{change.role}.{change.resource}" {{')
    # Updates hide attributes that do not move; creates and deletes show everything they touch.
    hide = change.action in ("update", "replace")
    shown = [d for d in change.diffs if not (hide and d.unchanged)]
    width = max((len(d.name) for d in shown), default=0)
    lines += [_attr_line(d, change.action, width, paint) for d in shown]
    if change.unit_diff:
        lines += _unit_diff_lines(change, paint)
    hidden = len(change.diffs) - len(shown)
    if hidden:
        noun = "attribute" if hidden == 1 else "attributes"
        lines.append(f"        # ({hidden} unchanged {noun} hidden)")
    lines.append("    }")
    return lines


def _table(rows: list[dict], headers: list[str], numbers: bool = False) -> str:
    body = [[r.get(h, "") for h in headers] for r in rows]
    # Only count columns are numbers: a host or detail such as "1e5" must stay as written.
    keep = [i for i in range(len(headers)) if not (numbers and i > 0)]
    text = tabulate(body, headers=headers, tablefmt="simple", disable_numparse=keep)
    return "\n".join(line.rstrip() for line in text.splitlines())


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / 1e9:.2f}"


def _layers(r: PlacementRow) -> str:
    if r.first_layer is None:
        text = "-"
    elif r.first_layer == r.last_layer:
        text = str(r.first_layer)
    else:
        text = f"{r.first_layer}-{r.last_layer}"
    return text + (" + output" if r.output else "")


_PLACEMENT_HEADERS = ["device", "layers", "weights GB", "KV GB", "seeded GB", "wire MB/load",
                      "free GB", "headroom GB"]


def render_placement(placements: list[Placement]) -> str:
    """The placement section of the text plan: one table per llama-server."""
    blocks = []
    for p in placements:
        rows = [[r.device, _layers(r), _gb(r.weights_bytes), _gb(r.kv_bytes),
                 "-" if r.seeded_bytes is None else _gb(r.seeded_bytes),
                 f"{r.wire_bytes / 1e6:.1f}",
                 ("~" if r.free_estimated else "") + _gb(r.free_bytes), _gb(r.headroom_bytes)]
                for r in p.rows]
        headers = list(_PLACEMENT_HEADERS)
        if p.speed is not None and len(p.speed.gen_ms_per_gb) == len(rows):
            headers.append("gen ms/GB")
            for row, ms in zip(rows, p.speed.gen_ms_per_gb):
                row.append(f"{ms:.1f}")
        body = tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)
        text = "\n".join(line.rstrip() for line in body.splitlines())
        tokens = f"{p.ctx_tokens} tokens" if p.ctx_fitted_from is None else \
            f"~{p.ctx_tokens} tokens as llama.cpp fits ctx_size 0"
        how = _SPLIT_BY.get(p.split_by, "as llama.cpp splits it")
        blocks.append(f"Placement of {p.model} for llama-server {p.server} ({how}; KV at "
                      f"{tokens}, {p.slots} slots, {p.cache_type_k}/{p.cache_type_v}):\n{text}"
                      + _speed_line(p) + _failover_lines(p))
    return "\n\n".join(blocks)


def _failover_lines(p: Placement) -> str:
    """Workers left off --rpc, and what md-failover starts while workers are away."""
    out = []
    if p.idle:
        out.append(f"Left off --rpc (no layers): {', '.join(p.idle)}")
    if p.tolerate:
        noun = "worker host" if p.tolerate == 1 else "worker hosts"
        out.append(f"Failover (up to {p.tolerate} {noun} away; md-failover switches "
                   "by itself):")
        for f in p.failover:
            head = f"  without {' and '.join(f.lost)}: "
            if f.placement is None:
                out.append(head + f"the server is down while {' and '.join(f.lost)} "
                           f"{'is' if len(f.lost) == 1 else 'are'} away ({f.refusal})")
                continue
            speed = "" if f.gen_tps is None else f"; ~{f.gen_tps:.2f} tok/s predicted"
            out.append(head + (f.placement or "every layer on the orchestrator") + speed)
        if p.failover_seed_bytes:
            out.append("  cached for them beforehand: " + ", ".join(
                f"{k} +{_gb(n)} GB" for k, n in p.failover_seed_bytes.items())
                + " (servers." + p.server + ".failover.seed: false ships them at the switch "
                "instead)")
    return "".join("\n" + line for line in out)


_SPLIT_BY = {"memory": "as llama.cpp splits it", "tensor_split": "as tensor_split sets it",
             "speed": "split for speed by placement: auto"}


def _speed_line(p: Placement) -> str:
    """The predicted tokens/s under the table, when device speeds are measured."""
    s = p.speed
    if s is None:
        return ""
    line = f"\nPredicted: ~{s.gen_tps:.2f} tok/s generation"
    if s.prompt_tps is not None:
        line += f", ~{s.prompt_tps:.2f} tok/s prompt"
    if p.split_by != "memory" and s.memory_gen_tps is not None:
        line += f" (split by memory: ~{s.memory_gen_tps:.2f} tok/s generation)"
    return line + f"; device speeds measured {s.measured_at or '(unknown time)'} by bench --sweep"


def render_network(network: list[Network]) -> list[str]:
    """One line per llama-server: RTT to each endpoint and what it adds to every token."""
    lines = []
    for n in network:
        parts = ", ".join([f"{e.endpoint} {e.rtt_ms:.2f} ms" for e in n.endpoints]
                          + [f"{e} unreachable now" for e in n.unreachable])
        lines.append(f"Network ({n.server} on {n.host}): RTT {parts}; expected per-token cost = "
                     f"compute + {n.round_trips} x RTT (~{n.per_token_ms:.2f} ms)"
                     + (f", not counting {len(n.unreachable)} unreachable" if n.unreachable
                        else ""))
    return lines


_TRANSFER_HEADERS = ["host", "from internet", "over LAN", "disk needed", "disk free"]


def render_transfers(transfers: list[TransferRow]) -> str:
    """The model bytes apply brings to each host, and a total: "-" for none, "?" for free disk
    space not known."""
    def cells(host: str, internet: int, lan: int, disk: int, free: str) -> dict:
        sizes = [size_text(n) if n else "-" for n in (internet, lan, disk)]
        return dict(zip(_TRANSFER_HEADERS, [host, *sizes, free]))

    rows = [cells(t.host, t.internet_bytes, t.lan_bytes, t.disk_bytes,
                  "?" if t.disk_free is None else size_text(t.disk_free)) for t in transfers]
    rows.append(cells("total", sum(t.internet_bytes for t in transfers),
                      sum(t.lan_bytes for t in transfers), sum(t.disk_bytes for t in transfers),
                      ""))
    return "Model bytes per host:\n" + _table(rows, _TRANSFER_HEADERS)


_ACCESS_HEADERS = ["host", "access", "service manager", "rpc ports guarded by"]


def render_access(rows: list[HostAccess]) -> str:
    """Per host: root or the login user, its service manager, what guards its RPC ports."""
    return "Hosts:\n" + _table([dict(zip(_ACCESS_HEADERS, (r.host, r.access, r.manager,
                                                          r.protection))) for r in rows],
                                _ACCESS_HEADERS)


def local_host_note(host: str) -> str:
    return (f"{host} is this machine (connection: local): its commands run here, not over "
            "SSH, so no host-key policy applies to it.")


def inert(value):
    """`value` with every string in it passed through terminal_text: a plan carries what hosts
    said (a build's name under `current`, a unit file they hold, device names), and the only
    control sequences its text may hold are the view's own colours."""
    if isinstance(value, str):
        return terminal_text(value)
    if isinstance(value, AttrDiff):  # its values are shown by _literal, which quotes them
        return replace(value, name=terminal_text(value.name))
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: inert(getattr(value, f.name))
                                 for f in fields(value) if f.init})
    if isinstance(value, list):
        return [inert(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(inert(v) for v in value)
    if isinstance(value, dict):
        return {inert(k): inert(v) for k, v in value.items()}
    return value


def render_text(plan: Plan, color: bool = False) -> str:
    plan = inert(plan)
    paint = _Paint(color)
    visible = [c for c in plan.changes if c.action != "no-op"]
    out: list[str] = []
    if visible:
        present = {c.action for c in visible}
        out.append("Resource actions are indicated with the following symbols:")
        out += [f"{paint.symbol(_SYMBOL[a])} {_LEGEND[a]}" for a in _LEGEND_ORDER if a in present]
        out += ["", "meshdeploy will perform the following actions:"]
        for host in plan.all_hosts():
            for change in (c for c in visible if c.host == host):
                out.append("")
                out += _change_block(change, paint)
        out.append("")
    rows = plan.host_counts()
    if rows:
        headers = ["host", "add", "change", "destroy", "unchanged"]
        out += [_table(rows, headers, numbers=True), ""]
    if plan.placement:
        out += [render_placement(plan.placement), ""]
    if plan.network:
        out += render_network(plan.network) + [""]
    if plan.transfers:
        out += [render_transfers(plan.transfers), ""]
    if plan.access:
        out += [render_access(plan.access), ""]
    for w in plan.warnings:
        first, *rest = w.splitlines() or [""]
        out.append(f"{paint(_YELLOW, 'Warning:')} {first}".rstrip())
        out += [f"  {line}".rstrip() for line in rest]
        out.append("")
    if plan.local_host:
        out += [local_host_note(plan.local_host), ""]
    if plan.kept:
        out.append("Kept on the hosts that leave (their bytes are expensive to fetch or build "
                   "again; --purge removes them):")
        out += [f"  {line}" for line in plan.kept] + [""]
    if plan.has_changes():
        n = plan.counts()
        summary = f"Plan: {n['add']} to add, {n['change']} to change, {n['destroy']} to destroy."
    else:
        summary = NO_CHANGES
    out.append(paint(_BOLD, summary))
    return "\n".join(out)


def _diff_json(d: AttrDiff) -> dict:
    out = {
        "name": d.name,
        "before": d.before,
        "after": d.after,
        "forces_replacement": d.forces_replacement,
        "known_after_apply": d.known_after_apply,
        "sensitive": d.sensitive,
    }
    if d.sensitive:
        # JSON output ends up in CI logs; the saved plan file (0600) keeps the real values.
        out["before"] = out["after"] = None
    if d.known_after_apply:
        out["after"] = None
    return out


def render_json(plan: Plan) -> str:
    doc = {
        "format_version": FORMAT_VERSION,
        "cluster_name": plan.cluster_name,
        "cluster_path": plan.cluster_path,
        "config_hash": plan.config_hash,
        "created_at": plan.created_at,
        "meshdeploy_version": plan.meshdeploy_version,
        "hosts": plan.all_hosts(),
        "fingerprints": plan.fingerprints,
        "has_changes": plan.has_changes(),
        "counts": plan.counts(),
        "host_counts": plan.host_counts(),
        "warnings": list(plan.warnings),
        "placement": [asdict(p) for p in plan.placement],
        "network": [asdict(n) for n in plan.network],
        "transfers": [asdict(t) for t in plan.transfers],
        "access": [asdict(a) for a in plan.access],
        "commit": plan.commit,
        "commit_source": plan.commit_source,
        "limit": list(plan.limit),
        "target": list(plan.target),
        "remote_commands": dict(plan.remote_commands),
        "seconds": plan.seconds,
        "kept": list(plan.kept),
        "purge": plan.purge,
        "local_host": plan.local_host,
        "changes": [
            {
                "address": c.address,
                "host": c.host,
                "role": c.role,
                "resource": c.resource,
                "action": c.action,
                "reason": c.reason,
                "diffs": [_diff_json(d) for d in c.diffs],
                "unit_diff": c.unit_diff,
            }
            for c in plan.changes
        ],
    }
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False)


_APPLY_HEADERS = ["host", "step", "status", "detail"]


def render_apply_summary(rows: list[dict]) -> str:
    """Per-host results at the end of apply: host | step | status | detail."""
    if not rows:
        return "Apply complete: nothing was run."
    for i, r in enumerate(rows):
        unknown = sorted(set(r) - set(_APPLY_HEADERS))
        if unknown:
            raise ValueError(f"apply summary row {i}: unknown key {unknown[0]!r}")
    return _table([{k: "" if r.get(k) is None else terminal_text(str(r.get(k)))
                    for k in _APPLY_HEADERS} for r in rows], _APPLY_HEADERS)


def render_saved(path: str) -> str:
    """`plan -out FILE` in text, after the plan."""
    return f"\nSaved the plan to {path}. Apply exactly it with: meshdeploy apply {path}"


def render_done(rows: list[dict], seconds: float, what: str = "Apply") -> str:
    """The end of an apply or a destroy in text: what ran on each host and how long it took."""
    return f"\n{render_apply_summary(rows)}\n\n{what} complete in {seconds:.1f} s."


def render_apply_json(plan: Plan, rows: list[dict], seconds: float) -> str:
    """`apply --json`: the plan applied (render_json's document) and what ran, once at the end;
    no live progress is ever part of it."""
    doc = {"format_version": FORMAT_VERSION, "plan": json.loads(render_json(plan)),
           "applied": [{k: r.get(k) for k in _APPLY_HEADERS} for r in rows],
           "seconds": round(seconds, 3)}
    return json.dumps(doc, sort_keys=True, indent=2, ensure_ascii=False)
