"""A job that stalls or loses a rank ends, non-zero and within bounds, saying why;
a training job killed mid-run resumes to the uninterrupted run's result."""

from __future__ import annotations

import importlib.util
import json
import mmap
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import shm_segments
from mpi4py import MPI
from mpitest import mpiexec, on_rank0_quietly

import algorithms
import collectives
from collectives.transport import faults
from mpidl import data
from mpidl.runtime import FAILED_EXIT_CODE, STALL_EXIT_CODE, USAGE_EXIT_CODE

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
    r"mpidl: rank (\d+): MainThread has waited (\d+) s in (.+?) "
    rf"for rank\(s\) ([\d, ]+) of MPI_COMM_WORLD; ({re.escape(WARNED)}|{re.escape(ABORTED)})"
)


def run(
    ranks: int,
    mode: str,
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120,
    options: list[str] | None = None,
) -> tuple[subprocess.CompletedProcess, float]:
    """``tests/scripts/failure.py MODE ARGS`` on ``ranks`` ranks (``options`` for mpiexec): the
    finished process, and the seconds from the injected failure (as the script announces
    it) to the end of the job."""

    def go():
        argv = ["tests/scripts/failure.py", mode, *args]
        proc = mpiexec(ranks, argv, timeout=timeout, env=env, options=options or ())
        ended = time.time()
        failed = re.search(rf"^failure.py: rank \d+ {mode} at ([\d.]+)$", proc.stderr, re.M)
        assert failed, f"no failure was injected (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        return proc, ended - float(failed.group(1))

    return on_rank0_quietly(go)


@pytest.mark.job
def test_stalled_collective_is_reported_then_aborts_the_job() -> None:
    proc, after = run(3, "stall", env=STALL_ENV)
    err = proc.stderr
    assert proc.returncode == STALL_EXIT_CODE, err[-3000:]
    assert after < STALL_ABORT + SLACK, after
    reports = REPORT.findall(err)
    assert reports, err[-3000:]
    # The others wait in the all-reduce: some for rank 1 itself, some (on more
    # ranks) for those waiting for it.
    ring = "allreduce(collective='ring')"
    assert all(rank != "1" and operation == ring for rank, _, operation, _, _ in reports), err[-3000:]
    assert any("1" in peers.split(", ") for _, _, _, peers, _ in reports), err[-3000:]
    assert any(tail == WARNED for *_, tail in reports), err[-3000:]
    assert any(tail == ABORTED and int(waited) >= STALL_ABORT for _, waited, _, _, tail in reports), err[-3000:]


@pytest.mark.job
def test_stalled_preduce_names_the_lock_holders() -> None:
    proc, after = run(3, "preduce", env=STALL_ENV)
    err = proc.stderr
    assert proc.returncode == STALL_EXIT_CODE, err[-3000:]
    assert after < STALL_ABORT + SLACK, after
    # Rank 2 stalls: its partner waits for it in their group, and the generator
    # says which group (one with worker 2) holds the lock a queued request needs.
    assert re.search(r"has waited \d+ s in P-Reduce \(group \d+ of ranks \[[\d, ]+\]\) for rank\(s\) 2 of", err), err[
        -3000:
    ]
    assert re.search(
        r"mpidl: rank 0: group generator: the request of worker \d is queued as g\d+ .* locks \[[01,]+\]; "
        r"w\d held by g\d+ \{[w\d,]*w2[w\d,]*\}",
        err,
    ), err[-3000:]
    assert ABORTED in err, err[-3000:]


