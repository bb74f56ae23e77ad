"""`python -m glm53_ds.plan`: one rank's training-state memory for a model config and layout.

    python -m glm53_ds.plan --model-config glm-5.3-flash --world 64 --ep 32 --etp 2 --zero 2 [--lora-rank 16]
        [--fp32] [--gpu-memory 141GB] [--json]

Prints the parameters one rank holds by kind (exact: the model built on the meta device), the bytes of weights,
gradients, fp32 masters and Adam moments, and the total against --gpu-memory. Activations, the loss head and
communication buffers are not modelled yet: the remaining memory is what they may use.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings

from ..config import Glm53Config
from ..training.presets import PRESETS, preset
from .counts import KINDS, count_parameters
from .state import GiB, state_bytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'141GB', '80GiB', '141e9' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS:
        raise ValueError(f"--gpu-memory {text!r}: expected a size such as 141GB or 80GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m glm53_ds.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--model-config", default="glm-5.3-flash", help=f"a preset ({', '.join(PRESETS)}) or a "
                   "config.json (default: glm-5.3-flash)")  # fmt: skip
    p.add_argument("--world", type=int, required=True, help="ranks (GPUs)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=1)
    p.add_argument("--zero", type=int, default=1, choices=[0, 1, 2], help="ZeRO stage (default: 1)")
    p.add_argument("--fp32", action="store_true", help="fp32 training (default: bf16)")
    p.add_argument("--lora-rank", type=int, default=0, help="a LoRA run of this rank (0: full fine-tuning)")
    p.add_argument("--no-mtp", action="store_true", help="without the MTP layer")
    p.add_argument("--gpu-memory", default="141GB", help="memory of one GPU (default: 141GB, an H200)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)  # megatron's notices about optional kernels
    try:
        cfg = (
            preset(args.model_config)
            if args.model_config in PRESETS
            else Glm53Config.from_hf(args.model_config)
        )
        gpu = parse_bytes(args.gpu_memory)
        counts = count_parameters(cfg, args.ep, args.etp, lora_rank=args.lora_rank, mtp=not args.no_mtp)
        state = state_bytes(counts, args.world, args.ep, args.etp, args.zero, bf16=not args.fp32)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {
        "model": args.model_config, "world": args.world, "ep": args.ep, "etp": args.etp, "zero": args.zero,
        "dtype": "fp32" if args.fp32 else "bf16", "lora_rank": args.lora_rank,
        "parameters": {"total": counts.total, "active": counts.active, "trained": counts.trained,
                       "frozen": counts.frozen, "buffers": counts.buffers},
        "bytes_per_rank": state.as_dict(), "gpu_memory": gpu, "left_for_activations": gpu - state.total,
    }  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return 0
    adapters = " with the LoRA adapters" if args.lora_rank else ""
    print(f"{args.model_config}: {counts.total:,} parameters{adapters} ({counts.active:,} active per token); world "
          f"{args.world}, EP {args.ep}, ETP {args.etp}, ZeRO {args.zero}, {result['dtype']}"
          f"{f', LoRA rank {args.lora_rank}' if args.lora_rank else ''}")  # fmt: skip
    print("per rank, parameters held (trained / frozen):")
    for kind in KINDS:
        print(f"  {kind:<11} {counts.trained[kind]:>16,} / {counts.frozen[kind]:,}")
    print("per rank, training state:")
    for key, value in state.as_dict().items():
        print(f"  {key:<11} {value / GiB:10.2f} GiB")
    verdict = "fits" if state.total < gpu else "does NOT fit"
    print(f"training state {state.total / GiB:.2f} GiB of {gpu / GiB:.2f} GiB: {verdict}; "
          f"{max(0, gpu - state.total) / GiB:.2f} GiB left for activations, the loss head and communication "
          "buffers (not modelled yet)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
