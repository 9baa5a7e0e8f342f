"""``mpidl train`` under its own mpiexec: the JSON it writes, reproducibility, errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from mpitest import mpiexec, on_rank0_quietly

from mpidl import compare

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="digits need scikit-learn"),
]

QUICK = ["--epochs", "2", "--hidden", "16", "--no-progress"]

EPOCH_KEYS = {
    "epoch",
    "time_s",
    "epoch_s",
    "eval_s",
    "train_loss",
    "steps",
    "test_loss",
    "test_acc",
    "test_acc_worst",
    "test_acc_mean",
    "consensus",
    "bytes_per_step_mean",
    "bytes_per_step_max",
    "bytes_total",
    "internode_bytes_per_step_mean",
    "internode_bytes_total",
    "workers",
}
WORKER_KEYS = {
    "test_acc",
    "consensus",
    "train_loss",
    "iterations",
    "bytes_sent",
    "internode_bytes",
    "comm_wait_s",
    "time_s",
}


def train(n: int, *argv: str) -> tuple[int, str, str]:
    """Run ``mpidl train`` on n ranks from rank 0; (exit status, stdout, stderr) on every rank."""
    proc = on_rank0_quietly(mpiexec, n, ["-m", "mpidl", "train", *argv], timeout=180)
    return proc.returncode, proc.stdout, proc.stderr


def read(path: Path) -> dict:
    return on_rank0_quietly(lambda: json.loads(path.read_text()))


def untimed(epochs: list[dict]) -> list[dict]:
    """Per-epoch records without the times (which differ between runs)."""
    return [
        {k: v for k, v in e.items() if not k.endswith("_s") and k != "workers"}
        | {k: v for k, v in e["workers"].items() if not k.endswith("_s")}
        for e in epochs
    ]


def test_dpsgd_ring_writes_the_documented_json_and_plot(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("train")
    plot = ["--plot", str(out / "run.png")] if importlib.util.find_spec("matplotlib") else []
    rc, stdout, stderr = train(
        4,
        "--algorithm",
        "dpsgd",
        "--topology",
        "ring",
        "--backend",
        "numpy",
        "--json",
        str(out / "run.json"),
        *plot,
        *QUICK,
    )
    assert rc == 0, stderr
    assert stdout.startswith("# mpidl train: dpsgd (topology=ring), ring(4)")
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("epoch")] == ["1/2", "2/2"]
    assert "final: test accuracy" in stdout
    run = read(out / "run.json")
    meta, epochs = run["meta"], run["epochs"]
    assert meta["workers"] == 4 and meta["algorithm"] == "dpsgd" and meta["options"] == {"topology": "ring"}
    assert meta["model"] == "MLP 64-16-10" and meta["model_spec"] == {"model": "mlp", "layers": [64, 16, 10]}
    assert meta["model_bytes"] == 4 * meta["parameters"] == 4 * 1210
    assert meta["steps_per_epoch"] == 12 and meta["topology"]["spectral_gap"] == pytest.approx(2 / 3)
    assert [e["epoch"] for e in epochs] == [1, 2]
    for e in epochs:
        assert set(e) == EPOCH_KEYS and set(e["workers"]) == WORKER_KEYS
        assert all(len(v) == 4 for v in e["workers"].values())
        assert 0 <= e["test_acc_worst"] <= e["test_acc_mean"] <= 1 and 0 <= e["test_acc"] <= 1
        assert 0 < e["consensus"] < 1 and e["time_s"] > 0
    last = epochs[-1]
    assert last["workers"]["iterations"] == [24] * 4
    # A ring of 4: each step sends the model to two neighbors.
    assert last["bytes_per_step_mean"] == last["bytes_per_step_max"] == 2 * meta["model_bytes"]
    assert last["bytes_total"] == 4 * 24 * 2 * meta["model_bytes"]
    if plot:
        assert on_rank0_quietly(lambda: (out / "run.png").read_bytes()[:8]) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("algorithm,crossing", [("dpsgd", 1.0), ("allreduce", 0.75)])
def test_bytes_to_other_nodes_are_counted_by_destination(
    algorithm: str, crossing: float, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two nodes of two ranks (0, 1 | 2, 3). D-PSGD on the ring 0-1-2-3-0: every worker sends
    its model to one neighbour on its node and one on the other. The ring all-reduce: ranks 1
    and 3 send their 2 (n-1)/n = 1.5 models per step to the other node, ranks 0 and 2 none;
    0.75 model per worker per step."""
    out = tmp_path_factory.mktemp("nodes") / "run.json"
    extra = ["--collective", "ring"] if algorithm == "allreduce" else []
    argv = ["-m", "mpidl", "train", "--algorithm", algorithm, *extra, "--backend", "numpy", "--json", str(out), *QUICK]
    proc = on_rank0_quietly(mpiexec, 4, argv, timeout=180, hosts="a:2,b:2")
    assert proc.returncode == 0, proc.stderr
    run = read(out)
    model, last = run["meta"]["model_bytes"], run["epochs"][-1]
    assert last["internode_bytes_per_step_mean"] == crossing * model
    assert last["internode_bytes_total"] == 24 * 4 * crossing * model


