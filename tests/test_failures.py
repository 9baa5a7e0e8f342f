"""A job that stalls or loses a rank ends, non-zero and within bounds, saying why;
a training job killed mid-run resumes to the uninterrupted run's result."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from mpitest import mpiexec, on_rank0_quietly

from collectives.transport.watchdog import ABORT_EXIT_CODE
from mpidl.runtime import EXCEPTION_EXIT_CODE

pytestmark = pytest.mark.mpi

STALL_WARN, STALL_ABORT = 1, 4
STALL_ENV = {"MPIDL_STALL_WARN": str(STALL_WARN), "MPIDL_STALL_ABORT": str(STALL_ABORT)}
#: How long a job may take to end after the failure, beyond the stall limit: the
#: inspector's check interval, the launcher's teardown, a busy 2-core machine.
SLACK = 15.0
WARNED = f"the job aborts after {STALL_ABORT} s"
ABORTED = f"aborting the job (stall limit MPIDL_STALL_ABORT={STALL_ABORT} s)"
#: A stall report: rank, seconds waited, operation, peers, and how it ends (not
#: anchored to lines: the launcher may put two ranks' lines on one).
REPORT = re.compile(
    r"mpidl: rank (\d+) \(MainThread\) has waited (\d+) s in (.+?) "
    rf"for rank\(s\) ([\d, ]+) of MPI_COMM_WORLD; ({re.escape(WARNED)}|{re.escape(ABORTED)})"
)


def run(
    ranks: int, mode: str, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, float]:
    """``tests/scripts/failure.py MODE ARGS`` on ``ranks`` ranks: the finished process, and the
    seconds from the injected failure (as the script announces it) to the end of the job."""

    def go():
        proc = mpiexec(ranks, ["tests/scripts/failure.py", mode, *args], timeout=120, env=env)
        ended = time.time()
        failed = re.search(rf"^failure.py: rank \d+ {mode} at ([\d.]+)$", proc.stderr, re.M)
        assert failed, f"no failure was injected (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        return proc, ended - float(failed.group(1))

    return on_rank0_quietly(go)


def test_stalled_collective_is_reported_then_aborts_the_job() -> None:
    proc, after = run(3, "stall", env=STALL_ENV)
    err = proc.stderr
    assert proc.returncode == ABORT_EXIT_CODE, err[-3000:]
    assert after < STALL_ABORT + SLACK, after
    reports = REPORT.findall(err)
    assert reports, err[-3000:]
    # The others wait in the all-reduce: some for rank 1 itself, some (on more
    # ranks) for those waiting for it.
    assert all(rank != "1" and operation == "allreduce(algorithm='ring')" for rank, _, operation, _, _ in reports), err[
        -3000:
    ]
    assert any("1" in peers.split(", ") for _, _, _, peers, _ in reports), err[-3000:]
    assert any(tail == WARNED for *_, tail in reports), err[-3000:]
    assert any(tail == ABORTED and int(waited) >= STALL_ABORT for _, waited, _, _, tail in reports), err[-3000:]


def test_stalled_preduce_names_the_lock_holders() -> None:
    proc, after = run(3, "preduce", env=STALL_ENV)
    err = proc.stderr
    assert proc.returncode == ABORT_EXIT_CODE, err[-3000:]
    assert after < STALL_ABORT + SLACK, after
    # Rank 2 stalls: its partner waits for it in their group, and the generator
    # says which group (one with worker 2) holds the lock a queued request needs.
    assert re.search(r"has waited \d+ s in P-Reduce \(group \d+ of ranks \[[\d, ]+\]\) for rank\(s\) 2 of", err), err[
        -3000:
    ]
    assert re.search(
        r"group generator: the request of worker \d is queued as g\d+ .* locks \[[01,]+\]; "
        r"w\d held by g\d+ \{[w\d,]*w2[w\d,]*\}",
        err,
    ), err[-3000:]
    assert ABORTED in err, err[-3000:]


def test_exception_on_one_rank_ends_the_job() -> None:
    proc, after = run(3, "raise")
    assert proc.returncode == EXCEPTION_EXIT_CODE, proc.stderr[-3000:]
    assert after < SLACK, after
    assert "mpidl: rank 1 failed; aborting the job" in proc.stderr, proc.stderr[-3000:]
    assert "RuntimeError: injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_dead_rank_ends_the_job(mode: str) -> None:
    # No stall limit: the launcher itself must notice the dead rank and end the others.
    proc, after = run(3, mode)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert after < SLACK, after


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
def test_training_killed_mid_run_resumes_to_the_uninterrupted_result(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("killed")
    train = [
        "--algorithm",
        "dpsgd",
        "--backend",
        "numpy",
        "--epochs",
        "2",
        "--hidden",
        "16",
        "--no-progress",
        "--checkpoint-every",
        "5",
    ]
    whole, killed = out / "whole", out / "killed"

    def uninterrupted() -> subprocess.CompletedProcess:
        return mpiexec(
            2,
            ["-m", "mpidl", "train", *train, "--checkpoint", str(whole), "--json", str(out / "whole.json")],
            timeout=180,
        )

    proc = on_rank0_quietly(uninterrupted)
    assert proc.returncode == 0, proc.stderr
    # 23 steps per epoch on 2 workers: rank 1 dies at step 25 (epoch 2), before
    # the checkpoint after it, so the run resumes from step 20 (epoch 1).
    proc, after = run(
        2,
        "train",
        *train,
        "--checkpoint",
        str(killed),
        "--json",
        str(out / "killed.json"),
        env={"FAILURE_KILL_STEP": "25"},
    )
    assert proc.returncode != 0 and after < SLACK, (proc.returncode, after)

    def resume() -> tuple[str, subprocess.CompletedProcess]:
        latest = (killed / "latest").read_text()
        return latest, mpiexec(
            2,
            [
                "-m",
                "mpidl",
                "train",
                *train,
                "--checkpoint",
                str(killed),
                "--resume",
                "--json",
                str(out / "resumed.json"),
            ],
            timeout=180,
        )

    latest, proc = on_rank0_quietly(resume)
    assert latest == "step-000020"
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("epoch")] == ["1/2", "2/2"]

    def final(folder: Path, metrics: str) -> tuple[list[dict[str, np.ndarray]], list[tuple[float, float]]]:
        """Every worker's arrays after the last step, and each epoch's (loss, accuracy)."""
        epochs = json.loads((out / metrics).read_text())["epochs"]
        return (
            [dict(np.load(folder / "step-000046" / f"rank-{r}.npz")) for r in range(2)],
            [(e["train_loss"], e["test_acc"]) for e in epochs],
        )

    (want, want_epochs), (got, got_epochs) = on_rank0_quietly(
        lambda: (final(whole, "whole.json"), final(killed, "resumed.json"))
    )
    assert got_epochs == want_epochs
    for w, g in zip(want, got):
        for key in ("params", "momentum"):
            np.testing.assert_array_equal(w[key], g[key])