@pytest.mark.job
def test_exception_on_one_rank_ends_the_job() -> None:
    proc, after = run(3, "raise")
    assert proc.returncode == FAILED_EXIT_CODE, proc.stderr[-3000:]
    assert after < SLACK, after
    assert "mpidl: rank 1 failed; aborting the job" in proc.stderr, proc.stderr[-3000:]
    assert "RuntimeError: injected failure on rank 1" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--resume"], "mpidl train: error: --resume needs --checkpoint DIR"),
        (["train", "--epochs", "0"], "argument --epochs: expected a positive int, got '0'"),
        (
            ["train", "--algorithm", "allreduce", "--on-failure", "continue"],
            "--on-failure continue: --algorithm allreduce cannot go on without a dead worker "
            "(only adpsgd, grsgd, prague can)",
        ),
    ],
)
def test_a_usage_error_has_its_own_exit_code(argv: list[str], message: str) -> None:
    """A bad option (found by the command on every rank, or by the argument parser) ends the
    job with the usage error's code, which a batch script tells from a failed rank's and a
    stall's: running it again unchanged would fail again."""
    assert len({USAGE_EXIT_CODE, FAILED_EXIT_CODE, STALL_EXIT_CODE}) == 3
    proc = on_rank0_quietly(mpiexec, 2, ["-m", "mpidl", *argv], timeout=60)
    assert proc.returncode == USAGE_EXIT_CODE and proc.stderr.count(message) == 1, proc.stderr[-3000:]
    assert "aborting the job" not in proc.stderr


#: A stall report without an abort limit: rank, operation, peers (not anchored to lines, as REPORT).
LATE = re.compile(r"mpidl: rank (\d+): MainThread has waited \d+ s in (.+?) for rank\(s\) ([\d, ]+) of MPI_COMM")


@pytest.mark.parametrize(
    "operation, reported",
    [
        ("settle", "P-Reduce settle() (waiting for every worker's settle() at the group generator on rank 0)"),
        ("close", "P-Reduce close() (waiting for every worker's close() at the group generator on rank 0)"),
        ("neighbor", "neighbor_allreduce"),
        ("checkpoint", "checkpoint.save(step 2)"),
    ],
)
@pytest.mark.job
def test_a_rank_late_into_an_operation_is_reported(operation: str, reported: str) -> None:
    """Rank 1 of 3 comes 3 s late (warning limit 1 s, no abort): the ranks waiting for it
    report the operation and whom they wait for; in P-Reduce every worker waits for the
    group generator (rank 0), which says that it waits for worker 1."""
    proc, _ = run(3, "late", operation, env={"MPIDL_STALL_WARN": "1"}, timeout=60)
    err = proc.stderr
    assert proc.returncode == 0, err[-3000:]
    reports = {(int(rank), peers) for rank, what, peers in LATE.findall(err) if what == reported}
    if operation in ("settle", "close"):
        assert reports == {(0, "0"), (2, "0")}, err[-3000:]
        assert re.search(
            r"mpidl: rank 0: group generator: workers \{w0,w2\} called settle\(\) or close\(\); "
            r"waiting \d+ s for \{w1\}",
            err,
        ), err[-3000:]
    else:
        assert reports == {(0, "1, 2"), (2, "0, 1")}, err[-3000:]


@pytest.mark.job
@pytest.mark.parametrize("kind, rank", [("budget", 0), ("group-generator", 0), ("server", 1)])
def test_exception_in_a_service_thread_ends_the_job(kind: str, rank: int) -> None:
    """The thread's traceback, naming the rank and the thread, and the exception's exit
    code, at once: no rank waits for the thread that died."""
    proc, after = run(2, "thread", kind, timeout=60)
    err = proc.stderr
    assert proc.returncode == FAILED_EXIT_CODE, err[-3000:]
    assert after < SLACK, after
    assert re.search(rf"mpidl: rank {rank} \(thread [\w-]+\) failed; aborting the job:", err), err[-3000:]
    assert f"RuntimeError: injected failure in the {kind} thread" in err, err[-3000:]


