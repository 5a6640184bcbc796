"""`megarl sync plan`: what a weight sync between two layouts moves, planned without any weights.

The reshard plan of `megarl.hybrid.plan` is built from the model's shapes alone, so a cluster can be
sized before it exists: bytes each rank receives and sends, the minimum any plan must move, the
largest per-rank transfer, the bytes that cross node boundaries for a given number of GPUs per node
(ranks fill nodes in order, as torchrun and Ray placement groups place them), and a predicted sync
time. The prediction is a bound from bandwidth alone: every rank sends and receives at once (links
are full duplex), a transfer within a node runs at `--intra-gbps` and one between nodes at
`--inter-gbps`, so a rank needs max(receive time, send time) and the sync the largest of those.
Latency, bucket scheduling and the local copies are left out.

Expert-parallel training layouts (ep > 1) are planned too, as the live weight sync takes them: into
the HF engine at rollout TP 1 and into vLLM's fused expert parameters at rollout TP > 1. Two
planners: the per-rank one (`megarl.hybrid.rank_plan`, senders by a closed-form rule; the default,
and what the weight sync runs, each rank its own part), whose cost per rank does not grow with the
world, and with `--senders least_loaded` the whole-world one (`build_reshard_plan`, each sender
the least-loaded replica so far), whose cost does. Both move exactly the minimum and every rank
receives the same bytes; they differ only in who sends what.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from megarl.errors import ConfigError

EXAMPLES = """examples:
  megarl sync plan Qwen2.5-72B/config.json --train tp=8,pp=4,dp=2 --rollout-tp 8 --engine vllm --dtype bf16
  megarl sync plan config.json --train tp=2,dp=2 --rollout-tp 1 --gpus-per-node 2 --json
  megarl sync plan Qwen3-30B-A3B/config.json --train tp=2,dp=4,ep=8,etp=1 --rollout-tp 4
