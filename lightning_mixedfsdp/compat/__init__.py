"""Every private or optional third-party API the library uses, one module per library, each access behind one small
function noted with the versions it was checked on: ``torch`` (private torch APIs), ``torchao`` (the 4-bit NF4
tensor and float8 training, the optional ``qlora``/``float8`` extras), ``torchft`` (fault tolerance, the ``ft``
extra), ``transformers`` (its expert-parallel API); ``extras``: each optional package's install line, given by every
lazy import of one that is missing. The room below every other: it imports none of them."""
