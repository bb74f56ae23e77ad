"""Slicing full (all-expert) tensors into one rank's EP x ETP shard, and the reverse index.

Expert e lives on EP rank e // (E / EP) as local expert e % (E / EP). Under ETP, rank j of the ETP group holds
rows [j*I/ETP, (j+1)*I/ETP) of each expert's gate and up projections (gate_up_proj keeps [gate slice; up slice])
and the same columns of down_proj.
"""

from __future__ import annotations

import torch


def shard_gate_up(full: torch.Tensor, ep: int, ep_rank: int, etp: int, etp_rank: int) -> torch.Tensor:
    """[E, 2I, D] -> [E/EP, 2I/ETP, D]."""
    experts, two_i, _ = full.shape
    local, inner = experts // ep, two_i // 2
    part = inner // etp
    sel = full[ep_rank * local : (ep_rank + 1) * local]
    rows = slice(etp_rank * part, (etp_rank + 1) * part)
    return torch.cat([sel[:, :inner][:, rows], sel[:, inner:][:, rows]], dim=1)


def shard_down(full: torch.Tensor, ep: int, ep_rank: int, etp: int, etp_rank: int) -> torch.Tensor:
    """[E, D, I] -> [E/EP, D, I/ETP]."""
    experts, _, inner = full.shape
    local, part = experts // ep, inner // etp
    return full[ep_rank * local : (ep_rank + 1) * local, :, etp_rank * part : (etp_rank + 1) * part]


def shard_state_dict(
    full: dict[str, torch.Tensor], ep: int, ep_rank: int, etp: int, etp_rank: int
) -> dict[str, torch.Tensor]:
    """A full native state dict -> this rank's (expert tensors sliced, everything else as is)."""
    out = {}
    for name, t in full.items():
        if name.endswith("experts.gate_up_proj"):
            out[name] = shard_gate_up(t, ep, ep_rank, etp, etp_rank).clone()
        elif name.endswith("experts.down_proj"):
            out[name] = shard_down(t, ep, ep_rank, etp, etp_rank).clone()
        else:
            out[name] = t
    return out
