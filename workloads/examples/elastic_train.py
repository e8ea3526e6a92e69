"""Elastic PyTorch training with Horovod on synthetic data: the reference to copy.

Run it under the Alnair supervisor (`alnair submit --elastic --min-gpus 1 --max-gpus 4
-- python -m workloads.examples.elastic_train`), or under bare
`horovodrun --gloo --min-np 1 --max-np 4 --host-discovery-script ...`.

What makes it elastic:
- all training state lives in `hvd.elastic.TorchState` (model, optimizer, sampler,
  step), so a worker that joins gets it by broadcast and a failure rolls back to it;
- `ElasticSampler` re-partitions the samples not yet seen this epoch over the new
  world size, so no sample is skipped or repeated when the job resizes;
- `state.commit()` every few steps is where a resize lands (Horovod checks for host
  changes there) and where a failure rolls back to;
- the learning rate follows the world size through a reset callback;
- each worker claims one of the job's GPUs (`claim_gpu`) before CUDA starts, so a
  worker added by a grow runs on a GPU the grow added, not on one already in use.

With `--adaptive-batch` the batch follows the GPUs too (`workloads/adaptive_batch.py`):
after every resize and every epoch the job picks the local batch with the best goodput
for its world size, from the gradient noise and step times it measures, scales the
learning rate by that batch's gain (AdaScale), and reports its goodput, by which the
brain sizes it. `--batch-size` is then the base batch the learning rate is tuned for.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from pathlib import Path

import horovod.torch as hvd
import torch
from torch.utils.data import DataLoader, TensorDataset

from workloads.adaptive_batch import AdaptiveBatch
from workloads.devices import claim_gpu
from workloads.goodput import BatchLimits
from workloads.progress import ProgressReporter

BASE_LR = 0.01


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="stop after this many steps")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per worker step")
    parser.add_argument("--samples", type=int, default=4096, help="synthetic dataset size")
    parser.add_argument("--commit-every", type=int, default=5, help="steps between commits")
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="extra seconds per step (slow demo)"
    )
    parser.add_argument(
        "--adaptive-batch",
        action="store_true",
        help="adapt the batch to the world size and training phase (goodput), not fixed",
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=512, help="largest global batch (adaptive)"
    )
    parser.add_argument(
        "--max-local-batch", type=int, default=128, help="largest batch per worker (adaptive)"
    )
    parser.add_argument(
        "--stop-file",
        type=Path,
        default=None,
        help="finish cleanly at the next commit once this file exists (open-ended runs)",
    )
    return parser.parse_args(argv)


def synthetic_dataset(samples: int) -> TensorDataset:
    # The same seed on every rank: each worker must see the same dataset to split it.
    generator = torch.Generator().manual_seed(1234)
    features = torch.randn(samples, 32, generator=generator)
    weights = torch.randn(32, 1, generator=generator)
    targets = features @ weights + 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(features, targets)


def param_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def should_stop(stop_file: Path | None) -> bool:
    """Whether every rank agrees to stop: one rank seeing the file is enough.

    Ranks must leave the loop at the same step, or the ones still training would hang
    in an allreduce with no partner; hence the max-allreduce of the flag.
    """
    if stop_file is None:
        return False
    seen = torch.tensor([1.0 if stop_file.exists() else 0.0])
    return bool(hvd.allreduce(seen, op=hvd.Max, name="stop_flag").item() > 0)


def make_optimizer(
    args: argparse.Namespace, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer, AdaptiveBatch | None]:
    """SGD with Horovod's gradient averaging; with `--adaptive-batch`, a plain SGD
    whose gradients `AdaptiveBatch` averages itself (it measures their noise on the
    way)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size())
    if not args.adaptive_batch:
        named = model.named_parameters()
        return hvd.DistributedOptimizer(optimizer, named_parameters=named), None
    limits = BatchLimits(
        base=args.batch_size,
        min_local=max(2, args.batch_size // 4),
        max_local=max(args.batch_size, args.max_local_batch),
        max_global=max(args.batch_size, args.max_batch_size),
    )
    return optimizer, AdaptiveBatch(model, optimizer, limits, base_lr=BASE_LR)


def gradients(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    adaptive: AdaptiveBatch | None,
    features: torch.Tensor,
    targets: torch.Tensor,
) -> float:
    """The step's gradients, averaged over the workers; returns the loss."""
    loss_fn = torch.nn.MSELoss()
    if adaptive is not None:
        return adaptive.backward(lambda x, y: loss_fn(model(x), y), features, targets)
    optimizer.zero_grad()
    loss = loss_fn(model(features), targets)
    loss.backward()
    return float(loss.item())


def step_goodput(
    adaptive: AdaptiveBatch | None, elapsed: float, samples_per_s: float
) -> float | None:
    """An adaptive job learns its step time from each step and reports its goodput."""
    if adaptive is None:
        return None
    adaptive.observe_step(elapsed)
    return adaptive.goodput(samples_per_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Before anything touches CUDA: this worker's GPU becomes the only one it sees.
    gpu = claim_gpu()
    device = torch.device("cuda", 0) if gpu is not None and torch.cuda.is_available() else None
    hvd.init()
    torch.manual_seed(0)
    reporter = ProgressReporter()

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    if device is not None:
        model.to(device)
    optimizer, adaptive = make_optimizer(args, model)
    dataset = synthetic_dataset(args.samples)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, step=0)

    def on_reset() -> None:
        # Linear scaling: the effective batch grew or shrank with the world. (An
        # adaptive job sets its rate when it picks the batch.)
        for group in optimizer.param_groups:
            group["lr"] = BASE_LR * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: hvd.elastic.TorchState) -> None:
        while state.step < args.steps:
            # After a reset (a new world size) and at every epoch: all ranks here.
            batch = args.batch_size if adaptive is None else adaptive.choose().local_batch
            loader = DataLoader(dataset, batch_size=batch, sampler=state.sampler)
            for features, targets in loader:
                if device is not None:
                    features, targets = features.to(device), targets.to(device)
                started = time.perf_counter()
                loss = gradients(model, optimizer, adaptive, features, targets)
                optimizer.step()
                state.sampler.record_batch(0, batch)
                state.step += 1
                if args.step_delay:
                    time.sleep(args.step_delay)
                elapsed = time.perf_counter() - started
                samples_per_s = batch * hvd.size() / max(elapsed, 1e-9)
                reporter.report(
                    rank=hvd.rank(),
                    step=state.step,
                    world_size=hvd.size(),
                    samples_per_s=samples_per_s,
                    loss=loss,
                    param_digest=param_digest(model),
                    total_steps=args.steps,
                    batch_size=batch,
                    goodput=step_goodput(adaptive, elapsed, samples_per_s),
                )
                if state.step % args.commit_every == 0:
                    # A resize lands here: commit() raises HostsUpdatedInterrupt after
                    # saving, so the step counter never goes back on a resize.
                    state.commit()
                    if should_stop(args.stop_file):
                        state.step = args.steps
                if state.step >= args.steps:
                    return
            # An epoch is done: start the sampler's next one.
            state.sampler.set_epoch(state.sampler.epoch + 1)
            state.commit()

    train(state)
    reporter.close()
    if hvd.rank() == 0:
        print(f"finished {state.step} steps at world size {hvd.size()} (pid {os.getpid()})")


if __name__ == "__main__":
    main()