"""
LAYOUT_KEYS = ("tp", "pp", "dp", "cp", "ep", "etp")  # etp: expert tensor parallel size (default: tp)
DTYPES = ("fp32", "bf16", "fp16")


def parse_layout(text: str) -> dict[str, int]:
    """"tp=8,pp=4,dp=2" -> {"tp": 8, "pp": 4, "dp": 2}; unnamed degrees are 1, an unnamed etp 0 (= tp)."""
    out = {k: 1 for k in LAYOUT_KEYS} | {"etp": 0}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in LAYOUT_KEYS or not value.strip().isdigit() or int(value) < 1:
            raise ConfigError(f"--train {text!r}: {part!r} is not <degree>=<integer >= 1> with a degree from "
                              f"{', '.join(LAYOUT_KEYS)} (e.g. tp=8,pp=4,dp=2)")
        out[key.strip()] = int(value)
    return out


@dataclass
class RankTraffic:
    received: int = 0
    sent: int = 0
    minimum: int = 0
    received_inter_node: int = 0
    sent_inter_node: int = 0

    def seconds(self, intra_bps: float, inter_bps: float) -> float:
        recv = (self.received - self.received_inter_node) / intra_bps + self.received_inter_node / inter_bps
        send = (self.sent - self.sent_inter_node) / intra_bps + self.sent_inter_node / inter_bps
        return max(recv, send)


@dataclass
class Traffic:
    """What a plan moves: per rank bytes (received, sent, minimum), bytes per (sender, receiver)
    pair, and the number of buckets."""

    ranks: dict[int, RankTraffic]
    pairs: dict[tuple[int, int], int]
    buckets: int


def plan_traffic(plan: Any) -> Traffic:
    """The traffic of a whole-world `ReshardPlan`."""
    ranks = {r: RankTraffic(received=b.received, sent=b.sent, minimum=b.minimum) for r, b in plan.bytes.items()}
    pairs: dict[tuple[int, int], int] = {}
    for step in plan.steps:
        for pair, pieces in step.items():
            pairs[pair] = pairs.get(pair, 0) + sum(p.nbytes for p in pieces)
    return Traffic(ranks, pairs, sum(len(step) for step in plan.steps))


def rank_planner_traffic(planner: Any) -> Traffic:
    """The traffic of every rank's plan from a `RankPlanner`: each pair is some rank's receive,
    so the receiving halves suffice (the sending halves are the same pieces)."""
    ranks: dict[int, RankTraffic] = {}
    pairs: dict[tuple[int, int], int] = {}
    buckets = 0
    for rank in range(planner.train.world_size):
        counts, received = planner.received_pairs(rank)
        ranks[rank] = RankTraffic(received=counts.received, minimum=counts.minimum)
        for pair, (nbytes, n) in received.items():
            pairs[pair] = nbytes
            buckets += n
    for (src, _), nbytes in pairs.items():
        ranks[src].sent += nbytes
    return Traffic(ranks, pairs, buckets)


def summarize(plan: Any, gpus_per_node: int, intra_gbps: float, inter_gbps: float,
              traffic: Traffic | None = None, senders: str = "least_loaded") -> dict[str, Any]:
    """The traffic of a whole-world `ReshardPlan`, or of a `RankPlanner`'s plans (`traffic`
    given), per rank and in all, and the predicted sync time."""
    if gpus_per_node < 1 or intra_gbps <= 0 or inter_gbps <= 0:
        raise ConfigError("--gpus-per-node must be >= 1 and the bandwidths > 0")
    traffic = traffic or plan_traffic(plan)
    ranks = traffic.ranks
    for (src, dst), nbytes in traffic.pairs.items():
        if src // gpus_per_node != dst // gpus_per_node:
            ranks[dst].received_inter_node += nbytes
            ranks[src].sent_inter_node += nbytes
    seconds = {r: t.seconds(intra_gbps * 1e9, inter_gbps * 1e9) for r, t in ranks.items()}
    slowest = max(seconds, key=seconds.get)
    return {
        "world_size": plan.world_size, "train": _layout(plan.train), "rollout_tp": plan.rollout.tp,
        "engine": plan.engine, "dtype": str(plan.dtype).replace("torch.", ""), "gpus_per_node": gpus_per_node,
        "senders": senders,
        "bytes_received": sum(t.received for t in ranks.values()),
        "bytes_minimum": sum(t.minimum for t in ranks.values()),
        "bytes_inter_node": sum(t.received_inter_node for t in ranks.values()),
        "largest_rank_received": max(t.received for t in ranks.values()),
        "largest_rank_sent": max(t.sent for t in ranks.values()),
        "buckets": traffic.buckets,
        "intra_node_gbps": intra_gbps, "inter_node_gbps": inter_gbps,
        "predicted_seconds": seconds[slowest], "slowest_rank": slowest,
        "ranks": {r: {**vars(t), "predicted_seconds": seconds[r]} for r, t in ranks.items()},
    }


SENDERS_MEANING = {"by_rank": "each rank's own plan, as the weight sync runs it",
                   "least_loaded": "whole-world plan; the same bytes received, least-loaded senders"}


def _layout(layout: Any) -> dict[str, int]:
    return {k: getattr(layout, k) for k in LAYOUT_KEYS}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def render(summary: dict[str, Any], per_rank: bool) -> str:
    degrees = summary["train"]
    train = ",".join(f"{k}={v}" for k, v in degrees.items()
                     if k == "tp" or (v != degrees["tp"] if k == "etp" else v != 1))
    lines = [
        f"sync {train} -> {summary['engine']} rollout tp={summary['rollout_tp']} ({summary['world_size']} ranks, "
        f"{summary['dtype']}, {summary['gpus_per_node']} GPUs per node)",
        f"  senders           {summary['senders']} ({SENDERS_MEANING[summary['senders']]})",
        f"  received in all   {_gib(summary['bytes_received'])} (minimum {_gib(summary['bytes_minimum'])}), "
        f"{summary['buckets']} buckets",
        f"  across nodes      {_gib(summary['bytes_inter_node'])}",
        f"  largest per rank  received {_gib(summary['largest_rank_received'])}, sent {_gib(summary['largest_rank_sent'])}",
        f"  predicted time    {summary['predicted_seconds']:.3f} s (rank {summary['slowest_rank']}; "
        f"{summary['intra_node_gbps']:g} GB/s within a node, {summary['inter_node_gbps']:g} GB/s between nodes)",
    ]
    if per_rank:
        lines.append("  rank  received GiB  sent GiB  inter-node in/out GiB  seconds")
        for r, t in summary["ranks"].items():
            lines.append(f"  {r:4d}  {t['received'] / 2**30:12.3f}  {t['sent'] / 2**30:8.3f}  "
                         f"{t['received_inter_node'] / 2**30:10.3f} / {t['sent_inter_node'] / 2**30:<8.3f}  "
                         f"{t['predicted_seconds']:.3f}")
    return "\n".join(lines)


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sync", help="plan a weight sync between layouts: bytes per rank, cross-node traffic, predicted time",
        description=__doc__.splitlines()[0], epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="sync_command", required=True, metavar="{plan}")
    p = sub.add_parser("plan", help="plan without weights and print the traffic")
    p.add_argument("model", help="a HF config.json, or a directory holding one")
    p.add_argument("--spec", default=None, help="model spec family (default: from the config's model_type)")
    p.add_argument("--train", required=True,
                   help="training layout, e.g. tp=8,pp=4,dp=2 (cp, ep and etp, the expert tensor parallel size, too)")
    p.add_argument("--rollout-tp", type=int, required=True, help="rollout tensor-parallel size")
    p.add_argument("--engine", choices=("hf", "vllm"), default=None,
                   help="rollout engine layout (default: hf at rollout tp 1, else vllm)")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of the moved weights")
    p.add_argument("--bucket-mib", type=float, default=64.0, help="largest bucket per (sender, receiver) and step")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-gbps", type=float, default=150.0, help="GB/s per GPU within a node")
    p.add_argument("--inter-gbps", type=float, default=25.0, help="GB/s per GPU between nodes")
    p.add_argument("--senders", choices=("by_rank", "least_loaded"), default="by_rank",
                   help="by_rank: every rank's own plan (`megarl.hybrid.rank_plan`), what the weight sync runs; "
                        "least_loaded: the whole-world plan with the least-loaded replica sending (slow at scale)")
    p.add_argument("--per-rank", action="store_true", help="also print every rank's traffic")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    # Imported here: the other `megarl` commands start without torch.
    from megarl.dtypes import torch_dtype
    from megarl.hybrid.plan import build_reshard_plan
    from megarl.hybrid.rank_plan import RankPlanner
    from megarl.layout import ParallelLayout
    from megarl.models.spec import ModelSpec

    degrees = parse_layout(args.train)
    train = ParallelLayout(**degrees)
    try:
        train.resolved(train.world_size)
    except ConfigError as err:
        raise ConfigError(f"--train {args.train}: {err}") from None
    world = train.world_size
    if args.rollout_tp < 1 or world % args.rollout_tp:
        raise ConfigError(f"--rollout-tp {args.rollout_tp} must be >= 1 and divide the world size {world} "
                          f"of --train {args.train}")
    engine = args.engine or ("hf" if args.rollout_tp == 1 else "vllm")
    if engine == "hf" and args.rollout_tp != 1:
        raise ConfigError("--engine hf holds whole tensors: it needs --rollout-tp 1 (use --engine vllm)")
    if not args.bucket_mib > 0:
        raise ConfigError(f"--bucket-mib {args.bucket_mib:g}: must be > 0 (the largest bucket, in MiB)")
    spec = ModelSpec.from_hf_config(args.model, family=args.spec)
    rollout = ParallelLayout.rollout(args.rollout_tp, world)
    dtype, bucket_bytes = torch_dtype(args.dtype), int(args.bucket_mib * 2**20)
    senders = args.senders
    if senders == "by_rank":
        planner = RankPlanner(spec, train, rollout, engine, dtype, bucket_bytes)
        summary = summarize(planner, args.gpus_per_node, args.intra_gbps, args.inter_gbps,
                            rank_planner_traffic(planner), senders)
    else:
        plan = build_reshard_plan(spec, train, rollout, engine, dtype=dtype, bucket_bytes=bucket_bytes)
        summary = summarize(plan, args.gpus_per_node, args.intra_gbps, args.inter_gbps)
    if args.json:
        json.dump(summary, sys.stdout, indent=1)
        print()
    else:
        print(render(summary, args.per_rank))
    return 0
