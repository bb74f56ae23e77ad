"""The bytes one training step moves per group, and a step time from them and the FLOPs (`python -m glm53_ds.plan`).

Per rank and optimizer step, from the config, the layout and the run's options (t = micro x seq / SP tokens per
rank and micro-batch, A = the activation bytes, N = the group's ranks; "passes": the forward, the backward, and
the forward again where recompute repeats it: full recomputes every layer, selective the MoE):

    SP (Ulysses)     per KDA layer: q, k, v, the forget gate (fp32), beta and the output, each t x H x d, by
                     all-to-alls (N - 1) / N of them leave the rank, in every pass; per DSA layer (the sparse path:
                     split by query) the latent, the indexer's two key rows and the mask gathered ((N - 1) x the
                     rank's rows, forward passes), the latent's gradient reduce-scattered back (backward)
    EP (MoE)         per MoE layer: dispatch and combine of t x top-k rows of the hidden size, (EP - 1) / EP of
                     them to other ranks (whatever the routing, when every rank routes alike), in every pass; the
                     per-expert counts (int64)
    ETP              per MoE layer: the received rows gathered over ETP and the partial sums reduce-scattered
    gradients        replicated trained parameters over DeepSpeed's data-parallel group (the ranks of one ETP rank;
                     the world at ETP 1: `replicas`, else `DP`) after the engine's ETP pre-average (an all-reduce
                     over ETP), expert ones over expert-DP, all-reduced (2 (N - 1) / N of the bytes: DeepSpeed
                     0.19's ZeRO 1 / 2 reduce whole buckets, `use_multi_rank_bucket_allreduce` by default, and
                     keep their partition): ZeRO 2 at every micro-batch in fp32 (a bf16 run too), ZeRO 0 / 1 once
                     per step (a bf16 run in bf16, through BF16_Optimizer); under ZeRO 1 / 2 the updated weights
                     all-gathered ((N - 1) / N, in the weights' dtype); a bf16 run's fp32-kept parameters
                     all-reduced over the world once per step by the engine (engine/fp32_params.py)

On gloo (the CPU runs the model is checked against) a rows reduce-scatter is an all-reduce of the gathered rows:
`backend="gloo"` counts that. Ring algorithms are assumed (bytes leaving a rank: all-reduce 2 (N-1)/N, reduce-
scatter and all-gather (N-1)/N of the whole tensor, all-to-all the part for other ranks).

Under ZeRO-Offload (`--offload-optimizer cpu`) two more terms, per rank: `PCIe`, the gradient partition to the
host (in the training dtype; ZeRO 2 at every micro-batch, ZeRO 1 once) and the updated partition back, at `pcie`
GB/s per GPU; `host update`, DeepSpeedCPUAdam over the partition, the slower of its arithmetic (the node's
`host_cores` shared by its ranks, at `cpu_adam_rate` elements per second per core, measured by
benchmarks/cpu_adam.py) and its memory traffic (every rank of the node together, `HOST_ADAM_BYTES` per element plus
the copy in the training dtype, at `host_gbps` per node).

The time of a group's bytes: inside a node at `nvlink` (GB/s per GPU and direction); a group reaching several
nodes sends the share bound for other nodes at the node's network bandwidth divided by its GPUs (a ring's bytes all
cross the slowest link). The step: the FLOPs (flops.py) at `mfu` of `peak` plus every group's time, nothing
overlapped (DeepSpeed overlaps some gradient reduction with the backward; the all-to-alls sit on the critical path
of this implementation): an upper bound on time, a lower bound on tokens/s. The bounding term is the largest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..flops import H100_BF16_TFLOPS, step_flops
from ..parallel.rank_order import group_spans
from .counts import ParameterCounts
from .run import PlannedRun
from .state import partition_elements

# an H100 / H200 node: NVLink 4 (900 GB/s both directions per GPU), 8 x 400 Gb/s InfiniBand NDR per node
NVLINK_GBPS = 450.0
NETWORK_GBPS = 400.0
MFU = 0.35
# ZeRO-Offload's host side. The rate: benchmarks/cpu_adam.py, DeepSpeedCPUAdam at every core of the 2-core machine
# that measured it (at one thread, 1.25e9: one core alone had the socket's memory bandwidth to itself).
CPU_ADAM_RATE = 7.7e8  # elements per second per core
HOST_CORES = 112  # an H200 node (DGX H200): 2 x 56-core Xeon Platinum 8480C
HOST_GBPS = 500.0  # its memory: 2 sockets x 8 channels of DDR5-4800 (614 GB/s), at about 80%
PCIE_GBPS = 50.0  # per GPU and direction: PCIe 5 x16 (64 GB/s), pinned buffers
HOST_ADAM_BYTES = (
    4 + 4 + 4 + 8 + 8
)  # per element: the fp32 master read and written, its gradient read, two moments


@dataclass
class Traffic:
    """Bytes leaving one rank per optimizer step, by group kind (`SP`, `EP`, `ETP`, `replicas`, `expert DP`) and
    by what moves them."""

    by_group: dict[str, float] = field(default_factory=dict)
    by_item: dict[str, float] = field(default_factory=dict)

    def add(self, group: str, item: str, nbytes: float) -> None:
        if nbytes:
            self.by_group[group] = self.by_group.get(group, 0.0) + nbytes
            self.by_item[f"{group}: {item}"] = self.by_item.get(f"{group}: {item}", 0.0) + nbytes

    @property
    def total(self) -> float:
        return sum(self.by_group.values())


def _layers(run: PlannedRun) -> tuple[int, int, int]:
    """(KDA, DSA, MoE) layers per forward, the MTP layer's counted (an MLA attention and an MoE: docs/mtp.md)."""
    cfg = run.model
    mtp = cfg.num_nextn_predict_layers
    kda = sum(t == "linear_attention" for t in cfg.layer_types)
    dsa = sum(t != "linear_attention" for t in cfg.layer_types) + mtp
    moe = sum(t == "sparse" for t in cfg.mlp_layer_types) + mtp
    return kda, dsa, moe


