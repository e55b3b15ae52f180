"""A recipe's data: text windows (``text``), and fine-tuning rows from chat or instruction records (``chat``,
``sft``, ``chat_corpus``, ``stdlib_chat``)."""
