"""PNG plots written by jobs (matplotlib without a display)."""

from __future__ import annotations

import io

from pipeline import storage


def plot_loss_curve(history: list[dict], uri: str, title: str = "training loss") -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["loss"] for h in history], label="loss")
    for key in sorted({k for h in history for k in h if k.endswith("_loss")}):
        ax.plot(steps, [h.get(key) for h in history], label=key, alpha=0.7)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes(uri, buf.getvalue())
    return uri
