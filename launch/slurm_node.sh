#!/usr/bin/env bash
# One node's DeepSpeed launcher under Slurm: `srun --nodes N --ntasks-per-node 1 launch/slurm_node.sh [train.py options]`.
# It writes the hostfile of the allocation (SLURM_JOB_NODELIST, slots = GPUS_PER_NODE, default 8) into
# $GLM53_HOSTFILE (default: hostfile.$SLURM_JOB_ID in the working directory, which every node must share) and runs
# `deepspeed --no_ssh --node_rank $SLURM_NODEID` with the first node as --master_addr, no ssh between the nodes.
set -euo pipefail
: "${SLURM_JOB_NODELIST:?run it under srun (SLURM_JOB_NODELIST is not set)}"
: "${SLURM_NODEID:?run it under srun (SLURM_NODEID is not set)}"
hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
hostfile=${GLM53_HOSTFILE:-hostfile.${SLURM_JOB_ID:-job}}
if [ "$SLURM_NODEID" = 0 ]; then
  tmp="$hostfile.tmp.$$"
  for h in $hosts; do echo "$h slots=${GPUS_PER_NODE:-8}"; done > "$tmp"
  mv "$tmp" "$hostfile"
fi
for _ in $(seq 600); do [ -f "$hostfile" ] && break; sleep 0.1; done
master=$(echo "$hosts" | head -n 1)
cd "$(dirname "$0")/.."
exec deepspeed --hostfile "$hostfile" --no_ssh --node_rank "$SLURM_NODEID" --master_addr "$master" \
  --master_port "${MASTER_PORT:-29500}" launch/train.py "$@"
