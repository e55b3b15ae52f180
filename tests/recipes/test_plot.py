"""The run's plot: every value label of the perplexity panel inside its frame and the figure, drawn as the runner
draws it into metrics.png (the last point's label used to cross the right edge, the highest one's the top)."""

import math
from typing import Dict

import pytest

pytest.importorskip("matplotlib", reason="the plot needs matplotlib (pip install 'lightning-mixedfsdp[recipes]')")

from lightning_mixedfsdp.recipes.run.plot import Series, metrics_figure  # noqa: E402


def metrics(steps: int, untrained: float, middle: float, last: float) -> Dict[str, Series]:
    """A run's metrics as the CSV log gives them: a validation in the middle and at the last step (0-based)."""
    return {
        "train_loss": {step: 2.0 + math.exp(-step / 60) for step in range(steps)},
        "lr": {step: 0.003 * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps))) for step in range(steps)},
        "untrained_ppl": {0: untrained},
        "val_ppl": {steps // 2 - 1: middle, steps - 1: last},
    }


@pytest.mark.parametrize(
    "run",
    [metrics(250, 267.98, 12.94, 10.50), metrics(300, 21.69, 6.20, 3.91), metrics(8, 5000.50, 14.80, 1234.56)],
    ids=["main job", "fine-tuning", "wide labels"],
)
def test_every_value_label_lies_inside_its_frame_and_the_figure(run: Dict[str, Series]) -> None:
    import matplotlib.pyplot as plt

    figure = metrics_figure(run, "runs/stdlib_llama_sft: 300 steps")
    figure.canvas.draw()
    perplexity = figure.axes[1]
    frame, page = perplexity.get_window_extent(), figure.bbox
    labels = {text.get_text(): text.get_window_extent() for text in perplexity.texts}
    assert len(labels) == 3
    for text, label in labels.items():
        assert frame.x0 <= label.x0 and label.x1 <= frame.x1 and frame.y0 <= label.y0 and label.y1 <= frame.y1, text
    drawn = figure.get_tightbbox()  # inches
    assert (
        drawn.x0 >= 0 and drawn.y0 >= 0 and drawn.x1 <= page.width / figure.dpi and drawn.y1 <= page.height / figure.dpi
    )
    plt.close(figure)
