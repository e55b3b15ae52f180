"""What every rank of a distributed section must agree on: a failure on one rank reaches every rank as the same error
(``agreement.py``), so no rank is left waiting in a collective its failed peer will never join."""
