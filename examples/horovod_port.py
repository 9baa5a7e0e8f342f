"""A Horovod training script ported to mpidl, call for call.

Each line that changed carries the Horovod original in its comment
(``docs/training.rst``, "From Horovod", has the table). The script is small
on purpose, so that what it computes can be checked to the last bit
(``tests/test_horovod_port.py``): a linear model whose gradient at a batch is
the batch itself, integer-valued, trained for two epochs with SGD (lr 0.25,
momentum 0.5, halved after the first epoch). Rank r has 2 + r batches per
epoch, so the workers run out of data at different steps and ``join()`` lets
the others go on: each step averages the gradients of the workers still in.
Every worker prints one JSON line: its place in the job, its final weights,
what it gathered and reduced, e.g.::

    mpiexec -n 3 python examples/horovod_port.py
"""

from __future__ import annotations

import json
import sys

import torch

import mpidl  # import horovod.torch as hvd

WIDTH = 6
EPOCHS = 2


def batch(rank: int, epoch: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s input at ``step`` of ``epoch``: integers, so every sum is exact."""
    return (torch.arange(WIDTH, dtype=torch.float64) + 1) * (rank + 1) + step + 10 * epoch


def main() -> None:
    mpidl.init()  # hvd.init()
    rank, local_rank = mpidl.rank(), mpidl.local_rank()  # hvd.rank(), hvd.local_rank()
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # the rank's GPU, as with Horovod; here the model stays on the CPU
    torch.set_num_threads(1)

    model = torch.nn.Linear(WIDTH, 1, bias=False).double()
    if rank == 0:
        torch.nn.init.zeros_(model.weight)  # the others start elsewhere: the broadcast makes them agree
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.5)
    mpidl.broadcast_parameters(model.state_dict(), root=0)  # hvd.broadcast_parameters(..., root_rank=0)
    mpidl.broadcast_optimizer_state(optimizer, root=0)  # hvd.broadcast_optimizer_state(..., root_rank=0)
    optimizer = mpidl.DistributedOptimizer(  # hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), bucket_mb=1e-5
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    batches = 2 + rank
    for epoch in range(EPOCHS):
        with optimizer.join():  # hvd.join() after the loop
            for step in range(batches):
                optimizer.zero_grad()
                loss = model(batch(rank, epoch, step).unsqueeze(0)).sum()
                loss.backward()
                optimizer.step()
        scheduler.step()

    steps = torch.tensor([float(batches)])
    handle = mpidl.allreduce_async(steps, op="sum")  # hvd.allreduce_async_(steps, op=hvd.Sum)
    seen = torch.tensor([[rank, step] for step in range(batches)])  # 2 + rank rows on rank r
    gathered = mpidl.allgather(seen)  # hvd.allgather(seen)
    mpidl.synchronize(handle)  # hvd.synchronize(handle)
    record = (
        json.dumps(
            {
                "rank": rank,
                "size": mpidl.size(),  # hvd.size()
                "local_rank": local_rank,
                "local_size": mpidl.local_size(),  # hvd.local_size()
                "weights": model.weight.detach().reshape(-1).tolist(),
                "lr": optimizer.param_groups[0]["lr"],
                "steps": optimizer.algorithm.iterations,
                "batches": steps.item(),
                "gathered": gathered.tolist(),
            }
        )
        + "\n"
    )
    sys.stdout.write(record)  # one write: the ranks' lines do not interleave
    sys.stdout.flush()


if __name__ == "__main__":
    main()
