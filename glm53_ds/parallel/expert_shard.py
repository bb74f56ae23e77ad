"""`ExpertShard`: which part of the routed experts one rank holds under EP x ETP. The one statement of the rule.

With E routed experts of intermediate size I, EP expert-parallel ranks and ETP expert-tensor-parallel ranks:
  - expert e lives on EP rank e // (E / EP), as local expert e % (E / EP);
  - ETP rank j holds rows [j * I/ETP, (j + 1) * I/ETP) of each of its experts' gate and up projections and the
    same columns of the down projection.
Native grouped tensors (`layers/moe/experts.py`): `gate_up_proj [E, 2I, D]` (gate rows, then up rows) and
`down_proj [E, D, I]`; a shard holds `[E/EP, 2I/ETP, D]` (its gate slice, then its up slice) and `[E/EP, D, I/ETP]`.
The loader, both converter directions, the MoE dispatcher, checkpoints and tests all go through this type;
checkpoint reads restate it as boxes of the global tensor (`checkpoint/placement.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import overload

import torch

GATE_UP = "gate_up_proj"
DOWN = "down_proj"


def expert_tensor_kind(name: str) -> str | None:
    """`gate_up_proj` / `down_proj` for a native grouped-expert tensor name, else None."""
    for kind in (GATE_UP, DOWN):
        if name.endswith(f"experts.{kind}"):
            return kind
    return None


@dataclass(frozen=True)
class ExpertShard:
    n_experts: int
    intermediate: int  # moe_intermediate_size of one whole expert
    ep: int = 1
    ep_rank: int = 0
    etp: int = 1
    etp_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_experts % self.ep:
            raise ValueError(f"n_routed_experts ({self.n_experts}) is not divisible by EP={self.ep}")
        if self.intermediate % self.etp:
            raise ValueError(
                f"moe_intermediate_size ({self.intermediate}) is not divisible by ETP={self.etp}"
            )
        if not (0 <= self.ep_rank < self.ep and 0 <= self.etp_rank < self.etp):
            raise ValueError(
                f"shard rank (EP {self.ep_rank}, ETP {self.etp_rank}) outside EP={self.ep} x ETP={self.etp}"
            )

    @classmethod
    def for_config(
        cls, cfg: object, ep: int = 1, ep_rank: int = 0, etp: int = 1, etp_rank: int = 0
    ) -> ExpertShard:
        """The shard of a `Glm53Config` (anything with n_routed_experts / moe_intermediate_size)."""
        return cls(cfg.n_routed_experts, cfg.moe_intermediate_size, ep, ep_rank, etp, etp_rank)  # type: ignore[attr-defined]

    def all_shards(self) -> Iterator[ExpertShard]:
        """Every shard of this layout, EP rank major."""
        for ep_rank in range(self.ep):
            for etp_rank in range(self.etp):
                yield self.at(ep_rank, etp_rank)

    def at(self, ep_rank: int, etp_rank: int) -> ExpertShard:
        return ExpertShard(self.n_experts, self.intermediate, self.ep, ep_rank, self.etp, etp_rank)

    # ------------------------------------------------------------------ experts
    @property
    def num_local(self) -> int:
        return self.n_experts // self.ep

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local

    @property
    def local_experts(self) -> range:
        return range(self.first_expert, self.first_expert + self.num_local)

    @overload
    def owner(self, expert: int) -> int: ...
    @overload
    def owner(self, expert: torch.Tensor) -> torch.Tensor: ...
    def owner(self, expert: int | torch.Tensor) -> int | torch.Tensor:
        """The EP rank holding `expert` (an int or an id tensor)."""
        return expert // self.num_local

    def owns(self, expert: int) -> bool:
        return self.owner(expert) == self.ep_rank

    @overload
    def local_index(self, expert: int) -> int: ...
    @overload
    def local_index(self, expert: torch.Tensor) -> torch.Tensor: ...
    def local_index(self, expert: int | torch.Tensor) -> int | torch.Tensor:
        """Index of `expert` among its EP rank's local experts."""
        return expert % self.num_local

    # ------------------------------------------------------------------ the intermediate dimension
    @property
    def local_intermediate(self) -> int:
        return self.intermediate // self.etp

    @property
    def rows(self) -> slice:
        """This ETP rank's rows of one expert's gate (or up) projection, columns of its down projection."""
        part = self.local_intermediate
        return slice(self.etp_rank * part, (self.etp_rank + 1) * part)

    # ------------------------------------------------------------------ one released expert tensor
    def slice_gate(self, gate: torch.Tensor) -> torch.Tensor:
        """A whole expert's gate or up projection [I, D] -> this shard's rows [I/ETP, D]."""
        return gate[self.rows]

    def slice_down(self, down: torch.Tensor) -> torch.Tensor:
        """A whole expert's down projection [D, I] -> this shard's columns [D, I/ETP]."""
        return down[:, self.rows]

    def gate_up_rows(self, kind: str) -> slice:
        """Where a sliced gate (kind 'gate_proj') or up ('up_proj') projection sits in the shard's gate_up rows."""
        part = self.local_intermediate
        start = 0 if kind == "gate_proj" else part
        return slice(start, start + part)

    # ------------------------------------------------------------------ grouped native tensors
    def shard(self, kind: str, full: torch.Tensor) -> torch.Tensor:
        """A full grouped tensor (`gate_up_proj [E, 2I, D]` or `down_proj [E, D, I]`) -> this shard's part."""
        sel = full[self.first_expert : self.first_expert + self.num_local]
        if kind == DOWN:
            return sel[:, :, self.rows]
        if kind != GATE_UP:
            raise ValueError(f"unknown expert tensor kind {kind!r}")
        inner = full.shape[1] // 2
        return torch.cat([sel[:, :inner][:, self.rows], sel[:, inner:][:, self.rows]], dim=1)

    def shard_state_dict(self, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A full native state dict -> this shard's (grouped expert tensors sliced, everything else as is)."""
        out = {}
        for name, tensor in full.items():
            kind = expert_tensor_kind(name)
            out[name] = tensor if kind is None else self.shard(kind, tensor).clone()
        return out


def balanced_split(n: int, parts: int) -> list[int]:
    """`n` rows over `parts` as evenly as possible: the routing a shape-only (meta) run assumes, having no counts
    to read."""
    return [n // parts + (i < n % parts) for i in range(parts)]
