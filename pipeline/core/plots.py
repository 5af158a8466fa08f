"""PNG plots written by jobs.

Figures are built with matplotlib's object API and rendered by its Agg canvas, so no
backend is chosen globally and no display is needed.
"""

from __future__ import annotations

import contextlib
import io

from pipeline.core import storage


@contextlib.contextmanager
def png_figure(uri: str, size: tuple[float, float], dpi: int = 100):
    """Yield a fresh axes; on exit, save the figure as PNG to ``uri`` (local or s3://)."""
    fig = new_figure(size)
    ax = fig.subplots()
    yield ax
    save_png(fig, uri, dpi)


def new_figure(size: tuple[float, float]):
    """A matplotlib Figure, not tied to any pyplot backend."""
    # Imported here: every training worker imports this module through its task, but only
    # drivers draw, and matplotlib costs each worker ~0.5 s of its start.
    from matplotlib.figure import Figure

    return Figure(figsize=size)


def save_png(fig, uri: str, dpi: int) -> None:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    storage.write_bytes(uri, buf.getvalue())


def plot_loss_curve(history: list[dict], uri: str, title: str = "training loss") -> str:
    with png_figure(uri, (6, 3.5)) as ax:
        _draw_loss_curve(ax, history, title)
    return uri


def _draw_loss_curve(ax, history: list[dict], title: str) -> None:
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], label="loss")
    for key in sorted({k for h in history for k in h if k.endswith("_loss")}):
        ax.plot(steps, [h.get(key) for h in history], label=key, alpha=0.7)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()


def plot_metrics(rows: dict[str, dict[str, float]], metrics: tuple[str, ...], uri: str, title: str) -> str:
    """One panel per metric, a bar per row (a stage of a recipe, or one evaluation), its value
    written on it: the tables of ``results.md`` / ``metrics.json`` at a glance."""
    labels = list(rows)
    metrics = tuple(m for m in metrics if any(m in values for values in rows.values())) or metrics[:1]
    fig = new_figure((max(4.0, 1.1 * len(labels)) * len(metrics) / 2 + 1, 3.6))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        values = [rows[label].get(metric, 0.0) for label in labels]
        bars = ax.bar(range(len(labels)), values, color=[f"C{i}" for i in range(len(labels))])
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 1.2 * max(values, default=0) or 1.0)
        ax.set_title(metric)
    fig.suptitle(title)
    save_png(fig, uri, dpi=100)
    return uri


def plot_cls_entropy(results: list[dict], uri: str) -> str:
    """One line per checkpoint (layer 1..L vs mean entropy), dashed: its uniform-attention level."""
    with png_figure(uri, (6, 3.8), dpi=110) as ax:
        for res in results:
            x = [layer["layer"] for layer in res["layers"]]
            (line,) = ax.plot(x, [layer["mean"] for layer in res["layers"]], marker="o", label=res["label"])
            ax.axhline(res["uniform_entropy"], color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.6)
        ax.set_ylim(bottom=0)
        ax.set(
            xlabel="layer",
            ylabel="CLS attention entropy (nats)",
            title="CLS attention entropy (dashed: uniform attention)",
        )
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    return uri


def plot_cls_cosine(results: list[dict], uri: str) -> str:
    """One step histogram per checkpoint: the cosines of its passages' [CLS] vector pairs."""
    with png_figure(uri, (6, 3.8), dpi=110) as ax:
        for res in results:
            hist = res["cls_cosine"]["histogram"]
            total = max(1, sum(hist["counts"]))
            ax.stairs(
                [c / total for c in hist["counts"]],
                hist["edges"],
                label=f"{res['label']} (mean {res['cls_cosine']['mean']:.3f})",
            )
        ax.set(
            xlabel="cosine of two passages' [CLS] vectors",
            ylabel="share of pairs",
            title="[CLS] pairwise cosine (near 1: collinear)",
        )
        ax.legend(fontsize=8)
    return uri


def plot_method_comparison(rows: list[dict], metrics: tuple[str, ...], uri: str) -> str:
    """One panel per metric: a group of bars per pre-training method, a bar per training-set size."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    sizes = list(dict.fromkeys((r["train_size"], r["train_queries"]) for r in rows))
    width = 0.8 / len(sizes)
    fig = new_figure((4.2 * len(metrics), 3.8))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for j, (size, n_queries) in enumerate(sizes):
            values = {r["method"]: r["metrics"][metric] for r in rows if r["train_size"] == size}
            xs = [i + (j - (len(sizes) - 1) / 2) * width for i, m in enumerate(methods) if m in values]
            spread = {r["method"]: r.get("spread", {}).get(metric, 0.0) for r in rows if r["train_size"] == size}
            ax.bar(
                xs,
                [values[m] for m in methods if m in values],
                width,
                yerr=[spread[m] for m in methods if m in values],
                capsize=2,
                label=f"{n_queries} queries",
            )
        ax.set_xticks(range(len(methods)), methods, rotation=20)
        ax.set_title(metric)
        ax.set_ylim(bottom=0)
    axes[0][0].set_ylabel("dev")
    axes[0][-1].legend(title="fine-tuned on")
    save_png(fig, uri, dpi=110)
    return uri
