"""The run's metrics, read back from its CSV logs and drawn: training loss (with the learning rate) and held-out
perplexity against the optimizer step, as one PNG in the run folder."""

import csv
import re
from pathlib import Path
from typing import TYPE_CHECKING, Dict

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

from lightning_mixedfsdp.recipes.objectives.objective import UNTRAINED_PPL

Series = Dict[int, float]


def read_metrics(logs: Path) -> Dict[str, Series]:
    """Every metric of the run, as step -> value: the CSV logs of each launch (``logs/version_N/metrics.csv``) in
    launch order, a later launch's value replacing an earlier one's at the same step (a resumed run repeats the steps
    after its checkpoint)."""
    versions = sorted(logs.glob("version_*/metrics.csv"), key=lambda p: _version(p.parent.name))
    metrics: Dict[str, Series] = {}
    for path in versions:
        with path.open(newline="") as rows:
            for row in csv.DictReader(rows):
                step = int(row.pop("step"))
                row.pop("epoch", None)
                for name, value in row.items():
                    if value:
                        metrics.setdefault(name, {})[step] = float(value)
    return {name: dict(sorted(series.items())) for name, series in metrics.items()}


def _version(name: str) -> int:
    match = re.fullmatch(r"version_(\d+)", name)
    return int(match.group(1)) if match else -1


def plot_metrics(metrics: Dict[str, Series], path: Path, title: str) -> Path:
    """Training loss and learning rate (left), held-out perplexity on a log scale (right, step 0: untrained),
    against the number of optimizer updates the weights had."""
    import matplotlib.pyplot as plt

    figure = metrics_figure(metrics, title)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def metrics_figure(metrics: Dict[str, Series], title: str) -> "Figure":
    """The figure :func:`plot_metrics` saves."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    figure, (loss_axis, ppl_axis) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    loss = metrics.get("train_loss", {})
    lines = loss_axis.plot(list(loss), list(loss.values()), color="tab:blue", label="training loss")
    loss_axis.set(xlabel="optimizer step", ylabel="training loss (nats/token)", title="training loss")
    lr = metrics.get("lr", {})
    if lr:
        lr_axis = loss_axis.twinx()
        lines += lr_axis.plot(list(lr), list(lr.values()), color="tab:gray", linestyle="--", label="learning rate")
        lr_axis.set_ylabel("learning rate")
        lr_axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    loss_axis.legend(handles=lines, loc="upper right")
    # Lightning logs a validation under the 0-based index of the step it followed: drawn after that step, as the
    # training loss at step s is the loss of the weights after s updates
    ppl = {**metrics.get(UNTRAINED_PPL, {}), **{step + 1: v for step, v in metrics.get("val_ppl", {}).items()}}
    ppl_axis.plot(list(ppl), list(ppl.values()), color="tab:green", marker="o")
    for step, value in ppl.items():
        ppl_axis.annotate(f"{value:.2f}", (step, value), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ppl_axis.set(xlabel="optimizer step", ylabel="held-out perplexity", title="held-out perplexity", yscale="log")
    for axis in (loss_axis, ppl_axis):
        axis.grid(alpha=0.3)
    figure.suptitle(title)
    _keep_labels_inside(figure, ppl_axis)
    return figure


LABEL_PAD_PX = 3.0
"""Pixels between a value label and the axes' frame."""


def _keep_labels_inside(figure: "Figure", axis: "Axes") -> None:
    """Widen ``axis``'s limits until its value labels lie inside it: a label sits right of and above its point, so
    the last point's would cross the right edge of the frame (and leave the figure), the highest one's the top. The
    overflow is measured on the drawn figure; widening moves the points too, so it takes a few rounds."""
    for _ in range(5 if axis.texts else 0):
        figure.canvas.draw()  # lays the figure out: the labels' extents in pixels
        frame = axis.get_window_extent()
        labels = [text.get_window_extent() for text in axis.texts]
        right = max(label.x1 for label in labels) + LABEL_PAD_PX - frame.x1
        top = max(label.y1 for label in labels) + LABEL_PAD_PX - frame.y1
        if right <= 0 and top <= 0:
            return
        if right > 0:
            low, high = axis.get_xlim()
            axis.set_xlim(low, high + (high - low) * right / frame.width)
        if top > 0:  # the log axis widens in log space, as drawn
            low, high = axis.get_ylim()
            axis.set_ylim(low, high * (high / low) ** (top / frame.height))
