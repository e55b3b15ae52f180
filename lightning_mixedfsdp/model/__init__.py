"""Reading a user's model as it is: canonical names through wrappers (checkpoint, compile, Fabric, peft), HF and peft
detection, and the tensors inside nested inputs and outputs. No dtype decisions, no side effects."""
