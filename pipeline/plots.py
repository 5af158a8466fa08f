"""PNG plots written by jobs (matplotlib without a display)."""

from __future__ import annotations

import contextlib
import io

from pipeline import storage


@contextlib.contextmanager
def png_figure(uri: str, size: tuple[float, float], dpi: int = 100):
    """Yield a fresh axes; on exit, save the figure as PNG to ``uri`` (local or s3://)."""
    import matplotlib

    matplotlib.use("Agg")  # jobs run without a display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
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


def plot_cls_entropy(results: list[dict], uri: str) -> str:
    """One line per checkpoint (layer 1..L vs mean entropy), dashed: its uniform-attention level."""
    with png_figure(uri, (6, 3.8), dpi=110) as ax:
        for res in results:
            x = [layer["layer"] for layer in res["layers"]]
            (line,) = ax.plot(x, [layer["mean"] for layer in res["layers"]], marker="o", label=res["label"])
            ax.axhline(res["uniform_entropy"], color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.6)
        ax.set_ylim(bottom=0)
        ax.set(xlabel="layer", ylabel="CLS attention entropy (nats)",
               title="CLS attention entropy (dashed: uniform attention)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend()
    return uri
