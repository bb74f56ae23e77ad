"""Several "nodes" on one Linux machine, for trying a multi-node launch without a cluster (as root).

Each node is a network namespace with its own address on a link the tool makes (a veth pair for two nodes, a
bridge in a namespace of its own for more), a UTS namespace (its own host name, which no resolver knows: as on a
cluster whose /etc/hosts maps it to loopback, gloo cannot find the network from it), a PID namespace and a mount
namespace with its own /dev/shm. The addresses live only on those links; nothing is routed out of them, and
`down` (or the end of `run`) removes every namespace and link it made.

    python tools/fake_nodes.py run --nodes 2 -- deepspeed --hostfile {hostfile} --no_ssh --node_rank {node} \\
        --master_addr {master} --master_port 29600 launch/train.py --ep 2
    python tools/fake_nodes.py down --name glm53n

`run` starts the command in every node at once (`{node}`, `{master}`, `{hostfile}`, `{address}` substituted; the
hostfile lists `node<k> slots=<--slots>`), prints each node's output prefixed with its name, and exits with the
first non-zero status (all of them stopped then).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

SUBNET = "10.231.{}.{}"  # a private range, only on the links made here


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class FakeNodes:
    """`count` nodes named `node0..`, namespaces `<name>-<k>`; `address(k)` is node k's address."""

    count: int
    name: str = "glm53n"
    subnet: int = 231
    made: list[str] = field(default_factory=list)

    def address(self, k: int) -> str:
        return f"10.{self.subnet}.0.{k + 1}"

    def namespace(self, k: int) -> str:
        return f"{self.name}-{k}"

    def up(self) -> FakeNodes:
        """Make the namespaces and their link (RuntimeError naming why when this machine does not permit it)."""
        try:
            for k in range(self.count):
                _ip("netns", "add", self.namespace(k))
                self.made.append(self.namespace(k))
                _ip("-n", self.namespace(k), "link", "set", "lo", "up")
            if self.count == 2:
                a, b = (f"{self.name}{k}v" for k in range(2))
                _ip("link", "add", a, "type", "veth", "peer", "name", b)
                for k, end in enumerate((a, b)):
                    _ip("link", "set", end, "netns", self.namespace(k))
            else:
                hub = f"{self.name}-hub"
                _ip("netns", "add", hub)
                self.made.append(hub)
                _ip("-n", hub, "link", "add", "br0", "type", "bridge")
                _ip("-n", hub, "link", "set", "br0", "up")
                for k in range(self.count):
                    end = f"{self.name}{k}v"
                    _ip("link", "add", end, "type", "veth", "peer", "name", f"{end}h")
                    _ip("link", "set", end, "netns", self.namespace(k))
                    _ip("link", "set", f"{end}h", "netns", hub)
                    _ip("-n", hub, "link", "set", f"{end}h", "master", "br0")
                    _ip("-n", hub, "link", "set", f"{end}h", "up")
            for k in range(self.count):
                end = f"{self.name}{k}v"
                _ip("-n", self.namespace(k), "addr", "add", f"{self.address(k)}/24", "dev", end)
                _ip("-n", self.namespace(k), "link", "set", end, "up")
        except (subprocess.CalledProcessError, FileNotFoundError) as e:
            self.down()
            why = e.stderr.strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
            raise RuntimeError(f"network namespaces are not permitted here ({why or e})") from None
        return self

    def down(self) -> None:
        """Remove every namespace made (their links with them)."""
        for namespace in reversed(self.made):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        self.made.clear()

    def command(self, k: int, argv: Sequence[str], local: Sequence[str] = ()) -> list[str]:
        """`argv` run as node k: its network, host name `node<k>`, PID namespace and its own /dev/shm; each path of
        `local` (existing directories) replaced by an empty one of this node only (a node-local mount)."""
        mounts = "".join(f"mount -t tmpfs tmpfs {shlex.quote(p)} && " for p in local)
        inner = (f"hostname node{k} && mount -t tmpfs -o size=2g tmpfs /dev/shm && {mounts}exec "
                 + " ".join(shlex.quote(a) for a in argv))  # fmt: skip
        return ["ip", "netns", "exec", self.namespace(k), "unshare", "--uts", "--pid", "--fork", "--mount-proc",
                "--propagation", "private", "sh", "-c", inner]  # fmt: skip

    def hostfile(self, directory: str, slots: int) -> str:
        path = os.path.join(directory, "hostfile")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(f"node{k} slots={slots}\n" for k in range(self.count))
        return path

    def __enter__(self) -> FakeNodes:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()


def _relay(name: str, stream: object) -> None:
    for line in stream:  # type: ignore[attr-defined]
        sys.stdout.write(f"[{name}] {line}")
        sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="make the nodes, run the command in each, remove them")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--slots", type=int, default=2)
    run.add_argument("--name", default="glm53n")
    run.add_argument("command", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="remove the namespaces a killed `run` left")
    down.add_argument("--name", default="glm53n")
    down.add_argument("--nodes", type=int, default=8)
    args = parser.parse_args()
    if args.what == "down":
        nodes = FakeNodes(args.nodes, args.name)
        nodes.made = [nodes.namespace(k) for k in range(args.nodes)] + [f"{args.name}-hub"]
        nodes.down()
        return 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    with FakeNodes(args.nodes, args.name) as nodes, tempfile.TemporaryDirectory() as tmp:
        hostfile = nodes.hostfile(tmp, args.slots)
        procs = []
        for k in range(args.nodes):
            argv = [a.format(node=k, master=nodes.address(0), hostfile=hostfile, address=nodes.address(k))
                    for a in command]  # fmt: skip
            proc = subprocess.Popen(nodes.command(k, argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)  # fmt: skip
            threading.Thread(target=_relay, args=(f"node{k}", proc.stdout), daemon=True).start()
            procs.append(proc)
        codes = [p.wait() for p in procs]
    return next((c for c in codes if c), 0)


if __name__ == "__main__":
    sys.exit(main())
