"""Batch-size adaptation for elastic Horovod PyTorch jobs: the batch follows the GPUs.

A job that keeps each worker's batch trains a global batch that grows with every
worker added, and each sample of it is worth less (`workloads/goodput.py`); one that
adapts picks, for each world size and as training goes on, the local batch with the
best goodput, and scales its learning rate by the batch's gain (AdaScale), as Pollux's
(AdaptDL's) jobs do. The job reports its goodput, so the brain grows it by how much
faster it *trains* on more GPUs, not by how many more samples it reads.

Use (workloads/examples/elastic_train.py with `--adaptive-batch` is the reference):

    adaptive = AdaptiveBatch(model, optimizer, BatchLimits(...), base_lr=0.01)
    # a plain optimizer: `backward` averages the gradients itself
    adaptive.choose()                    # after every reset and every epoch, all ranks
    loader = DataLoader(dataset, batch_size=adaptive.local_batch, sampler=sampler)
    for features, targets in loader:
        loss = adaptive.backward(lambda x, y: loss_fn(model(x), y), features, targets)
        optimizer.step()
        adaptive.observe_step(seconds_the_step_took)
        reporter.report(..., goodput=adaptive.goodput(samples_per_s), batch_size=...)

`backward` replaces `hvd.DistributedOptimizer`: it needs each worker's own gradient
before the average (the gradient noise is measured from the two), so it runs the
backward pass and then one grouped allreduce. On one worker it splits the batch in
two halves to have two gradients. Only jobs import this module (it needs torch and
horovod); the control plane never does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import horovod.torch as hvd
import torch

from workloads.goodput import (
    BatchChoice,
    BatchLimits,
    GradientNoise,
    StepTiming,
    choose_local_batch,
)


def _sqnorm(tensors: Sequence[torch.Tensor]) -> float:
    return float(sum(float(t.detach().double().pow(2).sum()) for t in tensors))


class AdaptiveBatch:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        limits: BatchLimits,
        *,
        base_lr: float,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.limits = limits
        self.base_lr = base_lr
        self.noise = GradientNoise()
        self.timing = StepTiming()
        self.local_batch = limits.base
        self.lr_scale = 1.0
        self._compute_s = 0.0

    @property
    def global_batch(self) -> int:
        return self.local_batch * int(hvd.size())

    def choose(self) -> BatchChoice:
        """Pick the local batch for the current world size (rank 0 decides, every rank
        takes its choice: they must step with the same batch) and set the learning
        rate for it. A collective: every rank calls it at the same point."""
        mine = choose_local_batch(self.noise, self.timing, self.limits, hvd.size())
        decided = hvd.broadcast(
            torch.tensor([float(mine.local_batch), mine.lr_scale], dtype=torch.float64),
            root_rank=0,
            name="adaptive_batch_choice",
        )
        local, lr_scale = int(decided[0].item()), float(decided[1].item())
        self.local_batch, self.lr_scale = local, lr_scale
        for group in self.optimizer.param_groups:
            group["lr"] = self.base_lr * lr_scale
        return BatchChoice(local, mine.goodput if local == mine.local_batch else None, lr_scale)

    def backward(
        self,
        loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        features: torch.Tensor,
        targets: torch.Tensor,
    ) -> float:
        """The step's gradient, averaged over the workers into each parameter's
        `.grad`, with the gradient noise measured on the way; returns the loss."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad()
        started = time.perf_counter()
        workers = hvd.size()
        if workers == 1 and len(features) >= 2:
            half = len(features) // 2
            first_loss = loss_of(features[:half], targets[:half])
            first_loss.backward()  # type: ignore[no-untyped-call]
            first = [_grad(p).detach().clone() for p in params]
            self.optimizer.zero_grad()
            second_loss = loss_of(features[half:], targets[half:])
            second_loss.backward()  # type: ignore[no-untyped-call]
            local_sqr = (_sqnorm(first) + _sqnorm([_grad(p) for p in params])) / 2
            for p, grad in zip(params, first, strict=True):
                _grad(p).add_(grad).mul_(0.5)
            self._compute_s = time.perf_counter() - started
            self.noise.update(local_sqr, _sqnorm([_grad(p) for p in params]), half, 2)
            return (float(first_loss.item()) + float(second_loss.item())) / 2
        loss = loss_of(features, targets)
        loss.backward()  # type: ignore[no-untyped-call]
        grads = [_grad(p) for p in params]
        local_sqr = _sqnorm(grads)
        self._compute_s = time.perf_counter() - started
        if workers > 1:
            like = grads[0] if grads else torch.zeros(1)
            reduced = hvd.grouped_allreduce(
                [*grads, torch.tensor([local_sqr], dtype=like.dtype, device=like.device)],
                op=hvd.Average,
                name="adaptive_gradients",
            )
            for grad, averaged in zip(grads, reduced, strict=False):
                grad.copy_(averaged)
            mean_local_sqr = float(reduced[-1].item())
            self.noise.update(mean_local_sqr, _sqnorm(reduced[:-1]), len(features), workers)
        return float(loss.item())

    def observe_step(self, total_s: float) -> None:
        """The whole step's seconds (data, backward, allreduce, optimizer, anything
        else): what is not backward is the part a larger batch does not make longer."""
        self.timing.observe(self._compute_s, total_s, self.local_batch)

    def goodput(self, samples_per_s: float) -> float:
        """Samples/s at the base batch's worth: what the brain compares sizes by."""
        return samples_per_s * self.noise.efficiency(self.global_batch / self.limits.base)


def _grad(parameter: torch.Tensor) -> torch.Tensor:
    if parameter.grad is None:
        parameter.grad = torch.zeros_like(parameter)
    return parameter.grad
