"""Training-state bytes of one rank: weights, gradients, fp32 masters and Adam moments, as the engine holds them.

From exact parameter counts (`counts.py`) and the partition rule of DeepSpeed 0.19.8 as `glm53_ds.build_engine`
configures it: replicated tensors are partitioned over the engine's data-parallel group (WORLD / ETP ranks), expert
tensors over their expert-data-parallel group (WORLD / (EP x ETP)); frozen tensors (a LoRA run's base) hold their
weight only.

    weights      every held tensor in the training dtype (bf16: 2 bytes; the fp32-kept ones and buffers 4)
    gradients    trained tensors: ZeRO 0 / 1 a whole gradient in the training dtype, ZeRO 2 its partition; plus
                 the fp32 gradient of the rank's partition at the step (ZeRO 1 / 2) or of the whole master (bf16 at
                 stage 0: DeepSpeed's FP16_UnfusedOptimizer)
    masters      fp32 copies of the trained tensors' partitions (ZeRO >= 1), of the whole tensors (bf16 at stage
                 0); none for an fp32 stage-0 run (the weight is the master)
    moments      Adam's two fp32 moments of the partition (of the whole tensor at stage 0)
    fp32-kept    in a bf16 run, HF's fp32-kept tensors train outside DeepSpeed (engine/fp32_params.py):
                 a whole fp32 gradient and two moments on every rank

With ZeRO-Offload (`--offload-optimizer cpu`, ZeRO 1 / 2) the partition's fp32 master, its fp32 gradient and
the two moments live in host memory (`host_state_split`: pinned the master, the gradient and a copy of the
partition in the training dtype through which the updated weights return; pageable the moments); the GPU keeps the weights and, under ZeRO 1, the whole gradient
in the training dtype (ZeRO 2 copies each reduced bucket to the host: no gradient partition stays on the GPU).
The fp32-kept tensors' own optimizer stays on the GPU.
Reduction buckets are memory.py's; activations are activations.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .counts import ParameterCounts

GiB = 2**30


@dataclass(frozen=True)
class StateBytes:
    weights: int
    gradients: int
    masters: int
    moments: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.masters + self.moments

    def as_dict(self) -> dict[str, int]:
        return dict(asdict(self), total=self.total)


def _partitions(counts: ParameterCounts, world: int, ep: int, etp: int, bf16: bool) -> list[tuple[int, int]]:
    """(trained elements, padded partition elements) of each tensor kind DeepSpeed's optimizer holds."""
    groups = {"replicated": world // etp, "expert": world // (ep * etp)}
    kinds = ("replicated", "expert") + (() if bf16 else ("fp32_kept",))
    out = []
    for kind in kinds:
        trained = counts.trained[kind]
        group = groups["replicated" if kind == "fp32_kept" else kind]
        out.append((trained, -(-trained // group)))  # ceil: the padded partition
    return out


def host_state_split(
    counts: ParameterCounts,
    world: int,
    ep: int,
    etp: int,
    bf16: bool,
    zero_stage: int = 1,
    accumulating: bool = False,
) -> tuple[int, int]:
    """One rank's host memory under ZeRO-Offload as (pinned, pageable) bytes, DeepSpeed 0.19.8's `cpu_offload`
    buffers with `pin_memory` (a CUDA run): pinned per partition element the fp32 master, its fp32 gradient and
    the copy in the training dtype through which the updated weights return, and under ZeRO 2 with gradient
    accumulation (`accumulating`) the partition's gradients summed in the training dtype over the micro-batches;
    pageable the two fp32 Adam moments (DeepSpeedCPUAdam makes them with `zeros_like`)."""
    width = 2 if bf16 else 4
    pinned = 4 + 4 + width + (width if zero_stage == 2 and accumulating else 0)
    elements = partition_elements(counts, world, ep, etp, bf16)
    return pinned * elements, 8 * elements


def partition_elements(counts: ParameterCounts, world: int, ep: int, etp: int, bf16: bool) -> int:
    """The elements of one rank's optimizer partition (ZeRO 1 / 2): what its update touches."""
    return sum(part for _, part in _partitions(counts, world, ep, etp, bf16))


def state_bytes(
    counts: ParameterCounts, world: int, ep: int, etp: int, zero_stage: int, bf16: bool, offload: bool = False
) -> StateBytes:
    """One rank's training state on its GPU at the layout (`world` ranks, `ep` x `etp`), ZeRO `zero_stage`, bf16
    or fp32; `offload`: ZeRO-Offload (what moves to the host: `host_state_split`)."""
    if zero_stage not in (0, 1, 2):
        raise ValueError(f"ZeRO stage {zero_stage}: glm53_ds trains with stages 0, 1 and 2")
    if offload and zero_stage == 0:
        raise ValueError("ZeRO-Offload needs ZeRO 1 or 2")
    if world % (ep * etp):
        raise ValueError(f"world {world} is not a multiple of EP x ETP = {ep * etp}")
    width = 2 if bf16 else 4
    kept_held = counts.held("fp32_kept")
    weights = width * (counts.held("replicated") + counts.held("expert")) + 4 * (kept_held + counts.buffers)
    weights += counts.block_fp8 + 4 * counts.block_fp8_scales  # a frozen base kept in block-FP8
    gradients = masters = moments = 0
    for trained, part in _partitions(counts, world, ep, etp, bf16):
        if (
            offload
        ):  # ZeRO 1 keeps the whole gradient until the boundary; ZeRO 2 sends each bucket to the host
            gradients += width * trained if zero_stage == 1 else 0
            continue
        if zero_stage == 0:  # nothing partitioned; bf16: fp32 masters with their own gradients
            gradients += width * trained + (4 * trained if bf16 else 0)
            masters += 4 * trained if bf16 else 0
            moments += 8 * trained
            continue
        gradients += (width * trained if zero_stage == 1 else width * part) + 4 * part
        masters += 4 * part
        moments += 8 * part
    if bf16:  # the fp32-kept tensors' own optimizer, replicated
        gradients += 4 * counts.trained["fp32_kept"]
        moments += 8 * counts.trained["fp32_kept"]
    return StateBytes(weights, gradients, masters, moments)
