"""The fine-tuning data module: chat or instruction examples (``sft_data.py``) as packed or padded rows, the training
stream carrying each step's trained-token count, and the held-out rows sharded over the data-parallel ranks."""

from typing import Optional

from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_mixedfsdp.recipes.data.sft import (
    ExampleMaker,
    Rows,
    RowSet,
    StepRows,
    fine_tuning_examples,
    packed_rows,
    padded_rows,
)
from lightning_mixedfsdp.recipes.data.text import SizedDataset, TextCorpus
from lightning_mixedfsdp.recipes.settings.inputs import resolved_format
from lightning_mixedfsdp.recipes.settings.schema import DataSection


class ChatCorpus(TextCorpus):
    """Rows of the recipe's conversations or prompt/completion pairs. ``packed``: several examples per row (off under
    context parallelism, whose attention takes no packed-document mask); ``accumulate``: micro-batches per optimizer
    step, for the step's trained-token count."""

    keyed_stream = True

    def __init__(self, data: DataSection, seed: int, micro_batches: int, accumulate: int, packed: bool) -> None:
        super().__init__(data, seed, micro_batches)
        self.format, self.accumulate, self.packed = resolved_format(data), accumulate, packed
        self.maker = ExampleMaker(data, self.format, self.tokenizer)
        """Records to examples: this run's format, tokenizer and template (the answer at the end uses it too)."""
        self.train_rows: Optional[Rows] = None
        self.held_out_rows: Optional[Rows] = None

    @override
    def setup(self, stage: str) -> None:
        data = self.data
        splits = fine_tuning_examples(data, self.maker)
        if splits.problems or not splits.train or not splits.held_out:  # the launcher checked the same before
            raise ValueError("; ".join(splits.problems) or "data: no examples to train or evaluate on")
        pad = self.maker.pad
        make = packed_rows if self.packed else padded_rows
        self.train_rows, self.held_out_rows = (
            make(splits.train, data.seq_len, pad),
            make(splits.held_out, data.seq_len, pad),
        )
        self.val_set = RowSet(self.held_out_rows, data.val_windows)
        longer = ""
        if splits.too_long:
            verb = "left out" if data.too_long == "drop" else "truncated"
            longer = f"; {splits.too_long} longer than {data.seq_len} tokens {verb} ({splits.dropped} left out in all)"
        rank_zero_info(
            f"data: {self.format}, {len(splits.train)} training and {len(splits.held_out)} held-out examples in"
            f" {len(self.train_rows)} and {len(self.held_out_rows)} rows of {data.seq_len} tokens"
            f" ({'packed' if self.packed else 'one per row'}, {self.train_rows.padding:.0%} padding){longer}"
        )

    @override
    def _training_set(self, ranks: int) -> SizedDataset:
        assert self.train_rows is not None
        return StepRows(self.train_rows, self.seed, self.data.batch_size, ranks, self.accumulate)
