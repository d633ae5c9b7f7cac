"""Chat prompts shared by the same-answer tests: everyday questions under one system prompt."""

from __future__ import annotations

SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about ships.",
    "Explain photosynthesis in one sentence.",
    "What is 17 times 3?",
    "Name three primary colors.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' to Spanish.",
    "What is the boiling point of water?",
    "Give me a synonym for happy.",
    "How many legs does a spider have?",
    "What does CPU stand for?",
    "Write a Python function that adds two numbers.",
    "What is the largest planet in our solar system?",
    "Describe a cat in five words.",
    "Why is the sky blue?",
    "List two benefits of exercise.",
    "What year did World War II end?",
    "What is the square root of 81?",
    "Suggest a name for a pet goldfish.",
    "How do you make tea?",
    "What language is spoken in Brazil?",
    "What is the opposite of cold?",
]


def messages(question: str, system: str | None = SYSTEM_PROMPT) -> list[dict[str, str]]:
    head = [{"role": "system", "content": system}] if system is not None else []
    return [*head, {"role": "user", "content": question}]


def prompt_ids(tokenizer, question: str, system: str | None = SYSTEM_PROMPT) -> list[int]:
    """The token ids `berth serve` prefills for this chat request."""
    text = tokenizer.apply_chat_template(
        messages(question, system), tokenize=False, add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False)
