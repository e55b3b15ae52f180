"""Writing an fp32 result into a bf16 tensor without losing what rounding to nearest would lose.

bf16 keeps 8 significant bits: an update below half the spacing at a value rounds back to the value it started from.

- :func:`round_stochastically`: rounds up with the probability of the distance to the number below (so the rounded
  value's expectation is the fp32 one), with bits from a given generator: ranks that hold the same shard and seed
  their generator alike round alike.
- :func:`compensated_write`: Kahan summation. A bf16 buffer keeps what each rounding lost and adds it to the next
  update; bf16's own 8 bits set its floor: updates under about 1/512 of the param's spacing still stall.
"""

import hashlib
from typing import Sequence

import torch
from torch import Tensor

_LOW_HALF = 1 << 16


def round_stochastically(value: Tensor, generator: torch.Generator) -> Tensor:
    """``value`` (fp32) in bf16, each element rounded down or up at random, up with the probability of its distance
    from the bf16 number below it (in magnitude)."""
    bits = value.float().contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW_HALF, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    # adding below bf16's last bit carries into it with that probability; clearing the low half truncates exactly
    rounded = (bits + noise) & -_LOW_HALF
    return rounded.view(torch.float32).to(torch.bfloat16)


def compensated_write(param: Tensor, update: Tensor, compensation: Tensor) -> None:
    """``param += update`` (``update`` fp32) rounded to nearest, the part rounding lost kept in ``compensation``
    (bf16, the param's shape) and added to the next update."""
    before = param.float()
    wanted = update + compensation.float()
    param.copy_(before + wanted)
    compensation.copy_(wanted - (param.float() - before))


def generator_for(seed: int, step: int, index: int, shard: Sequence[int], device: torch.device) -> torch.Generator:
    """A generator seeded from the run's ``seed``, the optimizer ``step``, the param's ``index`` in its optimizer and
    the ``shard`` it holds (its coordinates on the mesh dims that split it): the same on every replica of a shard,
    another for every other shard, param and step."""
    key = f"{seed}/{step}/{index}/{'.'.join(map(str, shard))}".encode()
    generator = torch.Generator(device=device)
    generator.manual_seed(int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
    return generator
