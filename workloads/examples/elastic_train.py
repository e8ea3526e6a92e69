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

from workloads.devices import claim_gpu
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
    optimizer = torch.optim.SGD(model.parameters(), lr=BASE_LR * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    dataset = synthetic_dataset(args.samples)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, step=0)

    def on_reset() -> None:
        # Linear scaling: the effective batch grew or shrank with the world.
        for group in optimizer.param_groups:
            group["lr"] = BASE_LR * hvd.size()

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run  # type: ignore[untyped-decorator]
    def train(state: hvd.elastic.TorchState) -> None:
        loss_fn = torch.nn.MSELoss()
        while state.step < args.steps:
            for features, targets in loader:
                if device is not None:
                    features, targets = features.to(device), targets.to(device)
                started = time.perf_counter()
                optimizer.zero_grad()
                loss = loss_fn(model(features), targets)
                loss.backward()
                optimizer.step()
                state.sampler.record_batch(0, args.batch_size)
                state.step += 1
                if args.step_delay:
                    time.sleep(args.step_delay)
                elapsed = time.perf_counter() - started
                reporter.report(
                    rank=hvd.rank(),
                    step=state.step,
                    world_size=hvd.size(),
                    samples_per_s=args.batch_size * hvd.size() / max(elapsed, 1e-9),
                    loss=float(loss.item()),
                    param_digest=param_digest(model),
                    total_steps=args.steps,
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
