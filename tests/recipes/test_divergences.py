"""The distillation losses against their formulas written out, and the chunked computation against the whole
logits: the same sums and the same gradients, padded vocabularies and untrained tokens included."""

import pytest
import torch

from lightning_mixedfsdp.recipes.objectives.divergences import DIVERGENCES, distillation_sums, token_divergences

VOCAB, PADDED_STUDENT, PADDED_TEACHER = 11, 13, 16


def _by_formula(student: torch.Tensor, teacher: torch.Tensor, kind: str, temperature: float) -> torch.Tensor:
    p_s = torch.softmax(student.double() / temperature, -1)
    p_t = torch.softmax(teacher.double() / temperature, -1)
    if kind == "forward_kl":
        value = (p_t * (p_t.log() - p_s.log())).sum(-1)
    elif kind == "reverse_kl":
        value = (p_s * (p_s.log() - p_t.log())).sum(-1)
    else:
        m = (p_t + p_s) / 2
        value = ((p_t * (p_t.log() - m.log())).sum(-1) + (p_s * (p_s.log() - m.log())).sum(-1)) / 2
    return value * temperature**2


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_each_divergence_is_its_formula(kind: str, temperature: float) -> None:
    torch.manual_seed(0)
    student, teacher = torch.randn(7, VOCAB) * 3, torch.randn(7, VOCAB) * 3
    got = token_divergences(student, teacher, kind, temperature)  # type: ignore[arg-type]
    torch.testing.assert_close(got.double(), _by_formula(student, teacher, kind, temperature), rtol=1e-5, atol=1e-6)
    assert (got >= 0).all()
    assert token_divergences(student, student, kind, temperature).abs().max() < 1e-6  # zero against itself


@pytest.mark.parametrize("kind", DIVERGENCES)
def test_the_chunked_sums_and_grads_equal_the_whole_logits_over_the_real_vocabulary(kind: str) -> None:
    torch.manual_seed(1)
    student_hidden = torch.randn(2, 9, 6, requires_grad=True)
    student_weight = torch.randn(PADDED_STUDENT, 6, requires_grad=True)
    teacher_hidden, teacher_weight = torch.randn(2, 9, 10), torch.randn(PADDED_TEACHER, 10)
    targets = torch.randint(0, VOCAB, (2, 9))
    targets[0, :3] = -100  # a prompt's tokens: not trained

    chunked = distillation_sums(
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, VOCAB, kind, 2.0, chunk_tokens=4
    )
    (chunked.divergence + 0.5 * chunked.cross_entropy).backward()
    chunked_grads = (student_hidden.grad.clone(), student_weight.grad.clone())
    student_hidden.grad = student_weight.grad = None

    trained = targets.reshape(-1) != -100
    student_logits = (student_hidden.reshape(-1, 6) @ student_weight.t())[trained]
    teacher_logits = (teacher_hidden.reshape(-1, 10) @ teacher_weight.t())[trained]
    divergence = _by_formula(student_logits[:, :VOCAB], teacher_logits[:, :VOCAB], kind, 2.0).sum()
    cross_entropy = torch.nn.functional.cross_entropy(student_logits, targets.reshape(-1)[trained], reduction="sum")
    (divergence.float() + 0.5 * cross_entropy).backward()

    assert chunked.tokens == 15
    torch.testing.assert_close(chunked.divergence.double(), divergence, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked.cross_entropy, cross_entropy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(chunked_grads[0], student_hidden.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(chunked_grads[1], student_weight.grad, rtol=1e-5, atol=1e-5)
