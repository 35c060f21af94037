"""One no-op plan, timed in-process, with whatever meshdeploy is importable (PYTHONPATH picks
the checkout): prints {"seconds", "commands", "changed"} as JSON. plan_speed.py runs it for the
current tree and for a baseline checkout, alternately, against the same converged lab.

    python benchmarks/plan_once.py CLUSTER_FILE
"""

from gevent import monkey

monkey.patch_all()

import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402


def main(path: str) -> int:
    from meshdeploy.core.loading import load_cluster
    from meshdeploy.engine import planner as engine

    try:
        from meshdeploy.remote.session import Session
    except ImportError:  # checkouts from before remote/session.py
        Session = engine.Session
    started = time.monotonic()
    session = Session(load_cluster(Path(path)))
    session.open()
    session.connect()
    try:
        planned = engine.make_plan(session)
    finally:
        session.close()
    print(json.dumps({"seconds": time.monotonic() - started,
                      "commands": dict(session.commands_run),
                      "changed": planned.plan.has_changes()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