@pytest.mark.job
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
@pytest.mark.parametrize("algorithm", ["prague", "adpsgd"])
def test_exception_in_training_is_printed_first(algorithm: str) -> None:
    """``mpidl train``: rank 0 raises in its fifth step. Its traceback is the first thing the
    job reports, at once, and the job ends with the exception's exit code (closing the
    algorithm first waited for the others, or failed with an error of its own)."""
    options = ["--algorithm", algorithm, "--backend", "numpy", "--hidden", "16", "--no-progress"]
    proc, after = run(2, "train", *options, env={"FAILURE_RAISE_STEP": "5"}, timeout=60)
    err = proc.stderr
    assert proc.returncode == FAILED_EXIT_CODE, err[-3000:]
    assert after < SLACK, after
    assert err.startswith("mpidl: rank 0 failed; aborting the job:", err.find("mpidl: ")), err[-3000:]
    assert "RuntimeError: injected failure on rank 0" in err, err[-3000:]


@pytest.mark.job
@pytest.mark.parametrize("algorithm", ["prague", "adpsgd"])
def test_exception_inside_an_algorithms_with_block_is_printed_first(algorithm: str) -> None:
    """The algorithm's ``__exit__`` does not close it (collectively) after rank 1 raised."""
    proc, after = run(2, "raise-with", algorithm, timeout=60)
    err = proc.stderr
    assert proc.returncode == FAILED_EXIT_CODE, err[-3000:]
    assert after < SLACK, after
    assert err.startswith("mpidl: rank 1 failed; aborting the job:", err.find("mpidl: ")), err[-3000:]
    assert "RuntimeError: injected failure on rank 1" in err, err[-3000:]


@pytest.mark.job
@pytest.mark.parametrize("mode", ["kill", "exit"])
def test_dead_rank_ends_the_job(mode: str) -> None:
    # No stall limit: the launcher itself must notice the dead rank and end the others.
    proc, after = run(3, mode)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert after < SLACK, after


#: ``mpidl train`` options of the kill-and-resume test, and whether the run is reproducible.
RESUMED = {
    "allreduce": (["--algorithm", "allreduce"], True),
    "dpsgd": (["--algorithm", "dpsgd"], True),
    "lsgd": (["--algorithm", "lsgd", "--layout", "1", "--backend", "torch"], True),  # two groups of one
    "grsgd-synchronous": (["--algorithm", "grsgd", "--max-lead", "0"], True),
    "grsgd": (["--algorithm", "grsgd", "--max-lead", "2"], False),
    "adpsgd": (["--algorithm", "adpsgd"], False),
    "prague": (["--algorithm", "prague", "--policy", "smart"], False),
}


def checkpoint_files(folder: Path, step: int) -> list[tuple[dict[str, np.ndarray], dict]]:
    """Every worker's (arrays, info) of the checkpoint after ``step``, without the timings of
    the training since the last epoch and of the algorithm's communication."""
    files = []
    for r in range(2):
        arrays = dict(np.load(folder / f"step-{step:06d}" / f"rank-{r}.npz"))
        info = json.loads(str(arrays.pop("info")))
        files.append((arrays, {**info, "epoch_s": 0, "algorithm": {**info["algorithm"], "comm_wait_s": 0}}))
    return files


def untimed(info: dict) -> dict:
    """A checkpoint's JSON without the times it measured."""
    return {
        key: untimed(value) if isinstance(value, dict) else value for key, value in info.items() if key != "step_times"
    }


def same_files(want: list[tuple[dict, dict]], got: list[tuple[dict, dict]]) -> None:
    """Every worker's checkpoint the same: the arrays bit for bit, the rest as JSON, apart
    from the measured step times (the per-worker report's, carried over a resume)."""
    for (want_arrays, want_info), (got_arrays, got_info) in zip(want, got):
        assert want_arrays.keys() == got_arrays.keys()
        assert untimed(want_info) == untimed(got_info)
        for key in want_arrays:
            np.testing.assert_array_equal(want_arrays[key], got_arrays[key], err_msg=key)


