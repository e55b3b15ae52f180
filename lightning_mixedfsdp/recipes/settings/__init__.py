"""What a recipe says (``schema``: its sections, merged and checked) and what it points at (``inputs``: the model
config or directory, the data files and their format, the tokenizer)."""
