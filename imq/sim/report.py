"""What a simulation run reports: the summary table, the JSON document and the picture.

Nothing here prints: the table is returned as text, and the JSON and the picture are
written to the paths given. The picture needs matplotlib (the ``plot`` extra);
:func:`write_plot` raises :class:`PlotUnavailableError` without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from imq.errors import ImqError
from imq.sim.engine import SimResult, percentiles

__all__ = ["PlotUnavailableError", "summary_rows", "table", "to_json", "write_json", "write_plot"]


class PlotUnavailableError(ImqError):
    """matplotlib is not installed, so no picture can be drawn."""


def summary_rows(result: SimResult) -> list[tuple[str, str]]:
    cfg = result.config
    rows = [
        ("seed / shards / fan-out", f"{cfg.seed} / {cfg.shards} + masterchain / {cfg.fanout}"),
        ("nodes", f"{cfg.nodes}"),
        ("rounds (+ drain)", f"{result.rounds:,} (+ {result.drain_rounds:,})"),
        ("blocks written / committed", f"{result.blocks:,} / {result.blocks_committed:,}"),
        ("commits (masterchain blocks)", f"{result.commits:,}"),
        ("messages created", f"{result.messages_created:,}"),
        ("messages delivered", f"{result.messages_delivered:,}"),
        ("restarts (of which kills)", f"{result.restarts:,} ({result.kills:,})"),
        (
            "resets (clears + restarts)",
            f"{result.resets:,} ({result.clears:,} + {result.restarts:,})",
        ),
        ("blocks rolled back", f"{result.rolled_back_blocks:,}"),
        ("cancelled collations", f"{result.cancelled:,}"),
        ("GC passes", f"{result.gc_passes:,}"),
        (
            "GC deletions / collected (queue's counts)",
            f"{result.gc_deletions:,} / {result.gc_collected:,}",
        ),
        (
            "queue state checks failed / made",
            f"{len(result.state_errors):,} / {result.state_checks:,} "
            f"({result.check_seconds:,.1f} s of the wall time)",
        ),
        ("wall time", f"{result.seconds:,.1f} s"),
        (
            "time inside queue calls",
            f"{result.queue_seconds:,.1f} s "
            f"({100 * result.queue_seconds / max(result.seconds, 1e-9):.0f}% of wall time)",
        ),
        ("end-to-end messages/s", f"{result.messages_per_second:,.0f}"),
    ]
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3f}"


def table(result: SimResult) -> str:
    rows = summary_rows(result)
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k:<{width}}  {v}" for k, v in rows]
    lines.append("")
    lines.append(
        f"  {'queue operation':<24} {'calls':>8} {'p50 ms':>9} {'p99 ms':>9} {'total s':>8}"
    )
    for op in sorted(result.latencies):
        samples = result.latencies[op]
        p50, p99 = percentiles(samples)
        lines.append(
            f"  {op:<24} {len(samples):>8,} {_ms(p50):>9} {_ms(p99):>9} {sum(samples):>8.3f}"
        )
    return "\n".join(lines)


def to_json(result: SimResult) -> dict[str, Any]:
    cfg = result.config
    ops = {}
    for op, samples in sorted(result.latencies.items()):
        p50, p99 = percentiles(samples)
        ops[op] = {
            "calls": len(samples),
            "p50_seconds": p50,
            "p99_seconds": p99,
            "total_seconds": sum(samples),
        }
    return {
        "verdict": result.verdict(),
        "verified": result.verified,
        "config": {
            "seed": cfg.seed,
            "shards": cfg.shards,
            "rounds": cfg.rounds,
            "duration": cfg.duration,
            "fanout": cfg.fanout,
            "commit_every": cfg.commit_every,
            "read_limit": cfg.read_limit,
            "nodes": cfg.nodes,
        },
        "nodes_agree": not result.disagreements,
        "node_disagreements": result.disagreements,
        "agreed_exports": result.agreed_exports,
        "agreed_contents_messages": result.agreed_contents_messages,
        "rounds": result.rounds,
        "drain_rounds": result.drain_rounds,
        "blocks": result.blocks,
        "blocks_committed": result.blocks_committed,
        "commits": result.commits,
        "messages_created": result.messages_created,
        "messages_delivered": result.messages_delivered,
        "lost": result.lost,
        "duplicated": result.duplicated,
        "restarts": result.restarts,
        "kills": result.kills,
        "resets": result.resets,
        "clears": result.clears,
        "rolled_back_blocks": result.rolled_back_blocks,
        "cancelled_collations": result.cancelled,
        "gc_passes": result.gc_passes,
        "gc_deletions": result.gc_deletions,
        "gc_messages_collected": result.gc_collected,
        "seconds": result.seconds,
        "queue_seconds": result.queue_seconds,
        "messages_per_second": result.messages_per_second,
        "operations": ops,
        "violations": [str(v) for v in result.violations[:100]],
        "state_checks": result.state_checks,
        "state_check_seconds": result.check_seconds,
        "state_errors": result.state_errors[:100],
        "series": [
            {
                "round": s.round,
                "seconds": round(s.seconds, 4),
                "committed_depth": s.committed_depth,
                "uncommitted": s.uncommitted,
                "gc_collected": s.gc_collected,
            }
            for s in result.samples
        ],
    }


def write_json(result: SimResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(result), indent=1) + "\n", encoding="utf-8")


def write_plot(result: SimResult, path: Path) -> None:
    """``report.png``: queue depth per shard (committed), uncommitted messages per shard,
    and messages collected by GC, over the run's rounds."""
    try:
        import matplotlib  # noqa: PLC0415 - optional dependency

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError as exc:
        raise PlotUnavailableError(
            "matplotlib is not installed: no report.png (pip install 'imq[plot]')"
        ) from exc
    samples = result.samples
    # Long runs: one point per bucket of rounds (the mean), so the lines stay readable.
    size = max(1, -(-len(samples) // 400))
    buckets = [samples[i : i + size] for i in range(0, len(samples), size)]
    rounds = [b[-1].round for b in buckets]
    shards = sorted({k for s in samples for k in s.committed_depth})

    def mean(values: list[int]) -> float:
        return sum(values) / len(values)

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    for shard in shards:
        depth = [mean([s.committed_depth.get(shard, 0) for s in b]) for b in buckets]
        pending = [mean([s.uncommitted.get(shard, 0) for s in b]) for b in buckets]
        axes[0].plot(rounds, depth, label=shard)
        axes[1].plot(rounds, pending, label=shard)
    per = f" (mean of {size} rounds)" if size > 1 else ""
    axes[0].set_ylabel(f"committed, unread\n(by destination){per}")
    axes[1].set_ylabel(f"in uncommitted diffs\n(by source){per}")
    axes[2].plot(rounds, [b[-1].gc_collected for b in buckets], color="tab:green")
    axes[2].set_ylabel("collected by GC\n(cumulative)")
    axes[2].set_xlabel("round")
    if result.rounds:
        for ax in axes:
            ax.axvline(result.rounds + 0.5, color="grey", linestyle=":", linewidth=1)
    axes[0].legend(fontsize="small", ncol=3)
    axes[0].set_title(result.verdict(), fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
