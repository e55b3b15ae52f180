"""The generated answer's text: cut at the byte template's end-of-turn marker, or at the start of one that decoding
ran out of new tokens inside."""

import pytest

from lightning_mixedfsdp.recipes.data.chat import BYTE_END_OF_TURN, cut_at_end_of_turn


@pytest.mark.parametrize(
    ("decoded", "answer"),
    [
        ("Return x.<|end|>\n<|user|>more", "Return x."),
        ("Return x.<|", "Return x."),
        ("Return x. <|en", "Return x."),
        ("Return x.<|end|", "Return x."),
        ("Return x.<", "Return x."),
        ("Return a | b.", "Return a | b."),
        ("<|e", ""),
    ],
)
def test_the_answer_ends_before_the_end_of_turn_marker_or_its_start(decoded: str, answer: str) -> None:
    assert BYTE_END_OF_TURN == "<|end|>"
    assert cut_at_end_of_turn(decoded) == answer
