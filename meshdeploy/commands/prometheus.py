"""meshdeploy prometheus: the Prometheus configuration that watches the cluster, written into a
folder (prometheus.yml, blackbox.yml, meshdeploy.rules.yml), from the cluster file alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from meshdeploy import errors
from meshdeploy.commands import options
from meshdeploy.core.loading import load_cluster
from meshdeploy.core.files import write_atomic
from meshdeploy.roles.monitoring import defaults as d
from meshdeploy.roles.monitoring import prometheus
from meshdeploy.views import prometheus as view

NAME = "prometheus"
HELP = "write a Prometheus configuration that scrapes the cluster"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", metavar="FILE")
    p.add_argument("--out", metavar="DIR",
                   help="the folder to write into (default: <cluster-file-stem>.prometheus "
                        "beside the cluster file)")
    # At least 3 s: a probe's scrape must leave the blackbox exporter its whole connect timeout
    # (2 s, and half a second it keeps), or a dropped SYN could not be told from a refusal.
    p.add_argument("--interval", type=options.whole_seconds(3, 3600),
                   default=d.monitoring_scrape_interval,
                   metavar="SECONDS", help="scrape and rule interval (default: %(default)s)")
    p.add_argument("--blackbox", default=d.monitoring_blackbox_address, metavar="HOST:PORT",
                   help="where Prometheus reaches the blackbox exporter (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="what was written, as JSON")


@dataclass(frozen=True)
class Args(options.Arguments):
    file: str
    out: str | None
    interval: int
    blackbox: str
    json: bool


def run(args: Args) -> int:
    cluster = load_cluster(args.file)
    out = Path(args.out) if args.out else cluster.path.with_name(f"{cluster.path.stem}.prometheus")
    written = write(out, prometheus.documents(cluster, args.interval, args.blackbox))
    print(view.render_json(cluster, out, written) if args.json else
          view.render_text(cluster, out, written))
    return errors.OK


def write(out: Path, documents: dict[str, str]) -> list[Path]:
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, text in documents.items():
            write_atomic(out / name, text, 0o644)
    except OSError as exc:
        raise errors.MeshdeployError(f"cannot write the Prometheus files into {out}: "
                                     f"{exc.strerror or exc}",
                                     "give --out a folder you may write") from None
    return [out / name for name in documents]
