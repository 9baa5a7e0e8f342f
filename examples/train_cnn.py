"""Train a CNN on Fashion-MNIST or MNIST with mpidl, in an ordinary PyTorch training loop.

A single-process PyTorch script made data-parallel: the lines marked ``# mpidl``
are the ones that changed (README.rst, "Your own PyTorch script", shows them
as a diff). The rest is the script as it was: a ``Dataset`` and a
``DataLoader``, the CPU or a GPU (``--device``), automatic mixed precision
with a ``GradScaler`` (``--amp``: bfloat16 on the CPU, float16 on a GPU),
gradient clipping, a learning-rate schedule, gradient accumulation
(``--accumulate``), BatchNorm (``--model resnet``).

Every rank trains on its own shard of the training set
(``mpidl.ShardSampler``); ``--algorithm`` is one of the synchronous
algorithms, whose ``synchronize()`` runs the step's communication before the
gradients are unscaled and clipped. With ``--device cuda`` each rank trains
on a GPU of its node: its rank among the node's ranks, modulo the GPUs
(``mpidl.models.rank_device``), made the current device; mpidl's
collectives take CUDA tensors through CuPy, which must be installed. Rank 0
prints one line per epoch: its model's accuracy on the test set. For
example::

    mpiexec -n 4 python examples/train_cnn.py --algorithm dpsgd --epochs 5
    mpiexec -n 8 python examples/train_cnn.py --device cuda --amp --dataset mnist

The dataset's four IDX files are read from ``--data-dir``, or where Debian's
package ``dataset-fashion-mnist`` or ``mpidl data fetch`` puts them, as
``mpidl train`` reads them (``mpidl.data.load_idx``).
"""

from __future__ import annotations

import argparse

import torch
from mpi4py import MPI  # mpidl
from torch.nn.functional import cross_entropy
from torch.utils.data import DataLoader, TensorDataset

import algorithms  # mpidl
import mpidl  # mpidl
from mpidl.data import IDX_DATASETS, load_idx
from mpidl.models import rank_device  # mpidl
from mpidl.models.cnn import lenet, resnet8

MODELS = {"lenet": lenet, "resnet": resnet8}


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a CNN on Fashion-MNIST or MNIST with mpidl (a PyTorch script).")
    p.add_argument("--algorithm", choices=["allreduce", "dpsgd", "lsgd"], default="allreduce")
    p.add_argument("--model", choices=list(MODELS), default="lenet")
    p.add_argument("--dataset", choices=list(IDX_DATASETS), default="fashion-mnist")
    p.add_argument("--data-dir", help="folder of the dataset's IDX files")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: a GPU of the rank's node")
    p.add_argument("--train-samples", type=int, help="the first N training samples (default all)")
    p.add_argument("--test-samples", type=int, help="the first N test samples (default all)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="samples per backward pass and worker")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per step")
    p.add_argument("--lr", type=float, default=0.05, help="initial learning rate (cosine schedule)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--clip", type=float, default=5.0, help="largest gradient norm")
    p.add_argument("--amp", action="store_true", help="autocast (CPU: bfloat16, GPU: float16) with a GradScaler")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def accuracy(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> float:
    model.eval()
    with torch.no_grad():
        correct = sum(int((model(x.to(device)).argmax(dim=1) == y.to(device)).sum()) for x, y in loader)
    model.train()
    return correct / len(loader.dataset)


def main() -> None:
    args = arguments()
    comm = mpidl.init()  # mpidl
    # A GPU by the rank's number among its node's ranks (the one place to switch to mpidl.local_rank()).
    device = torch.device(rank_device(args.device, comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()))  # mpidl
    data = load_idx(args.dataset, args.data_dir).subset(args.train_samples, args.test_samples).normalized()
    train_set = TensorDataset(torch.from_numpy(data.x_train), torch.from_numpy(data.y_train))
    test_set = TensorDataset(torch.from_numpy(data.x_test), torch.from_numpy(data.y_test))
    loader = DataLoader(train_set, args.batch_size, sampler=mpidl.ShardSampler(train_set, seed=args.seed))  # mpidl
    test_loader = DataLoader(test_set, batch_size=1000)

    torch.manual_seed(args.seed)
    model = MODELS[args.model](data.shape, data.classes).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    algo = algorithms.create(args.algorithm, model, opt, average_buffers=True)  # mpidl
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp)
    amp_dtype = torch.float16 if device.type == "cuda" else torch.bfloat16

    for epoch in range(args.epochs):
        losses = []
        for i, (x, y) in enumerate(loader):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            last = (i + 1) % args.accumulate == 0 or i + 1 == len(loader)
            with torch.autocast(device.type, amp_dtype, enabled=args.amp):
                loss = cross_entropy(model(x), y)
            losses.append(loss.item())
            with algo.no_sync(enabled=not last):  # mpidl
                scaler.scale(loss / args.accumulate).backward()
            if not last:
                continue
            algo.synchronize()  # mpidl
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        schedule.step()
        test_accuracy = accuracy(model, test_loader, device)
        report = (
            f"epoch {epoch + 1}/{args.epochs}  loss {sum(losses) / len(losses):.4f}  test accuracy {test_accuracy:.2%}"
        )
        if comm.rank == 0:  # mpidl
            print(report, flush=True)
    algo.close()  # mpidl


if __name__ == "__main__":
    main()
