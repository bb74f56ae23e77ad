"""Conversion throughput and peak memory: hf-to-native (EP2 x ETP2) and native-to-hf on a synthetic checkpoint,
each in its own process (peak RSS over that process's import baseline).

    python3 benchmarks/convert.py [--experts 64] [--layers 12] [--hidden 128]

Last line: `convert hf_to_native_MBps=<x> native_to_hf_MBps=<y> peak_extra_MiB=<max of both>`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.measure import print_table, write_results  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_RUN = """
import json, resource, sys, time
import glm53_ds.model
from glm53_ds.convert import hf_to_native, native_to_hf
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if sys.argv[1] == "hf-to-native":
    hf_to_native(sys.argv[2], sys.argv[3], ep=2, etp=2, shard_bytes=64 << 20)
else:
    native_to_hf(sys.argv[2], sys.argv[3], shard_bytes=64 << 20)
seconds = time.perf_counter() - start
print(json.dumps(dict(seconds=seconds, extra_kib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)))
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=128)
    args = parser.parse_args()
    from tests.model_fixtures import CONFIG_A, save_tiny_hf

    n = args.layers
    text = dict(CONFIG_A, hidden_size=args.hidden, moe_intermediate_size=args.hidden, intermediate_size=2 * args.hidden,
                n_routed_experts=args.experts, num_hidden_layers=n, layer_types=(CONFIG_A["layer_types"] * n)[:n],
                indexer_types=(CONFIG_A["indexer_types"] * n)[:n], mlp_layer_types=["dense"] * 2 + ["sparse"] * (n - 2))  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        save_tiny_hf(os.path.join(tmp, "hf"), text)
        size = sum(
            os.path.getsize(os.path.join(tmp, "hf", f))
            for f in os.listdir(os.path.join(tmp, "hf"))
            if f.endswith(".safetensors")
        )
        rows = []
        for step, src, dst in (("hf-to-native", "hf", "native"), ("native-to-hf", "native", "hf2")):
            out = subprocess.run([sys.executable, "-c", _RUN, step, os.path.join(tmp, src), os.path.join(tmp, dst)],
                                 cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]  # fmt: skip
            r = json.loads(out)
            rows.append(dict(step=step, MiB=size / 2**20, seconds=r["seconds"], MBps=size / 1e6 / r["seconds"],
                             peak_extra_MiB=r["extra_kib"] / 1024))  # fmt: skip
    print_table(rows, ["step", "MiB", "seconds", "MBps", "peak_extra_MiB"])
    summary = dict(hf_to_native_MBps=rows[0]["MBps"], native_to_hf_MBps=rows[1]["MBps"],
                   peak_extra_MiB=max(r["peak_extra_MiB"] for r in rows))  # fmt: skip
    path = write_results("convert_cpu", dict(rows=rows, summary=summary))
    print(f"results: {path}")
    print("convert " + " ".join(f"{k}={v:.1f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