@pytest.mark.job
@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
@pytest.mark.parametrize("config", list(RESUMED))
def test_training_killed_mid_run_resumes(config: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 of a 2-worker run (23 steps per epoch) is killed when a checkpoint is due,
    before writing it; the job ends, and ``--resume`` continues from what it left.

    Checkpoints every 10 steps, rank 1 killed at step 30; with uneven steps (checkpoints at
    epoch ends) at the end of epoch 2. Reproducible runs: resumed from the checkpoint after
    step 10, the run writes the one after step 20 bit for bit as the killed run did. The
    others (3 epochs): resumed from the newest checkpoint (after step 20, or epoch 1), the
    run restores exactly its state (saved again right after the restore) and trains on to
    good accuracy."""
    options, reproducible = RESUMED[config]
    if "torch" in options and importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch")
    uneven = config in ("adpsgd", "prague")
    out = tmp_path_factory.mktemp("killed")
    killed = out / "killed"
    common = [*options, "--hidden", "16", "--no-progress", "--checkpoint-every", "10"]
    if "--backend" not in options:
        common += ["--backend", "numpy"]
    train = [*common, "--epochs", "2" if reproducible else "3"]
    proc, after = run(
        2, "train", *train, "--checkpoint", str(killed), env={"FAILURE_KILL_STEP": "46" if uneven else "30"}
    )
    assert proc.returncode != 0 and after < SLACK, (proc.returncode, after, proc.stderr[-3000:])
    latest = 23 if uneven else 20  # the newest checkpoint written before the kill
    assert on_rank0_quietly(lambda: (killed / "latest").read_text()) == f"step-{latest:06d}"

    def resume(folder: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        argv = (*train, *argv, "--checkpoint", str(folder), "--resume", "--json", str(out / "resumed.json"))
        return mpiexec(2, ["tests/scripts/failure.py", "train", *argv], timeout=180, env=env)

    if reproducible:
        again = out / "again"

        def from_step_10() -> subprocess.CompletedProcess:
            shutil.copytree(killed / "step-000010", again / "step-000010")
            (again / "latest").write_text("step-000010")
            return resume(again, "--epochs", "1")

        proc = on_rank0_quietly(from_step_10)
        assert proc.returncode == 0, proc.stderr[-3000:]
        same_files(*on_rank0_quietly(lambda: (checkpoint_files(killed, 20), checkpoint_files(again, 20))))
        return
    saved = on_rank0_quietly(checkpoint_files, killed, latest)  # before the resumed run removes it
    restored = out / "restored"
    proc = on_rank0_quietly(resume, killed, env={"FAILURE_SAVE_RESTORED": str(restored)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    same_files(saved, on_rank0_quietly(checkpoint_files, restored, latest))
    epochs = on_rank0_quietly(lambda: json.loads((out / "resumed.json").read_text())["epochs"])
    assert [e["epoch"] for e in epochs] == [1, 2, 3]
    assert epochs[-1]["test_acc"] >= 0.75, epochs


#: Open MPI's mpiexec with ULFM on, without the closing runtime fence of MPI_Finalize (where the
#: survivors may wait for the dead forever: docs/failures.rst), 4 ranks on fewer cores, and (as
#: root, as CI runs) allowed to run.
ULFM_OPTIONS = ["--with-ft", "ulfm", *faults.LAUNCH_OPTIONS, "--oversubscribe"] + (
    ["--allow-run-as-root"] if os.geteuid() == 0 else []
)


def ulfm_job(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``failure.py ARGV`` on 4 ranks under Open MPI with ULFM (:data:`ULFM_OPTIONS`; on the
    caller's rank), ended after 60 s: then with exit status 124 and what its ranks wrote (the
    script dumps their threads' stacks after 40 s)."""
    args = ["tests/scripts/failure.py", *argv]
    try:
        return mpiexec(4, args, timeout=60, env=env, options=ULFM_OPTIONS)
    except subprocess.TimeoutExpired as exc:
        out, err = (o.decode(errors="replace") if isinstance(o, bytes) else o or "" for o in (exc.stdout, exc.stderr))
        return subprocess.CompletedProcess(args, 124, out, f"{err}\nended after 60 s")


#: What the survivors print: the largest difference of their sum, the world ranks lost, their number.
SURVIVORS = re.compile(r"^failure\.py: survivors (\S+) ([\d,]+) (\d+)$", re.M)


def needs_ulfm() -> None:
    """Skip the test where the MPI library has no ULFM (MPICH's wheel)."""
    why = faults.unsupported()
    if why is not None:
        pytest.skip(f"needs an MPI library with ULFM (Open MPI: .ci/ulfm makes a virtualenv with it): {why}")


@pytest.mark.job
@pytest.mark.parametrize("compression", [None, "topk:0.1"])
@pytest.mark.parametrize("role, victim", [("active", 0), ("passive", 1)])
def test_adpsgd_survives_a_dead_worker(role: str, victim: int, compression: str | None, tmp_path: Path) -> None:
    """AD-PSGD with on_failure="continue" under ULFM, 4 workers, learning rate 0, its gossip
    uncompressed or compressed: worker 0 (active, between two averagings) or 1 (passive,
    holding its lock while requests wait) is killed; the 3 survivors take all their steps,
    and their sum is the initial sum less the dead worker's model (the averagings in flight
    abandoned or completed on both ends; compressed, the survivors' edges start anew, both
    ends' copies alike)."""
    needs_ulfm()

    def go() -> tuple[subprocess.CompletedProcess, float]:
        # Open MPI may drop what a killed rank wrote last: the kill's time is its model file's.
        env = {"FAILURE_DIR": str(tmp_path)}
        proc = ulfm_job(["survive", role, *([compression] if compression else [])], env)
        return proc, time.time() - (tmp_path / "dead.npy").stat().st_mtime

    proc, after = on_rank0_quietly(go)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert after < SLACK, after
    survivors = SURVIVORS.search(proc.stdout)
    assert survivors, proc.stdout[-3000:] + proc.stderr[-3000:]
    error, lost, size = survivors.groups()
    assert (lost, size) == (str(victim), "3"), proc.stdout[-3000:]
    assert float(error) < 1e-12, proc.stdout[-3000:]
    assert f"AD-PSGD: worker(s) {victim} of MPI_COMM_WORLD failed; 3 continue over the graph bipartite(3)" in (
        proc.stderr
    ), proc.stderr[-3000:]


@pytest.mark.parametrize("name", ["adpsgd", "prague", "grsgd"])
def test_a_recovery_that_finds_no_one_dead_changes_nothing(name: str) -> None:
    """Under ULFM, 4 workers at learning rate 0, no one dies, but an agreement that ends a
    settle answers false (Open MPI's was seen to, under load): the recovery finds every
    worker alive, and the algorithm goes on with the same workers on the caller's
    communicator, ``lost`` empty (so ``mpidl train`` deals no data anew and records no
    failure), the sum kept."""
    needs_ulfm()
    proc = on_rank0_quietly(ulfm_job, ["false-alarm", name], {})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"^failure\.py: false alarm {name} agreements \d+ same True error (\S+)$", proc.stdout, re.M)
    error = float(proc.stdout.rsplit("error ", 1)[1].split()[0])
    assert error < 1e-12, proc.stdout[-3000:]
    assert "a recovery found no worker dead (the agreement failed without a failure); all continue" in proc.stderr