def test_same_seed_same_metrics(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("seed")
    runs = []
    for name, seed in (("a", "5"), ("b", "5"), ("c", "6")):
        rc, _, stderr = train(
            2, "--algorithm", "dpsgd", "--backend", "numpy", "--seed", seed, "--json", str(out / f"{name}.json"), *QUICK
        )
        assert rc == 0, stderr
        runs.append(read(out / f"{name}.json")["epochs"])

    assert untimed(runs[0]) == untimed(runs[1])
    assert untimed(runs[0]) != untimed(runs[2])


def test_torch_allreduce_keeps_one_model(tmp_path_factory: pytest.TempPathFactory) -> None:
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("torch") / "run.json"
    rc, stdout, stderr = train(
        2,
        "--algorithm",
        "allreduce",
        "--collective",
        "ring",
        "--backend",
        "torch",
        "--slow",
        "1:2",
        "--json",
        str(out),
        *QUICK,
    )
    assert rc == 0, stderr
    run = read(out)
    assert run["meta"]["backend"] == "torch" and run["meta"]["slow"] == {"1": 2.0}
    assert "rank 1 slowed x2" in stdout
    last = run["epochs"][-1]
    assert last["consensus"] == 0 and last["test_acc_worst"] == last["test_acc"]
    # Ring all-reduce on 2 ranks: 2 (n-1)/n = 1 model per step.
    assert last["bytes_per_step_mean"] == run["meta"]["model_bytes"]


@pytest.mark.job
def test_resume_reproduces_the_uninterrupted_run(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("resume")
    common = ["--algorithm", "dpsgd", "--backend", "numpy", *QUICK, "--checkpoint-every", "5"]
    whole, halves, late = out / "whole", out / "halves", out / "late"
    rc, _, stderr = train(2, *common, "--checkpoint", str(whole), "--json", str(out / "whole.json"))
    assert rc == 0, stderr
    # Epoch 2 resumed from the checkpoint at the end of epoch 1 (23 steps per epoch on 2 workers).
    rc, _, stderr = train(2, *common, "--epochs", "1", "--checkpoint", str(halves))
    assert rc == 0, stderr
    rc, stdout, stderr = train(2, *common, "--checkpoint", str(halves), "--resume", "--json", str(out / "halves.json"))
    assert rc == 0, stderr
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("epoch")] == ["2/2"]
    # The last two steps resumed from the mid-epoch checkpoint after step 45 (the previous one is kept).
    on_rank0_quietly(lambda: (shutil.copytree(whole, late), (late / "latest").write_text("step-000045")))
    rc, _, stderr = train(2, *common, "--checkpoint", str(late), "--resume", "--json", str(out / "late.json"))
    assert rc == 0, stderr

    def final(folder: Path) -> list[dict[str, np.ndarray]]:
        return [dict(np.load(folder / "step-000046" / f"rank-{r}.npz")) for r in range(2)]

    expected = on_rank0_quietly(final, whole)
    assert expected[0]["params"].shape == (1210,) and "momentum" in expected[0]
    for folder in (halves, late):
        for want, got in zip(expected, on_rank0_quietly(final, folder)):
            for key in ("params", "momentum"):
                np.testing.assert_array_equal(want[key], got[key])
        assert untimed(read(out / f"{folder.name}.json")["epochs"]) == untimed(read(out / "whole.json")["epochs"])
    rc, _, stderr = train(2, *common, "--checkpoint", str(whole), "--resume", "--lr", "0.1")
    assert rc == 2 and "the checkpoint is of another run: lr was 0.05, now 0.1" in stderr


def _damage(folder: Path, damage: str) -> Path:
    """Damage rank 1's file of the checkpoint after step 23 in ``folder``: ``truncated``,
    ``short`` (one parameter), or leave out the entry ``damage``; return the file."""
    path = folder / "step-000023" / "rank-1.npz"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    elif damage == "short":  # the parameters cut to their first element
        with np.load(path) as archive:
            kept = {key: archive[key][:1] if key == "params" else archive[key] for key in archive.files}
        np.savez(path, **kept)
    else:
        with np.load(path) as archive:
            kept = {key: archive[key] for key in archive.files if key != damage}
        np.savez(path, **kept)
    return path


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "algorithm, damages",
    [
        (
            "allreduce",
            {
                "truncated": " is truncated or corrupt (BadZipFile: ",
                "params": ": lacks 'params'",
                "short": ": the saved state has shape (1,), the model 1210 elements",
                "algorithm.residual": ": the state lacks 'residual' (the error-feedback memory)",
            },
        ),
        ("dpsgd", {"algorithm.mixed": ": the state lacks 'mixed' (CHOCO-SGD's copies x^ and s"}),
    ],
)
@pytest.mark.job
def test_a_damaged_checkpoint_is_named_on_every_rank(
    algorithm: str, damages: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Resuming from a checkpoint whose rank-1 file is truncated or lacks an entry (the
    error-feedback memory, CHOCO-SGD's mix) ends every rank with one error naming the file,
    within 60 s; nothing is zeroed silently."""
    out = tmp_path_factory.mktemp("damaged")
    common = ["--algorithm", algorithm, "--compression", "topk:0.25", "--backend", "numpy", "--hidden", "16"]
    rc, _, stderr = train(2, *common, "--epochs", "1", "--no-progress", "--checkpoint", str(out / "saved"))
    assert rc == 0, stderr
    for damage, problem in damages.items():
        folder = out / damage
        on_rank0_quietly(shutil.copytree, out / "saved", folder)
        path = on_rank0_quietly(_damage, folder, damage)
        resume = ["-m", "mpidl", "train", *common, "--epochs", "2", "--no-progress", "--checkpoint", str(folder)]
        proc = on_rank0_quietly(mpiexec, 2, [*resume, "--resume"], timeout=60)
        message = f"mpidl train: error: rank 1: {path}{problem}"
        assert proc.returncode == 2 and proc.stderr.count(message) == 1, (damage, proc.stderr)
        assert "Traceback" not in proc.stderr


@pytest.mark.job
@pytest.mark.parametrize("algorithm", ["adpsgd", "prague"])
def test_workers_step_at_their_own_speed_with_a_straggler(
    algorithm: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """AD-PSGD and Prague: an epoch is 4 x 45 steps of all workers together (batches of 8;
    give or take the steps taken while its end is announced, which count towards the next
    one, so the overshoot does not add up over epochs); the rank slowed x20 takes fewer of
    them than the others; mpidl compare reads the runs.

    The overshoot is a step or so per worker on an idle machine; with 4 ranks on 2 cores
    rank 0's counting thread waits for a core: 13 steps were seen with batches of 32 (4 x
    12 steps an epoch), and once 51, a worker stepping alone for more than an epoch's 0.1
    s. The bound is half an epoch, so small batches make it more steps (45 of 180 seen).
    The hidden layers make a step long enough that the operating system's time slices do
    not decide the run: with a 64-16-10 MLP an epoch took 50 ms, a worker could go
    unscheduled for all of it, another take 91 steps of a 48-step epoch alone, and the
    models drifted apart (consensus 0.39 seen in CI)."""
    out = tmp_path_factory.mktemp("straggler")
    paths = {name: out / f"{name}.json" for name in ("allreduce", algorithm)}
    for name, path in paths.items():
        extra = ["--collective", "ring"] if name == "allreduce" else []
        rc, _stdout, stderr = train(
            4,
            "--algorithm",
            name,
            *extra,
            "--backend",
            "numpy",
            "--slow",
            "3:20",
            "--json",
            str(path),
            *QUICK,
            "--hidden",
            "512,512",
            "--batch-size",
            "8",
        )
        assert rc == 0, stderr
    run = read(paths[algorithm])
    assert run["meta"]["uneven_steps"] and run["meta"]["slow"] == {"3": 20.0}
    per = 4 * run["meta"]["steps_per_epoch"]
    assert per == 4 * 45
    total = 0
    for e in run["epochs"]:
        total += e["steps"]
        assert per * e["epoch"] <= total <= per * e["epoch"] + per // 2, (e["epoch"], total)
        assert 0 < e["test_acc"] <= 1 and e["consensus"] < 0.1, e
    iterations = run["epochs"][-1]["workers"]["iterations"]
    assert sum(iterations) == sum(e["steps"] for e in run["epochs"]) and iterations[3] < max(iterations[:3])
    assert read(paths["allreduce"])["epochs"][-1]["workers"]["iterations"] == [2 * 45] * 4
    table = on_rank0_quietly(lambda: compare.table([(n, json.loads(p.read_text())) for n, p in paths.items()]))
    lines = table.splitlines()
    assert lines[0].startswith("# target: test accuracy") and len(lines) == 4
    assert lines[2].split()[:2] == ["allreduce", "allreduce"] and lines[2].split()[-2] == "1.00"
    assert lines[3].split()[:2] == [algorithm, algorithm] and "3:x20" in lines[3]


def test_grsgd_takes_equal_steps_within_its_lead(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = tmp_path_factory.mktemp("grsgd") / "run.json"
    rc, _stdout, stderr = train(
        4, "--algorithm", "grsgd", "--max-lead", "1", "--backend", "numpy", "--slow", "0:3", "--json", str(out), *QUICK
    )
    assert rc == 0, stderr
    run = read(out)
    assert run["meta"]["options"] == {"max_lead": "1"} and not run["meta"]["uneven_steps"]
    last = run["epochs"][-1]
    assert last["workers"]["iterations"] == [24] * 4 and last["steps"] == 48
    assert last["bytes_per_step_max"] <= 2 * run["meta"]["model_bytes"] and last["consensus"] < 1e-2


@pytest.mark.job
def test_paced_workers_see_one_seeded_schedule_and_the_slow_one_is_named(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """4 paced workers (20 ms a step), rank 3 4x slow, random slowdowns x2: AllReduce-SGD
    and D-PSGD slow the same steps of each worker (the schedule of mpidl.slowdowns for the
    seed), every step computes at least its factor x 20 ms, and the report names rank 3."""
    from mpidl.slowdowns import RandomSlowdown, Slowdowns

    out = tmp_path_factory.mktemp("paced")
    spec = "p=0.3,F=2,P=2"
    runs = {}
    for algorithm, extra in (("allreduce", ["--collective", "ring"]), ("dpsgd", [])):
        path = out / f"{algorithm}.json"
        rc, stdout, stderr = train(
            4,
            "--algorithm",
            algorithm,
            *extra,
            "--backend",
            "numpy",
            "--train-samples",
            "512",
            "--step-time",
            "20ms",
            "--slow",
            "3:4",
            "--slowdown",
            spec,
            "--seed",
            "3",
            "--json",
            str(path),
            *QUICK,
        )
        assert rc == 0, stderr
        assert "paced 20 ms per step" in stdout and "slowest worker: rank 3," in stdout, stdout
        assert len([line for line in stdout.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]) == 4
        runs[algorithm] = read(path)
    steps = 8  # 512 samples, 4 workers, batches of 32: 4 steps an epoch, 2 epochs
    schedule = [
        [Slowdowns(r, {3: 4.0}, RandomSlowdown(0.3, 2.0, 2), 3).factor(k) for k in range(steps)] for r in range(4)
    ]
    for run in runs.values():
        meta, workers = run["meta"], run["workers"]
        assert meta["step_time_s"] == 0.02 and meta["polled_waits"] and meta["slow"] == {"3": 4.0}
        assert meta["slowdown"] == {"p": 0.3, "F": 2.0, "P": 2, "seed": None}
        assert workers["steps"] == [steps] * 4
        assert workers["slowed_steps"] == [sum(f > 1 for f in factors) for factors in schedule]
        for r, factors in enumerate(schedule):
            assert workers["mean_s"]["compute"][r] >= 0.99 * 0.02 * sum(factors) / steps
        assert workers["slowest"]["rank"] == 3 and workers["slowest"]["ratio"] > 1.5
        assert len(workers["cpu"]["cpu_s"]) == 4 and workers["cpu"]["wall_s"] > 0


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--resume"], "--resume needs --checkpoint DIR"),
        (["--step-time", "150"], "expected a positive time with its unit, e.g. 150ms or 0.2s, got '150'"),
        (["--slowdown", "p=2,F=4,P=1"], "the probability p must be in [0, 1], got 2.0"),
        (["--algorithm", "nope"], "invalid choice: 'nope'"),
        (["--slow", "3"], "bad --slow '3': use RANK:FACTOR"),
        (["--slow", "2:3"], "--slow names rank(s) [2], but there are only 2 ranks"),
        (["--algorithm", "allreduce", "--topology", "ring"], "--topology does not apply to --algorithm allreduce"),
        (["--algorithm", "grsgd", "--policy", "smart"], "--policy does not apply to --algorithm grsgd"),
        (["--algorithm", "lsgd", "--overlap", "on"], "--overlap does not apply to --algorithm lsgd"),
        (["--algorithm", "lsgd", "--no-overlap"], "--overlap does not apply to --algorithm lsgd"),
        (["--overlap", "maybe"], "unrecognized arguments: maybe"),
        (["--algorithm", "prague", "--group-size", "3"], "group_size must be an integer in 1..2"),
        (["--dataset", "fashion-mnist", "--data-dir", "/nonexistent"], "not found in /nonexistent"),
        (
            ["--dataset", "mnist", "--data-dir", "/nonexistent"],
            "'mpidl data fetch --dataset mnist --data-dir /nonexistent' downloads them and checks their SHA-256",
        ),
    ],
)
def test_errors_are_reported_once_with_exit_status_2(argv: list[str], message: str) -> None:
    rc, _stdout, stderr = train(2, *argv, "--backend", "numpy", "--no-progress")
    assert rc == 2
    assert stderr.count(message) == 1, stderr
    assert "Traceback" not in stderr
