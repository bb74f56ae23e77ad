"""GLM-5.3 MoE block: router -> routed experts (dropless) + shared expert (a megatron dense MLP)."""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...parallel.expert_shard import ExpertShard
from ...parallel.moe_dispatch import ExpertParallelDispatch
from ...parallel.sequence import SequenceParallel
from ...transformer_config import Glm53TransformerConfig
from ..block_fp8 import SHARED, compute_like, mlp_linears
from ..forward_record import current_record
from ..linear import RowParallelLinearWithGroup
from ..token_tiles import over_token_tiles, tile_rows
from .experts import GroupedExperts
from .router import TopKRouter
from .token_permutation import RoutedTokens


class Glm53MoE(nn.Module):
    expert_load: torch.Tensor

    def __init__(
        self,
        config: Glm53TransformerConfig,
        pg_collection: ProcessGroupCollection | None = None,
        **unused: Any,
    ) -> None:
        super().__init__()
        cfg = config.glm
        self.router = TopKRouter(config)
        # Expert parallelism: sizes from megatron's standard config fields, groups from the pg_collection the
        # layer hands in (megatron's parallel_state groups when none is given, as megatron's own modules do).
        ep = config.expert_model_parallel_size
        etp = config.expert_tensor_parallel_size or 1
        ep_rank = etp_rank = 0
        if ep * etp > 1:
            if pg_collection is None:
                pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["ep", "expt_tp"])
            ep_rank, etp_rank = dist.get_rank(pg_collection.ep), dist.get_rank(pg_collection.expt_tp)
        shard = ExpertShard.for_config(cfg, ep, ep_rank, etp, etp_rank)
        self.experts = GroupedExperts(config, shard)
        self.dispatch = (
            ExpertParallelDispatch(shard, pg_collection.ep, pg_collection.expt_tp)
            if pg_collection is not None and ep * etp > 1
            else None
        )
        self.shared_experts: MLP | None = None
        if cfg.n_shared_experts > 0:
            # megatron's MLP sizes linear_fc2 from config.ffn_hidden_size, so give it a config of its own
            # (as megatron's SharedExpertMLP does).
            shared_config = copy.copy(config)
            shared_config.ffn_hidden_size = cfg.moe_intermediate_size * cfg.n_shared_experts
            fc1, fc2 = mlp_linears(config, SHARED) or (ColumnParallelLinear, RowParallelLinearWithGroup)
            self.shared_experts = MLP(
                shared_config,
                MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2),
                ffn_hidden_size=shared_config.ffn_hidden_size,
            )
        # Per-expert token counts of this rank's tokens, accumulated over training forwards until the load
        # balancer consumes them (parallel/router_balance.py): training state, not a forward output (a forward's
        # own counts and balance loss go to the open ForwardRecord).
        self.seq_aux_loss_coef = float(getattr(config, "moe_seq_aux_loss_coef", 0.0))
        self.tile_bytes = int(
            getattr(config, "moe_tile_bytes", 0)
        )  # 0: all of a micro-batch's tokens at once
        # under SP the balance loss's routing counts span the whole sequence (summed over the SP group)
        self.sequence = SequenceParallel.of(pg_collection)
        self.register_buffer(
            "expert_load", torch.zeros(cfg.n_routed_experts, dtype=torch.float32), persistent=False
        )

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, None]:
        """hidden_states [s, b, D] -> ([s, b, D], None)."""
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # [T, D]
        tile = self.tile_tokens()
        aux = None
        if tile < tokens.shape[0]:  # tiles of tokens, each recomputed in backward: one tile's peak
            routed, counts = self._tiled(tokens, tile)
        else:
            routed, counts, scores, expert_ids = self._route(tokens)
            # computed whether or not a record is open: a recompute in backward (after the record closed) must
            # run the same ops as the forward it replays
            if self.training and self.seq_aux_loss_coef > 0:
                aux = self._sequence_aux_loss(scores, expert_ids, hidden_states.shape[:2])
        if (record := current_record()) is not None:
            record.expert_loads.append(counts)
            if aux is not None:
                record.aux_losses.append(aux)
        if self.training:
            with torch.no_grad():
                self.expert_load += counts
        out = routed.view_as(hidden_states)
        if self.shared_experts is not None:
            shared = self.shared_experts
            rows = tile_rows(self.tile_bytes, hidden_states.shape[-1], shared.config.ffn_hidden_size,
                             hidden_states.element_size())  # fmt: skip
            out = out + over_token_tiles(lambda x: shared(x)[0], hidden_states, rows)
        return out, None

    def _route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [t, D] -> (their routed experts' weighted sum [t, D], tokens per expert [E], router scores,
        expert ids): router, the pairs sorted by expert once, the experts (through the EP dispatch)."""
        scores, weights, expert_ids = self.router(tokens)
        routing = RoutedTokens.sort(expert_ids, self.router.num_experts)
        if self.dispatch is None:
            routed = self.experts(tokens, expert_ids, weights, routing)
        else:
            routed = self.dispatch(self.experts, tokens, routing, weights)
        return routed, routing.counts, scores, expert_ids

    def tile_tokens(self) -> int:
        """Tokens per tile under `moe_tile_bytes` (a very large number when untiled): the tile's routed rows through
        one expert FFN (dispatched input, gate/up, activation, output) stay within the budget. The same on every
        rank of a layout, so every rank runs the same number of tiles (each tile's dispatch is a collective)."""
        if not self.tile_bytes:
            return 2**62
        d, i = self.experts.gate_up_proj.shape[-1], self.experts.intermediate
        # the activations' bytes (a weight kept in block-FP8 is 1 byte, its activations are the model's dtype)
        activation_bytes = compute_like(self.experts, self.experts.gate_up_proj).element_size()
        per_token = self.router.top_k * (2 * d + 3 * i) * activation_bytes
        return max(1, self.tile_bytes // per_token)

    def _tiled(self, tokens: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts over tiles of `tile` tokens (ALST's tiled MLP): with gradients each tile is a
        checkpoint, so its routing, dispatch and FFN activations live only while that tile runs, in forward and
        in backward. Each token is routed as it would be untiled (the router is token-wise)."""
        outs, counts = [], []
        for start in range(0, tokens.shape[0], tile):
            part = tokens[start : start + tile]
            if torch.is_grad_enabled():
                routed, n, _, _ = checkpoint(self._route, part, use_reentrant=False)
            else:
                routed, n, _, _ = self._route(part)
            outs.append(routed)
            counts.append(n)
        return torch.cat(outs), torch.stack(counts).sum(0)

    def _sequence_aux_loss(
        self, scores: torch.Tensor, expert_ids: torch.Tensor, s_b: torch.Size
    ) -> torch.Tensor:
        """DeepSeek-V3 sequence-wise balance loss: coef * mean_b sum_e f_{b,e} P_{b,e}, with
        f = E / (k S) * (tokens of sequence b routed to e), P = mean over the sequence of normalised scores.

        Under SP this rank holds s = S/N tokens of each sequence: f comes from the counts summed over the SP group
        (no gradient, as at SP = 1), P from this shard's scores over the whole length S. The shards' losses then
        add up to the whole sequence's loss, and their gradients too (the engine sums gradients over SP)."""
        s, b = s_b
        e, k = scores.shape[-1], expert_ids.shape[-1]
        length = s * (self.sequence.size if self.sequence is not None else 1)  # S
        probs = scores / scores.sum(-1, keepdim=True)  # [T, E]
        p = probs.view(s, b, e).sum(0) / length  # [b, E]: this shard's part of the mean over S
        counts = torch.zeros(b, e, device=scores.device, dtype=scores.dtype)
        seq = torch.arange(b, device=scores.device).repeat(s)[:, None].expand(-1, k)  # token t = (i, j) -> j
        counts.index_put_(
            (seq.reshape(-1), expert_ids.reshape(-1)),
            torch.ones_like(expert_ids, dtype=scores.dtype).reshape(-1),
            accumulate=True,
        )
        if self.sequence is not None:
            counts = self.sequence.sum_counts(counts)
        f = counts * (e / (k * length))
        return self.seq_aux_loss_coef * (f * p).sum(-1).mean()
