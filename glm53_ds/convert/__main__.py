"""`python -m glm53_ds.convert` / `glm53-convert`: hf-to-native, native-to-hf, native-to-peft, verify, describe."""

from __future__ import annotations

import argparse
import sys

import torch

from .describe import describe_checkpoint
from .export_adapter import native_to_peft
from .export_hf import native_to_hf
from .import_hf import hf_to_native
from .verify import verify

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="glm53-convert", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-native", help="released checkpoint -> training layout for --ep x --etp")
    a.add_argument("--hf-dir", required=True, help="the released checkpoint (config.json + safetensors)")
    a.add_argument(
        "--out", required=True, help="the native checkpoint directory to write (whole, or not at all)"
    )
    a.add_argument(
        "--ep", type=int, default=1, help="expert-parallel size the shards are cut for (default: 1)"
    )
    a.add_argument("--etp", type=int, default=1, help="expert-tensor-parallel size (default: 1)")
    a.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: keep each tensor's dtype")
    a.add_argument("--force", action="store_true", help="write into an existing non-empty --out (only the files "
                   "written are replaced)")  # fmt: skip
    b = sub.add_parser("native-to-hf", help="training checkpoint -> directory transformers loads")
    b.add_argument(
        "--ckpt", required=True, help="a training or converted checkpoint (its 'latest', a tag, or glm53/)"
    )
    b.add_argument("--out", required=True, help="the transformers directory to write (whole, or not at all)")
    b.add_argument(
        "--hf-template", default=None, help="released checkpoint to take vision tensors/config from"
    )
    b.add_argument("--tokenizer", default=None, help="'bytes' or a tokenizer directory whose files the export "
                   "carries (default: --hf-template's; the export is loadable by AutoTokenizer only with one)")  # fmt: skip
    b.add_argument("--force", action="store_true", help="write into an existing non-empty --out (only the files "
                   "written are replaced)")  # fmt: skip
    e = sub.add_parser(
        "native-to-peft", help="a LoRA checkpoint's adapters -> PEFT adapter of transformers' model"
    )
    e.add_argument("--ckpt", required=True, help="a LoRA run's checkpoint (its 'latest', a tag, or glm53/)")
    e.add_argument("--out", required=True, help="the adapter directory to write (adapter_config.json, "
                   "adapter_model.safetensors; whole, or not at all)")  # fmt: skip
    e.add_argument("--force", action="store_true", help="write into an existing non-empty --out (only the files "
                   "written are replaced)")  # fmt: skip
    c = sub.add_parser("verify", help="compare a released checkpoint and a native one")
    c.add_argument("--hf-dir", required=True, help="the released checkpoint")
    c.add_argument("--ckpt", required=True, help="the native checkpoint to compare with it, tensor by tensor")
    c.add_argument("--all", action="store_true", help="a row for every tensor, equal ones too (default: the "
                   "differing, missing and extra ones, then the verdict)")  # fmt: skip
    d = sub.add_parser("describe", help="a checkpoint's layout and contents, and whether it is complete")
    d.add_argument("ckpt", help="a training or converted checkpoint directory (follows 'latest')")
    d.add_argument("--tag", default=None, help="a tag instead of 'latest'")
    args = parser.parse_args(argv)
    try:
        if args.command == "hf-to-native":
            hf_to_native(args.hf_dir, args.out, ep=args.ep, etp=args.etp, dtype=DTYPES.get(args.dtype or ""),
                         force=args.force, progress=True)  # fmt: skip
        elif args.command == "native-to-hf":
            native_to_hf(args.ckpt, args.out, hf_template=args.hf_template, force=args.force, progress=True,
                         tokenizer=args.tokenizer)  # fmt: skip
            if not (args.tokenizer or args.hf_template):
                print(f"note: {args.out} carries no tokenizer (give --tokenizer DIR or --tokenizer bytes)")
        elif args.command == "native-to-peft":
            for notice in native_to_peft(args.ckpt, args.out, force=args.force):
                print(f"note: {notice}")
        elif args.command == "describe":
            return describe_checkpoint(args.ckpt, args.tag)
        else:
            return 0 if verify(args.hf_dir, args.ckpt, every_tensor=args.all) == 0.0 else 1
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
