"""What a run across nodes needs of its hosts before the process group exists.

- The network interface of the collectives. gloo binds to the address its host name resolves to, and a host name
  mapped to a loopback address (the commonest `/etc/hosts` of a cluster node or container) makes every rank offer
  127.0.0.1 to the others: a minute of retries and a 30-line `connectFullMesh failed` traceback, or no progress at
  all. Unless the user named one (`GLOO_SOCKET_IFNAME`, `NCCL_SOCKET_IFNAME`), the interface this host uses to
  reach `MASTER_ADDR` is taken (the kernel's route: a UDP socket connected to it sends nothing), said in one line
  per node; where there is none, one line names the address and the variables to set.
- `.deepspeed_env` (in `~` and `.`, DeepSpeed's `DS_ENV_FILE`): DeepSpeed's launcher exports its variables only
  when it starts the nodes over ssh; under `--no_ssh` (one launcher per node: Kubernetes, Slurm) it is applied here,
  the same way, and said.

Nothing here imports DeepSpeed; `engine/build.init_distributed` calls it for a world that may span nodes
(`may_span_nodes`).
"""

from __future__ import annotations

import ipaddress
import os
import socket

DEEPSPEED_ENV_PATHS = (os.path.expanduser("~"), ".")  # DeepSpeed's launcher's DEEPSPEED_ENVIRONMENT_PATHS


def _int_env(*names: str) -> int | None:
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def may_span_nodes() -> bool:
    """Whether this world may hold ranks of several hosts: DeepSpeed's launcher says so (CROSS_SIZE), or the ranks
    per node (LOCAL_SIZE, torchrun's LOCAL_WORLD_SIZE) are fewer than WORLD_SIZE, or, where a launcher says neither
    (one process per GPU from `srun` or a wrapper), a world of several ranks meets at an address that is not
    loopback."""
    world = _int_env("WORLD_SIZE") or 1
    if world <= 1:
        return False
    nodes = _int_env("CROSS_SIZE")
    if nodes is not None:
        return nodes > 1
    local = _int_env("LOCAL_SIZE", "LOCAL_WORLD_SIZE")
    if local is not None:
        return local < world
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        return not ipaddress.ip_address(master).is_loopback
    except ValueError:  # a host name
        return master != "localhost"


def route_interface(address: str) -> tuple[str, str]:
    """(interface, local address) this host uses to reach `address`; OSError naming the address when it cannot be
    resolved or routed."""
    import psutil

    try:
        family, _, _, _, sockaddr = socket.getaddrinfo(address, 9, proto=socket.IPPROTO_UDP)[0]
    except socket.gaierror as e:
        raise OSError(f"MASTER_ADDR {address!r} does not resolve ({e.strerror})") from None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(sockaddr[:2])  # a route lookup: no packet is sent
        except OSError as e:
            raise OSError(f"no route from this host to MASTER_ADDR {address} ({e.strerror})") from None
        local = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == local for a in addresses):
            return name, local
    raise OSError(f"this host reaches MASTER_ADDR {address} from {local}, which no interface holds")


def choose_socket_interfaces(cuda: bool) -> str | None:
    """Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on CUDA) to the interface that routes to MASTER_ADDR, unless
    set; returns the line that says so (None: the user's choice kept). OSError, one line, where no interface
    reaches it from this host other than loopback."""
    wanted = ["GLOO_SOCKET_IFNAME"] + (["NCCL_SOCKET_IFNAME"] if cuda else [])
    unset = [v for v in wanted if not os.environ.get(v)]
    if not unset:
        return None
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    host = socket.gethostname()
    hint = f"set {' and '.join(unset)} to the interface of this host ({host}) that reaches the other nodes"
    try:
        interface, local = route_interface(master)
    except OSError as e:
        raise OSError(f"--master_addr {master}: {e}; {hint}") from None
    if ipaddress.ip_address(local).is_loopback:  # several nodes cannot meet on a loopback address
        raise OSError(f"--master_addr {master}: this host ({host}) reaches it through loopback ({local}), which "
                      f"the other nodes cannot reach: give node 0's address on the network between the nodes, or "
                      f"{hint}")  # fmt: skip
    for variable in unset:
        os.environ[variable] = interface
    return (f"network: {host}: collectives over {interface} ({local}, its route to --master_addr {master}); "
            f"{'/'.join(unset)} set to it (set them to choose another)")  # fmt: skip


def apply_deepspeed_env() -> str | None:
    """`.deepspeed_env`'s `KEY=VALUE` lines into this process's environment, as DeepSpeed's ssh launch exports
    them (later files and lines win); the line that says which were set (None: no file)."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    applied, files = [], []
    for directory in DEEPSPEED_ENV_PATHS:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        files.append(path)
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, sep, value = line.partition("=")
                if not sep or not key.strip():
                    raise OSError(f"{path}:{number}: not KEY=VALUE")
                os.environ[key.strip()] = value
                applied.append(key.strip())
    if not files:
        return None
    return (f"{' and '.join(files)}: {', '.join(dict.fromkeys(applied)) or 'nothing'} set (DeepSpeed's launcher "
            "exports it only when it starts the nodes over ssh)")  # fmt: skip