#: What the survivors print after each death of ``failure.py trials``: seed and trial, the
#: kill point, the world rank lost, the largest difference of their sum.
TRIAL = re.compile(r"^failure\.py: trial (\d+)\.(\d) (\w+) (\w+) lost (\d+) error (\S+)$", re.M)


@pytest.mark.parametrize("seed", range(10))
def test_adpsgd_survives_deaths_at_any_point_of_an_averaging(seed: int, tmp_path: Path) -> None:
    """20 trials, 2 per run of 4 workers at learning rate 0: a worker dies before, during or
    after an averaging, as its active or its passive worker (the script's 5 kill points in
    turns: each 4 times over the seeds), armed after a random number of steps, while the
    others average at random moments; after each recovery the survivors' sum is what they
    held less the dead worker's model (as its partner counts it: averaged where the
    partner applied the average)."""
    needs_ulfm()
    proc = on_rank0_quietly(ulfm_job, ["trials", str(seed)], {"FAILURE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = TRIAL.findall(proc.stdout)
    assert [(int(s), int(t)) for s, t, *_ in trials] == [(seed, 0), (seed, 1)], proc.stdout[-3000:]
    assert all(float(error) < 1e-12 for *_, error in trials), proc.stdout[-3000:]
    assert len({lost for *_, lost, _ in trials}) == 2, proc.stdout[-3000:]


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
def test_train_survives_a_dead_worker(tmp_path: Path) -> None:
    """``mpidl train --on-failure continue``, AD-PSGD on 4 workers: worker 1 is killed in its
    3rd step; the 3 survivors finish the 3 epochs, the training set dealt among them, the
    epochs from the failure on ending by their own steps' budget, to good accuracy; the JSON
    says who died when, and the output is rank 0's alone."""
    train_survives("adpsgd", 1, tmp_path)


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
def test_grsgd_train_survives_a_dead_worker(tmp_path: Path) -> None:
    """``mpidl train --algorithm grsgd --on-failure continue``: worker 1 of 4 is killed in its 3rd
    step; the survivors' ring re-links, they finish the epoch's steps with their own data
    (every survivor as many, GR-SGD's rule), then deal the training set among themselves and
    finish the epoch as :func:`test_train_survives_a_dead_worker` asks."""
    proc = train_survives("grsgd", 1, tmp_path)
    assert "mpidl: rank 0: GR-SGD: worker(s) 1 of MPI_COMM_WORLD failed; 3 continue on the ring" in proc.stderr


def train_survives(algorithm: str, victim: int, tmp_path: Path) -> subprocess.CompletedProcess:
    """``mpidl train --algorithm ALGORITHM --on-failure continue`` on 4 workers under ULFM,
    worker ``victim`` killed in its 3rd step (early: AD-PSGD's workers take uneven shares of
    an epoch's steps, and under load one took only 7 in 3 epochs): the checks of
    :func:`test_train_survives_a_dead_worker`; the finished job."""
    needs_ulfm()
    out = tmp_path / "run.json"
    argv = ["--algorithm", algorithm, "--on-failure", "continue", "--backend", "numpy", "--hidden", "16"]
    argv += ["--epochs", "3", "--no-progress", "--json", str(out)]
    proc = on_rank0_quietly(ulfm_job, ["train", *argv], {"FAILURE_DIE": f"{victim}:3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = on_rank0_quietly(lambda: json.loads(out.read_text()))
    [failure] = run["failures"]
    assert failure["lost"] == [victim] and failure["workers"] == 3, failure
    assert sum(failure["samples_per_worker"]) == run["meta"]["train_samples"], failure
    epochs = run["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3], epochs
    # From the failure on, the epochs end as the survivors' steps reach their budget (an
    # epoch's overshoot counting towards the next), the dead worker's steps not counted.
    budget = 3 * data.steps_per_epoch(run["meta"]["train_samples"], 3, run["meta"]["batch_size"])
    since = np.cumsum([e["steps"] for e in epochs[failure["epoch"] - 1 :]])
    assert all(taken >= budget * (k + 1) for k, taken in enumerate(since)), (budget, since)
    assert epochs[-1]["test_acc"] >= 0.75, epochs
    assert proc.stdout.count("final: test accuracy") == 1, proc.stdout[-3000:]
    assert f"# epoch {failure['epoch']}: worker(s) {victim} of MPI_COMM_WORLD died; 3 continue" in proc.stdout
    return proc


#: What the survivors print after each death of ``failure.py prague`` or ``failure.py grsgd``:
#: the mode, seed and trial, two words naming the death (Prague: the group generator's host or
#: another worker's; GR-SGD: the ring's size), its point, the world rank lost, the largest
#: difference of their sum.
DEATH = re.compile(
    r"^failure\.py: (prague|grsgd) (\d+)\.(\d) (service|worker|ring\d) (before|during|after) lost (\d+) error (\S+)$",
    re.M,
)


def job_processes(tmp_path: Path) -> list[int]:
    """The processes still running with ``FAILURE_DIR=tmp_path`` in their environment (a job's
    ranks, by the folder that only that job was given)."""
    mark = f"FAILURE_DIR={tmp_path}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and mark in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # ended meanwhile, or not ours to read
            continue
    return found


#: What the survivors log after each recovery of ``failure.py prague`` (a new group generator,
#: restarted at least once where its host died) and ``failure.py grsgd``.
RECOVERED = {
    "prague": "with a new group generator, restarted on rank",
    "grsgd": "continue on the ring of the survivors",
}


@pytest.mark.parametrize("mode", ["prague", "grsgd"])
@pytest.mark.parametrize("seed", range(2))
def test_survives_deaths_before_during_and_after_an_average(mode: str, seed: int, tmp_path: Path) -> None:
    """Prague (smart pairs) or GR-SGD with on_failure="continue" under ULFM, 4 workers, learning
    rate 0: three workers die one after the other (the last survivor steps alone), before,
    during or after an average, each point once over the 2 seeds' runs' three deaths, armed
    after a random number of steps. Prague: during is half of the ring all-reduce sent, and
    each point comes once as the group generator's host and once as another worker. GR-SGD:
    an exchange with a ring neighbor, during is both snapshots exchanged and the dying end's
    increment not applied; the rings of 4, 3 and 2 re-link (3 leave 2 neighbors, 2 leave one
    worker alone), and the exchanges between survivors that the failure cut in half are
    taken back. After each recovery the survivors' sum is what they held less the dead
    worker's model (the model the survivors count as its own: before a failed average, with
    its half of an exchange both ends saw complete), and the job leaves no process behind."""
    needs_ulfm()
    proc = on_rank0_quietly(ulfm_job, [mode, str(seed)], {"FAILURE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = [trial for trial in DEATH.findall(proc.stdout) if trial[0] == mode]
    assert [(int(s), int(t)) for _, s, t, *_ in trials] == [(seed, 0), (seed, 1), (seed, 2)], proc.stdout[-3000:]
    assert all(float(error) < 1e-12 for *_, error in trials), proc.stdout[-3000:]
    assert len({lost for *_, lost, _ in trials}) == 3, proc.stdout[-3000:]
    assert {when for *_, when, _, _ in trials} == {"before", "during", "after"}, trials
    assert RECOVERED[mode] in proc.stderr, proc.stderr[-3000:]
    assert on_rank0_quietly(job_processes, tmp_path) == []


@pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn")
def test_prague_train_survives_the_death_of_the_group_generators_host(tmp_path: Path) -> None:
    """``mpidl train --algorithm prague --on-failure continue`` on 4 workers: worker 0, which
    runs the group generator (and counts the step budget, and reports), is killed in its 3rd
    step; the survivors restart the group generator and finish as in
    :func:`test_train_survives_a_dead_worker`, the first survivor reporting."""
    proc = train_survives("prague", 0, tmp_path)
    assert (
        "mpidl: rank 1: P-Reduce: worker(s) 0 of MPI_COMM_WORLD failed; 3 continue with a new group generator, "
        "restarted on rank 1 of MPI_COMM_WORLD" in proc.stderr
    ), proc.stderr[-3000:]


def test_ulfm_finalize_hazard_is_named_until_the_launcher_skips_the_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Open MPI with ULFM on, the hazard of MPI_Finalize's closing fence (which AD-PSGD
    with on_failure="continue" warns of) names the launcher option, until the launcher gave
    it; elsewhere there is none."""
    monkeypatch.setenv(faults.FT_ENABLE, "1")
    monkeypatch.delenv(faults.ASYNC_FINALIZE, raising=False)
    hazard = faults.finalize_hazard()
    if faults.unsupported() is not None or not MPI.Get_library_version().startswith("Open MPI"):
        assert hazard is None
        return
    assert hazard is not None and f"mpiexec --with-ft ulfm {' '.join(faults.LAUNCH_OPTIONS)}" in hazard
    monkeypatch.setenv(faults.ASYNC_FINALIZE, "1")
    assert faults.finalize_hazard() is None


@pytest.mark.parametrize(
    "argv, who",
    [(["survive", "active"], "AD-PSGD"), (["prague", "0"], "P-Reduce"), (["grsgd", "0"], "GR-SGD")],
    ids=["adpsgd", "prague", "grsgd"],
)
@pytest.mark.job
def test_without_ulfm_a_dead_worker_still_ends_the_job(argv: list[str], who: str, tmp_path: Path) -> None:
    """on_failure="continue" where the MPI library has no ULFM (MPICH), AD-PSGD, Prague (whose
    P-Reduce warns) or GR-SGD: a warning says so, and the kill ends the job, within seconds, as
    it does by default."""
    why = faults.unsupported()
    if why is None:
        pytest.skip("this MPI library has ULFM: the tests that kill workers run instead")
    proc, after = run(4, *argv, env={"FAILURE_DIR": str(tmp_path)}, timeout=60)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert after < SLACK, after
    assert f"{who} on_failure='continue': ULFM is not available (mpi4py has no ULFM calls" in proc.stderr
    assert "a worker that dies ends the job (the fail-fast abort stays)" in proc.stderr, proc.stderr[-3000:]


def test_prague_on_failure_continue_refuses_the_static_schedule() -> None:
    """The static schedule needs every worker to average in step: with on_failure="continue"
    it is refused, on every rank, naming the policies that can go on."""
    x = np.zeros(4)
    sgd = algorithms.SGD(x, lr=0.0)
    with pytest.raises(collectives.ArgumentError, match="on_failure='continue' needs groups from the group generator"):
        algorithms.create("prague", x, sgd, MPI.COMM_WORLD, policy="static", on_failure="continue")
    with pytest.raises(collectives.ArgumentError, match="unknown on_failure 'later'; valid: abort, continue"):
        algorithms.create("prague", x, sgd, MPI.COMM_WORLD, on_failure="later")


def test_orphaned_segments_are_removed_and_mapped_ones_kept() -> None:
    """The test helper removes MPICH segments of killed jobs (new, mapped by no live
    process) and never one that a live process maps (on rank 0 alone: another rank's
    files would be new to it too)."""
    if not os.path.isdir(shm_segments.SHM):
        pytest.skip(f"no {shm_segments.SHM}")

    def check() -> tuple[list[str], bool, bool]:
        before = shm_segments.segments()
        orphan, live = (
            os.path.join(shm_segments.SHM, f"{shm_segments.SEGMENT}test_{os.getpid()}_{k}") for k in ("a", "b")
        )
        for path in (orphan, live):
            with open(path, "wb") as f:
                f.write(b"\0" * 4096)
        with open(live, "r+b") as f, mmap.mmap(f.fileno(), 4096):
            removed = [name for name in shm_segments.remove_orphaned_segments(before) if f"test_{os.getpid()}_" in name]
            kept = os.path.exists(live)
        os.unlink(live)
        return removed, kept, os.path.exists(orphan)

    removed, kept, orphan_left = on_rank0_quietly(check)
    assert len(removed) == 1 and removed[0].endswith("_a") and kept and not orphan_left, removed
