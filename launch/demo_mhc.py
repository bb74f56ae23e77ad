"""Short demo until `launch/train.py` lands: a byte-level model whose residual is the mHC stream set.

embedding -> expand_streams(hc_mult) -> N x [HyperConnection -> RMSNorm -> causal mixer -> hc_post,
HyperConnection -> RMSNorm -> SwiGLU MLP -> hc_post] -> hc_head -> RMSNorm -> logits,
trained with AdamW on windows of `data/tiny_corpus.txt`. It prints a falling loss and exits non-zero if the
loss did not fall. Runs on CPU (eager hc_post) or CUDA (fused Triton hc_post).

    python3 launch/demo_mhc.py [--steps 80] [--hc-mult 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from glm53_ds.mhc import HyperConnection, expand_streams, hc_head, hc_post  # noqa: E402

CORPUS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tiny_corpus.txt")


class CausalMixer(nn.Module):
    """A cheap stand-in for attention: a causal depthwise convolution over the previous tokens."""

    def __init__(self, hidden: int, width: int = 8) -> None:
        super().__init__()
        self.width = width
        self.conv = nn.Conv1d(hidden, hidden, width, groups=hidden, bias=False)
        self.proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [b, s, D]
        y = self.conv(F.pad(x.transpose(1, 2), (self.width - 1, 0))).transpose(1, 2)
        return self.proj(F.silu(y))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False)
        self.down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class MhcBlock(nn.Module):
    def __init__(self, hidden: int, hc_mult: int, eps: float) -> None:
        super().__init__()
        self.attn_hc = HyperConnection(hidden, hc_mult, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=eps)
        self.ffn_hc = HyperConnection(hidden, hc_mult, hc_eps=1e-6, sinkhorn_iters=20, norm_eps=eps)
        self.attn_norm = nn.RMSNorm(hidden, eps=eps)
        self.ffn_norm = nn.RMSNorm(hidden, eps=eps)
        self.mixer = CausalMixer(hidden)
        self.mlp = SwiGLU(hidden, 4 * hidden)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:  # [b, s, n, D]
        collapsed, post, comb = self.attn_hc(streams)
        streams = hc_post(self.mixer(self.attn_norm(collapsed)), streams, post, comb)
        collapsed, post, comb = self.ffn_hc(streams)
        return hc_post(self.mlp(self.ffn_norm(collapsed)), streams, post, comb)


class ByteModel(nn.Module):
    def __init__(self, hidden: int, layers: int, hc_mult: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.hc_mult = hc_mult
        self.embed = nn.Embedding(256, hidden)
        self.blocks = nn.ModuleList(MhcBlock(hidden, hc_mult, eps) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=eps)
        self.head = nn.Linear(hidden, 256, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        streams = expand_streams(self.embed(tokens), self.hc_mult)  # [b, s, D] -> [b, s, n, D]
        for block in self.blocks:
            streams = block(streams)
        return self.head(self.norm(hc_head(streams)))  # [b, s, 256]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hc-mult", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    with open(CORPUS, "rb") as f:
        data = torch.tensor(list(f.read()), dtype=torch.long)
    if data.numel() <= args.seq_length + 1:
        raise SystemExit(f"corpus {CORPUS} has {data.numel()} bytes; need more than --seq-length + 1")

    model = ByteModel(args.hidden, args.layers, args.hc_mult).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    generator = torch.Generator().manual_seed(args.seed)
    print(
        f"mHC byte model: {sum(p.numel() for p in model.parameters()):,} parameters, hc_mult={args.hc_mult}"
    )

    losses: list[float] = []
    start = time.time()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, data.numel() - args.seq_length - 1, (args.batch_size,), generator=generator)
        window = torch.stack([data[s : s + args.seq_length + 1] for s in starts.tolist()]).to(device)
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), window[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - start:.1f}s)")

    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"mean loss first 5 steps {first:.4f} -> last 5 steps {last:.4f}")
    if not last < first:
        print("loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
