"""The text side: the tokenizer, the chat template, prompts to token ids, the tool-call and thinking parser,
constraints on the answer's form, and sampling."""
