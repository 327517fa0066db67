"""The resume drill's model, optimizer and schedulers (:func:`build`), and its sizes (:class:`DrillConfig`).

A small vision-language MoE (:class:`DrillModel`): a frozen vision tower, an adapter, token
embeddings, MoE blocks and a head, ``fully_shard`` per block and at the root (FSDP2) when a process
group is up. The router of every block masks the last experts out, so those experts never get a
token, a gradient or optimizer state. See :mod:`.resume` for the drill itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LinearLR, LRScheduler

import sparse_ckpt as sc

VISION_LR = 0.01
"""The frozen vision leaf's initial lr (its scheduler halves it twice)."""


# --------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class DrillConfig:
    """Sizes of the drill. The default widths give every rank's shard a multiple of 32 elements (see :func:`build`)."""

    steps: int = 12
    """Total training steps (N + M)."""
    every: int = 3
    """Checkpoint every ``every`` steps (after steps every, 2*every, ...)."""
    kill_at: int | None = None
    """The step whose save is in flight when the run is killed; ``None``: the second to last save."""
    dim: int = 32
    hidden: int = 64
    n_experts: int = 8
    routed: int = 5
    """Experts ``routed..n_experts-1`` of every block never receive a token."""
    n_blocks: int = 2
    vocab: int = 64
    patch_dim: int = 32
    batch: int = 4
    tokens: int = 8
    patches: int = 4
    seed: int = 0
    device: str = "cpu"
    """Where the ranks train: ``cpu`` (Gloo), ``cuda`` (NCCL, one rank per GPU) or ``npu`` (HCCL)."""

    def save_steps(self) -> list[int]:
        """The steps after which a checkpoint is saved."""
        return list(range(self.every, self.steps + 1, self.every))

    def kill_step(self) -> int:
        """The step whose save the killed run never finishes."""
        saves = self.save_steps()
        if len(saves) < 2:
            raise ValueError(f"--steps {self.steps} --every {self.every}: need at least two saves to kill one")
        kill = saves[-2] if self.kill_at is None else self.kill_at
        if kill not in saves[1:]:
            raise ValueError(f"kill_at={kill} must be a save step after the first one: {saves[1:]}")
        return kill

    def vision_milestones(self) -> tuple[int, int]:
        """Scheduler epochs at which the vision lr halves (0.01 -> 0.005 -> 0.0025)."""
        return (max(1, self.steps // 3), max(2, (2 * self.steps) // 3))

    def unrouted_prefixes(self) -> list[str]:
        """FQN prefixes of the experts that never get a token."""
        return [f"blocks.{b}.experts.{e}." for b in range(self.n_blocks) for e in range(self.routed, self.n_experts)]


# --------------------------------------------------------------------------- the model


class Expert(nn.Module):
    """A feed-forward expert ``down(gelu(up(x)))`` (no biases: every shard is a multiple of 32)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the expert."""
        return self.down(nn.functional.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Top-1 routed experts with a residual; ``route_mask`` keeps experts ``routed..`` unrouted."""

    def __init__(self, dim: int, hidden: int, n_experts: int, routed: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(dim, hidden) for _ in range(n_experts))
        mask = torch.zeros(n_experts)
        mask[routed:] = float("-inf")
        self.register_buffer("route_mask", mask, persistent=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Route every row to its best allowed expert."""
        flat = h.reshape(-1, h.shape[-1])
        logits = self.router(flat) + self.route_mask
        choice = logits.argmax(dim=-1)
        gate = torch.softmax(logits, dim=-1).gather(-1, choice[:, None])
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel():
                out = out.index_add(0, rows, gate[rows] * expert(flat[rows]))
        return h + torch.tanh(out.reshape(h.shape))


class VisionTower(nn.Module):
    """Patch embedding and one projection; frozen in the drill."""

    def __init__(self, patch_dim: int, dim: int) -> None:
        super().__init__()
        self.patch = nn.Linear(patch_dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Image patches -> features."""
        return torch.tanh(self.proj(nn.functional.gelu(self.patch(images))))


class DrillModel(nn.Module):
    """``[adapter(vision(images)); embed(tokens)] -> MoE blocks -> head``."""

    def __init__(self, cfg: DrillConfig) -> None:
        super().__init__()
        self.vision = VisionTower(cfg.patch_dim, cfg.dim)
        self.adapter = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(
            MoEBlock(cfg.dim, cfg.hidden, cfg.n_experts, cfg.routed) for _ in range(cfg.n_blocks)
        )
        self.head = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, tokens: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """Output features for every patch and token."""
        h = torch.cat([self.adapter(self.vision(images)), self.embed(tokens)], dim=1)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class VisionDecay:
    """LambdaLR factor: 1 until ``milestones[0]``, 1/2 until ``milestones[1]``, then 1/4.

    A callable object (not a function), so ``LambdaLR.state_dict`` saves its attributes.
    """

    def __init__(self, milestones: Sequence[int]) -> None:
        self.milestones = tuple(milestones)

    def __call__(self, epoch: int) -> float:
        return 0.5 ** sum(epoch >= m for m in self.milestones)


def make_batch(cfg: DrillConfig, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch of ``step`` (1-based): the same on every rank and at every world size."""
    gen = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.tokens), generator=gen)
    images = torch.randn(cfg.batch, cfg.patches, cfg.patch_dim, generator=gen)
    target = torch.randn(cfg.batch, cfg.patches + cfg.tokens, cfg.dim, generator=gen)
    return tokens, images, target


def build(cfg: DrillConfig) -> tuple[DrillModel, sc.MultiOptimizer, dict[str, LRScheduler]]:
    """The deterministic model (FSDP2-sharded on ``cfg.device`` when a process group is up, else on the
    CPU), its MultiOptimizer and schedulers.

    With the default sizes every shard is a multiple of 32 elements at world sizes 1, 2 and 4, so the
    optimizer's elementwise kernels cannot treat an element differently at another world size (a
    precaution: uneven widths such as ``--dim 36 --hidden 68`` were bit-identical too on torch 2.13 CPU).
    """
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(cfg.seed)
    try:
        model = DrillModel(cfg)
    finally:
        torch.random.set_rng_state(gen_state)
    model.vision.requires_grad_(False)
    if dist.is_initialized():
        # An explicit mesh on the run's device: without one, fully_shard builds its default mesh on the
        # machine's accelerator (CUDA on a GPU machine) even when the run is Gloo on CPU.
        mesh = init_device_mesh(cfg.device, (dist.get_world_size(),))
        # Moved by Module.to, not by fully_shard's in-place `param.data = ...`, which a device type
        # outside torch's own (PrivateUse1: the npu) refuses for a CPU parameter.
        model.to(mesh.device_type)
        fully_shard(model.vision, mesh=mesh)
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    experts = [p for block in model.blocks for p in block.experts.parameters()]
    routers = [block.router.weight for block in model.blocks]
    dense = [*model.adapter.parameters(), *model.embed.parameters(), *model.head.parameters()]
    mo = sc.MultiOptimizer(
        model,
        {
            "experts": torch.optim.AdamW(experts, lr=0.004, weight_decay=0.1),
            "dense": torch.optim.AdamW(
                [{"params": dense}, {"params": routers, "weight_decay": 0.0, "lr": 0.002}], lr=0.003
            ),
            "vision": torch.optim.AdamW(model.vision.parameters(), lr=VISION_LR),
        },
    )
    scheds: dict[str, LRScheduler] = {
        "experts": LinearLR(mo["experts"], start_factor=0.25, total_iters=max(1, cfg.steps // 2)),
        "dense": CosineAnnealingLR(mo["dense"], T_max=cfg.steps, eta_min=1e-4),
        "vision": LambdaLR(mo["vision"], VisionDecay(cfg.vision_milestones())),
    }
    return model, mo, scheds
