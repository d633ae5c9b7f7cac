"""The request path's processes: tokenizer manager, scheduler, detokenizer."""
