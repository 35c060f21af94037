"""`meshdeploy prometheus`'s answer: the files written, the targets, the API keys Prometheus needs
beside them, and the services it cannot reach (text and JSON, from the same data)."""

from __future__ import annotations

import json
from pathlib import Path

from meshdeploy.core import shell
from meshdeploy.roles.monitoring import prometheus


def summary(cluster, out: Path, written: list[Path]) -> dict:
    return {
        "format_version": 1,
        "out": str(out),
        "files": [str(p) for p in written],
        "targets": [{"kind": t.kind, "host": t.host, "address": t.address, **t.labels}
                    for t in prometheus.targets(cluster)],
        "key_files": [{"server": k.server, "host": k.host, "source": k.source,
                       "path": str(out / k.path)} for k in prometheus.key_files(cluster)],
        "skipped": prometheus.skipped(cluster),
        "scrapers": prometheus.scrapers(cluster),
    }


def render_json(cluster, out: Path, written: list[Path]) -> str:
    return json.dumps(summary(cluster, out, written), indent=2)


def render_text(cluster, out: Path, written: list[Path]) -> str:
    s = summary(cluster, out, written)
    counts: dict[str, int] = {}
    for t in s["targets"]:
        counts[t["kind"]] = counts.get(t["kind"], 0) + 1
    lines = [f"Wrote {', '.join(str(p) for p in written)}",
             "Targets: " + (", ".join(f"{n} {kind}{'' if n == 1 else 's'}"
                                      for kind, n in counts.items()) or "none")]
    for k in s["key_files"]:
        lines.append(f"API key of llama-server {k['server']}: copy "
                     f"{k['host']}:{shell.quote(k['source'])} to {shell.quote(k['path'])}, "
                     "readable by the user Prometheus runs as only")
    lines += [f"Not scraped: {note}" for note in s["skipped"]]
    if not s["scrapers"]:
        lines.append(prometheus.NO_SCRAPERS)
    config = shell.quote(str(out / "prometheus.yml"))
    lines.append(f"Run: prometheus --config.file={config}; prometheus-blackbox-exporter "
                 f"--config.file={shell.quote(str(out / 'blackbox.yml'))}")
    return "\n".join(lines)
