"""Taking over a stale host lock is atomic: of several runs that find the same stale lock and
take it over at once, exactly one holds the lock afterwards (security review, issue 20: before,
two runs could both print "acquired"). The host-lock scripts run in a real sh against a temporary
folder, as in tests/unit/test_state_destroy.py, many at the same moment."""

from __future__ import annotations

import subprocess
import sys

import pytest

from meshdeploy.engine import locks

TRIALS = 60
RACERS = 6


def _sh(script: str) -> list[str]:
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)


def _stale_lock(lock: str) -> str:
    """A lock whose holder is a dead process of this machine; its owner line, as a run reads it."""
    gone = locks.Holder(_dead_pid(), locks.me("x").machine, "ann", "2026-01-01T00:00:00Z",
                        "apply", "deadbeef")
    _sh(locks.acquire_script(gone, lock=lock))
    answer = locks.parse_answer(_sh(locks.acquire_script(locks.me("apply"), lock=lock)))
    assert not answer.acquired and answer.stale()
    return answer.owner


def _race(lock: str, take: str) -> list[tuple[locks.Holder, locks.Answer | None, str]]:
    """RACERS runs, started together, each taking the stale lock `take` over."""
    runs = []
    for _ in range(RACERS):
        holder = locks.me("apply")
        runs.append((holder, subprocess.Popen(
            ["sh", "-c", locks.acquire_script(holder, take, lock=lock)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    out = []
    for holder, proc in runs:
        stdout, stderr = proc.communicate(timeout=30)
        out.append((holder, locks.parse_answer(stdout.splitlines()), stderr))
    return out


def test_racing_take_overs_of_one_stale_lock_have_exactly_one_winner(tmp_path):
    for trial in range(TRIALS):
        lock = tmp_path / str(trial) / "apply.lock"
        results = _race(str(lock), _stale_lock(str(lock)))
        winners = [holder for holder, answer, _ in results if answer and answer.acquired]
        said = [(answer, stderr) for _, answer, stderr in results]
        assert len(winners) == 1, f"trial {trial}: {len(winners)} winners: {said}"
        # Every loser got an answer (no half-removed lock, no garbled heartbeat age) ...
        assert all(answer is not None and stderr == "" for answer, stderr in said), said
        # ... and the lock on disk is the winner's, whole, with nothing left beside it.
        assert locks.Holder.parse((lock / "owner").read_text()) == winners[0]
        assert sorted(p.name for p in lock.iterdir()) == ["owner"]
        assert sorted(p.name for p in lock.parent.iterdir()) == ["apply.lock"]


def test_a_take_over_that_lost_the_race_leaves_the_new_lock_alone(tmp_path):
    """The stale lock was already replaced by another run's: a late take-over of the stale one
    neither removes nor marks the new lock."""
    lock = tmp_path / "apply.lock"
    stale = _stale_lock(str(lock))
    first = locks.me("apply")
    assert locks.parse_answer(_sh(locks.acquire_script(first, stale, lock=str(lock)))).acquired
    late = locks.parse_answer(_sh(locks.acquire_script(locks.me("apply"), stale, lock=str(lock))))
    assert not late.acquired and late.holder == first and not late.stale()
    assert sorted(p.name for p in lock.iterdir()) == ["owner"]


def test_a_run_that_meets_a_take_over_in_progress_waits_instead_of_spinning(tmp_path):
    """Another run holds the take-over claim of the stale lock: this run does not ask again and
    again; without -lock-timeout it fails at once, saying what happens."""
    lock = tmp_path / "apply.lock"
    stale = _stale_lock(str(lock))
    (lock / "taking").mkdir()  # the claim of a run that is taking it over right now
    asked = []

    class Session:
        def reached(self):
            return []

        def run(self, name, script):
            asked.append(script)
            out = subprocess.run(["sh", "-c", script.replace(locks.HOST_LOCK, str(lock))
                                  .replace(locks.HOST_DIR, str(tmp_path))],
                                 capture_output=True, text=True)
            return out.returncode == 0, type("Out", (), {"stdout_lines": out.stdout.splitlines(),
                                                        "stderr_lines": []})()

    with pytest.raises(locks.LockedError) as err:
        locks.HostLocks(Session(), locks.me("apply"))._acquire("node1")
    assert len(asked) == 2  # asked, found it stale, asked to take it over: then stopped
    assert "another run is taking it over" in str(err.value)
    assert locks.HOST_LOCK in err.value.hint
    assert (lock / "owner").read_text().strip() == stale  # nothing removed
    assert (lock / "taking").is_dir()