def micro_batches(run: PlannedRun) -> int:
    """Micro-batches per rank and optimizer step (gradient accumulation)."""
    c = run.config
    data_world = run.world // c.sp
    return max(
        1, (c.global_batch_size or c.micro_batch_size * data_world) // (c.micro_batch_size * data_world)
    )


def step_traffic(run: PlannedRun, counts: ParameterCounts, backend: str = "nccl") -> Traffic:
    """The bytes leaving one rank in one optimizer step (module docstring)."""
    c, cfg, out = run.config, run.model, Traffic()
    act = 2 if run.bf16 else 4
    micro = micro_batches(run)
    t = c.micro_batch_size * c.seq_length // c.sp  # tokens per rank and micro-batch
    kda, dsa, moe = _layers(run)
    attention_passes = 3 if c.recompute == "full" else 2
    forward_passes = attention_passes - 1
    moe_passes = 2 if c.recompute == "none" else 3
    if c.sp > 1:
        n = c.sp
        share = (n - 1) / n
        h, d = cfg.linear_num_heads, cfg.linear_head_dim
        per_kda = t * h * (3 * d * act + d * 4 + act + d * act)  # q, k, v; forget gate (fp32); beta; output
        out.add("SP", "KDA all-to-alls", micro * kda * attention_passes * per_kda * share)
        latent = t * cfg.kv_lora_rank * act
        gathered = latent + 2 * t * cfg.index_head_dim * act + t  # + the indexer's keys, the mask (bool)
        out.add("SP", "DSA gathers", micro * dsa * forward_passes * (n - 1) * gathered)
        back = 2 * (n - 1) * latent if backend == "gloo" else (n - 1) * latent  # all-reduce of n rows on gloo
        out.add("SP", "DSA latent gradient", micro * dsa * back)
    rows = t * cfg.num_experts_per_tok * cfg.hidden_size * act  # one rank's routed rows
    if c.ep > 1:
        share = (c.ep - 1) / c.ep
        out.add("EP", "MoE dispatch and combine", micro * moe * moe_passes * 2 * rows * share)
        out.add("EP", "MoE counts", micro * moe * forward_passes * cfg.n_routed_experts * 8 * share)
    if c.etp > 1:
        n = c.etp
        out.add("ETP", "MoE rows gathered", micro * moe * moe_passes * (n - 1) * rows)
        reduced = 2 * (n - 1) * rows if backend == "gloo" else (n - 1) * rows
        out.add("ETP", "MoE partial sums", micro * moe * moe_passes * reduced)
    world = run.world
    # The gradients' bytes as DeepSpeed 0.19 moves them (measured: benchmarks/network_bytes.py): ZeRO 2 reduces
    # at every micro-batch's backward, in fp32 also in a bf16 run; ZeRO 0 / 1 once per step, a bf16 run through
    # its BF16_Optimizer in bf16 (whose ETP pre-average sees the fp32 accumulators); the fp32-kept parameters of a
    # bf16 run are the engine's own, all-reduced over the world once per step (engine/fp32_params.py).
    comm = 4 if not run.bf16 or run.zero == 2 else 2
    pre_average = 4 if run.bf16 and run.zero < 2 else comm
    reductions = micro if run.zero == 2 else 1
    kept = counts.trained["fp32_kept"] * 4
    replicated_elements = counts.trained["replicated"] + (0 if run.bf16 else counts.trained["fp32_kept"])
    # DeepSpeed reduces the replicated gradients over its data-parallel group (the ranks of one ETP rank: the
    # world when ETP = 1), the engine's patch first averages them over ETP; the expert ones over expert-DP
    dp = "replicas" if c.etp == 1 else "DP"
    for group, elements, n in ((dp, replicated_elements, world // c.etp),
                               ("expert DP", counts.trained["expert"], world // (c.ep * c.etp))):  # fmt: skip
        if n > 1:
            out.add(group, "gradients all-reduced", reductions * 2 * (n - 1) / n * elements * comm)
            if run.zero > 0:  # each rank's updated partition of the weights gathered
                out.add(group, f"weights all-gathered (ZeRO {run.zero})", (n - 1) / n * elements * act)
    if run.bf16 and world > 1:
        out.add("replicas", "fp32-kept gradients", 2 * (world - 1) / world * kept)
    if c.etp > 1:
        out.add(
            "ETP",
            "replicated gradients",
            reductions * 2 * (c.etp - 1) / c.etp * replicated_elements * pre_average,
        )
    return out


@dataclass
class StepTime:
    compute_s: float
    groups_s: dict[str, float]
    tokens_per_s_per_gpu: float
    bound: str
    host_s: dict[str, float] = field(default_factory=dict)  # ZeRO-Offload: "PCIe", "host update"

    @property
    def total_s(self) -> float:
        return self.compute_s + sum(self.groups_s.values()) + sum(self.host_s.values())


def offload_times(
    run: PlannedRun, counts: ParameterCounts, ranks_on_node: int, pcie_gbps: float = PCIE_GBPS,
    host_cores: int = HOST_CORES, host_gbps: float = HOST_GBPS, cpu_adam_rate: float = CPU_ADAM_RATE,
) -> dict[str, float]:  # fmt: skip
    """Seconds per step of ZeRO-Offload's copies and host update for one rank (module docstring); {} without it."""
    if run.config.offload_optimizer != "cpu":
        return {}
    c, width = run.config, 2 if run.bf16 else 4
    elements = partition_elements(counts, run.world, c.ep, c.etp, run.bf16)
    to_host = elements * width * (micro_batches(run) if run.zero == 2 else 1)
    arithmetic = elements / (cpu_adam_rate * host_cores / ranks_on_node)
    traffic = ranks_on_node * elements * (HOST_ADAM_BYTES + width) / (host_gbps * 1e9)
    return {"PCIe": (to_host + elements * width) / (pcie_gbps * 1e9), "host update": max(arithmetic, traffic)}


def step_time(
    run: PlannedRun,
    traffic: Traffic,
    node: Sequence[int],
    nvlink_gbps: float = NVLINK_GBPS,
    network_gbps: float = NETWORK_GBPS,
    mfu: float = MFU,
    peak_tflops: float = H100_BF16_TFLOPS,
    host_s: dict[str, float] | None = None,
) -> StepTime:
    """The step's time (module docstring): `node[r]` is rank r's node; `host_s`: ZeRO-Offload's terms
    (`offload_times`)."""
    c = run.config
    per_node = max(list(node).count(n) for n in set(node))
    spans = {s.name: s for s in group_spans(node, c.ep, c.etp, c.sp)}
    flops = step_flops(run.model, c.seq_length, mtp=run.model.num_nextn_predict_layers > 0,
                       base_trained=not c.lora_rank)  # fmt: skip
    tokens_per_gpu = micro_batches(run) * c.micro_batch_size * c.seq_length * (run.world // c.sp) / run.world
    compute = flops.per_token * tokens_per_gpu / (peak_tflops * 1e12 * mfu)
    groups: dict[str, float] = {}
    for group, nbytes in traffic.by_group.items():
        span = spans.get(group)
        if span is None or span.nodes == 1:
            groups[group] = nbytes / (nvlink_gbps * 1e9)
            continue
        per_gpu_network = network_gbps * 1e9 / per_node
        if group in ("replicas", "DP", "expert DP"):  # rings: every byte through the slowest link
            groups[group] = nbytes / per_gpu_network
        else:  # all-to-alls and gathers: the peers on other nodes get their share over the network
            off_node = (span.size - span.size // span.nodes) / max(span.size - 1, 1)
            groups[group] = max(
                nbytes * off_node / per_gpu_network, nbytes * (1 - off_node) / (nvlink_gbps * 1e9)
            )
    terms = {"compute": compute, **groups, **(host_s or {})}
    total = sum(terms.values())
    return StepTime(compute, groups, tokens_per_gpu / total if total else 0.0, max(terms, key=lambda k: terms[k]),
                    dict(host_s or {}))  # fmt: skip
